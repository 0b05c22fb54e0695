"""MkDocs hooks: the benchmark pages come from ``benchmarks/results/`` at build time, and Sphinx roles render.

The benchmark programs write their tables (machine, versions, command, figures) to
``benchmarks/results/*.md`` and their plots beside them. This hook adds each table as a page
under ``benchmarks/``, the plots as files, and an index page listing them, so the site never holds a
hand-copied figure: re-running a benchmark updates its page on the next build.

The docstrings cross-reference with Sphinx roles (``:class:`~resumable_data.Stream```), which
Markdown shows literally; the rendered role is reduced to its code span (the name after a ``~``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = "benchmarks"
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):(?=<code>)")
_TILDE = re.compile(r"<code>~(?:[A-Za-z_][A-Za-z0-9_]*\.)*([A-Za-z_][A-Za-z0-9_]*)</code>")

INDEX = """# Benchmarks

Each page below is a table written by one of the programs in `benchmarks/` (`python
benchmarks/NAME.py`; `--quick` for a smoke run), copied here unchanged when the site is built. Each
states the machine, the versions, the date, the load it ran at and the exact command: other jobs
on a shared machine stretch absolute times, so compare methods within one table.
`benchmarks/README.md` in the repository explains how each is measured.

"""


def _title(text: str, fallback: str) -> str:
    first = text.lstrip().splitlines()[0] if text.strip() else ""
    return first.removeprefix("# ").strip() if first.startswith("# ") else fallback


def on_files(files: Files, config: Any) -> Files:
    tables = sorted(RESULTS.glob("*.md"))
    lines = [INDEX]
    for table in tables:
        text = table.read_text(encoding="utf-8")
        files.append(File.generated(config, f"{PAGES}/{table.name}", content=text))
        lines.append(f"- [{_title(text, table.stem)}]({table.name}) (`benchmarks/results/{table.name}`)\n")
    for plot in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"{PAGES}/{plot.name}", abs_src_path=str(plot)))
        lines.append(f"\n![{plot.stem}]({plot.name})\n")
    files.append(File.generated(config, f"{PAGES}/index.md", content="".join(lines)))
    return files


def on_page_content(html: str, **kwargs: Any) -> str:
    return _TILDE.sub(r"<code>\1</code>", _ROLE.sub("", html))
