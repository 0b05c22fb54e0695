"""Every public name has an entry in the documentation site's API reference, as what it is.

The site (``mkdocs.yml``) is built here with warnings as errors, and the reference's headings are
read back from the HTML: each heading's anchor is the documented path, and its CSS class says what
mkdocstrings rendered there (class, function, module, attribute). A public name, one in a
namespace's ``__all__``, counts as documented when some heading's path resolves to that very
object and was rendered as the same kind of thing (``resumable_data.mix`` would render the
``streams.mix`` module, not the function). So a new public name without a reference entry, or an
entry that renders something else, fails here.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from torchvision_compat import load_torchvision

ROOT = Path(__file__).resolve().parent.parent

# The Lightning and transformers adapters import torchvision through their frameworks (see
# tests/test_docstrings.py).
with contextlib.suppress(ImportError):
    load_torchvision()

NAMESPACES = [
    "resumable_data",
    "resumable_data.streams",
    "resumable_data.streams.formats",
    "resumable_data.storage",
    "resumable_data.rng",
    "resumable_data.checkpoint",
    "resumable_data.accumulation",
    "resumable_data.position",
    "resumable_data.distributed",
    "resumable_data.testing",
    "resumable_data.audit",
    "resumable_data.torchrun",
    "resumable_data.integrations.accelerate",
    "resumable_data.integrations.lightning",
    "resumable_data.integrations.transformers",
    "resumable_data.integrations.deepspeed",
    "resumable_data.integrations.torchtitan",
]
# Public names that no __all__ lists (the core package re-exports nothing).
EXTRA = {"resumable_data.core.permutation": ["Permutation"]}
OPTIONAL = {
    "resumable_data.integrations.lightning": "lightning",
    "resumable_data.integrations.transformers": "transformers",
    "resumable_data.integrations.accelerate": "accelerate",
}
_HEADING = re.compile(
    r'<h\d id="([^"]+)" class="doc doc-heading">\s*(?:<code>)?\s*<span class="doc doc-object-name doc-(\w+)-name"'
)


def _resolve(path: str) -> Any:
    """The object a dotted path names at run time: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def _kind(obj: Any) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "class"
    if inspect.isroutine(obj):
        return "function"
    return "attribute"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str]]:
    """(documented path, rendered kind) of every heading of the built API reference."""
    pytest.importorskip("mkdocstrings", reason="the [docs] extra is not installed")
    site = tmp_path_factory.mktemp("site")
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)]
    done = subprocess.run(
        build, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    pages = sorted((site / "reference").rglob("*.html"))
    return [m.groups() for page in pages for m in _HEADING.finditer(page.read_text(encoding="utf-8"))]


def _public(namespace: str) -> list[str]:
    if namespace in OPTIONAL:
        pytest.importorskip(OPTIONAL[namespace], reason=f"the [{OPTIONAL[namespace]}] extra is not installed")
    if namespace in EXTRA:
        return EXTRA[namespace]
    return [name for name in importlib.import_module(namespace).__all__ if name != "__version__"]


@pytest.mark.parametrize("namespace", NAMESPACES + sorted(EXTRA))
def test_every_public_name_has_a_reference_entry(namespace: str, reference: list[tuple[str, str]]) -> None:
    rendered: dict[int, set[str]] = {}
    for path, kind in reference:
        with contextlib.suppress(ImportError, AttributeError):
            rendered.setdefault(id(_resolve(path)), set()).add(kind)
    module = importlib.import_module(namespace)
    names = _public(namespace)
    assert names, f"{namespace} lists no public names"
    missing = [
        f"{namespace}.{name} ({_kind(getattr(module, name))})"
        for name in names
        if _kind(getattr(module, name)) not in rendered.get(id(getattr(module, name)), set())
    ]
    assert not missing, "public names without an entry in docs/reference/ (add a `::: path` line):\n" + "\n".join(
        missing
    )


def test_the_reference_is_read(reference: list[tuple[str, str]]) -> None:
    # A guard against a heading pattern that silently matches nothing (a new mkdocstrings layout).
    kinds = {kind for _, kind in reference}
    assert len(reference) >= 50 and {"class", "function", "module"} <= kinds, reference[:5]
