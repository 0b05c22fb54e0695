"""Every ``>>>`` example in the library's docstrings runs and prints what it shows.

Examples that need files, a process group or a model are written as plain ``::`` code blocks
instead, so what remains here is executed documentation, not decoration.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import resumable_data

MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(resumable_data.__path__, prefix="resumable_data.")
    if not name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, report=True, verbose=False)
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} docstring examples in {name} failed (see the output above)"
    )


def test_the_examples_are_found() -> None:
    # A guard against a runner that silently finds nothing (e.g. a module list that came up empty).
    finder = doctest.DocTestFinder()
    examples = sum(len(t.examples) for name in MODULES for t in finder.find(importlib.import_module(name)))
    assert examples >= 20, f"only {examples} docstring examples found in {len(MODULES)} modules"
