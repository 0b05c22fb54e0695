"""Every ``>>>`` example in the library's docstrings runs and prints what it shows.

Examples that need files, a process group or a model are written as plain ``::`` code blocks
instead, so what remains here is executed documentation, not decoration.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import importlib.util
import pkgutil
import re
from pathlib import Path

import pytest

import resumable_data
from torchvision_compat import load_torchvision

LIBRARY = Path(resumable_data.__file__).parent

# The Lightning and transformers adapters import torchvision through their frameworks; on our CI's
# torch/torchvision pair that import needs the tests' workaround first (see torchvision_compat).
with contextlib.suppress(ImportError):
    load_torchvision()
OPTIONAL = {
    "resumable_data.integrations.lightning": "lightning",
    "resumable_data.integrations.transformers": "transformers",
    "resumable_data.integrations.accelerate": "accelerate",
}

MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(resumable_data.__path__, prefix="resumable_data.")
    # resumable_data.signals only re-exports a moved name, with a DeprecationWarning on import.
    if not name.endswith("__main__") and name != "resumable_data.signals"
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name], reason=f"the [{OPTIONAL[name]}] extra is not installed")
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, report=True, verbose=False)
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} docstring examples in {name} failed (see the output above)"
    )


def test_the_examples_are_found() -> None:
    # A guard against a runner that silently finds nothing (e.g. a module list that came up empty).
    finder = doctest.DocTestFinder()
    importable = [name for name in MODULES if name not in OPTIONAL or importlib.util.find_spec(OPTIONAL[name])]
    examples = sum(len(t.examples) for name in importable for t in finder.find(importlib.import_module(name)))
    assert examples >= 20, f"only {examples} docstring examples found in {len(MODULES)} modules"


# A figure with a unit of time, or a claim of measuring: those belong in README.md and
# benchmarks/README.md, next to the command and the machine, where they are re-measured; in a
# docstring or comment they go stale unseen.
_MEASUREMENT = re.compile(r"\d\s?(?:ns|µs|us|ms)\b|\bmeasured\b|\bmeasurements?\b", re.IGNORECASE)


def test_the_library_source_quotes_no_measurements() -> None:
    found = [
        f"{path.relative_to(LIBRARY.parent)}:{number}: {line.strip()}"
        for path in sorted(LIBRARY.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _MEASUREMENT.search(line)
    ]
    assert not found, "measurements in the library's source (move them to benchmarks/README.md):\n" + "\n".join(found)
