"""The public API: a top level that holds what the quickstart needs, a namespace for the rest, and
every name that moved still working from the top level for one release, with a DeprecationWarning
that names its new import path.

``MOVED`` below is the single source of truth for the moves: the library's table must equal it, and
every check here is driven by it.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import resumable_data

ROOT = Path(__file__).resolve().parent.parent

# Every name that left the top level, by the namespace that holds it now.
MOVED = {
    name: home
    for home, names in {
        "resumable_data.streams": "IterableSource ParquetReader ReplayWarning TextLineReader TokenShardReader",
        "resumable_data.rng": "RandomMap SampleKey rank_seed restore_rank_rng_state sample_generator "
        "sample_numpy_rng sample_seed",
        "resumable_data.checkpoint": "CheckpointLockedError DcpStore choose_checkpoint GracefulStop",
        "resumable_data.distributed": "DataLoaderState check_world_size dcp_errors decide_on_rank_zero "
        "fail_together global_state require_agreement",
        "resumable_data.core": "Permutation",
    }.items()
    for name in names.split()
}

# The top level: what the quickstart needs.
KEPT = {
    "wrap", "ResumableDataLoader", "ResumableSampler",  # map-style loading
    "ShardedIterable", "Stream", "StreamLoader", "mix",  # streams
    "ResumeError", "ResumeWarning", "Stateful",  # errors, and what a state holder follows
    "capture_rng_state", "restore_rng_state", "seed_everything",  # the global RNGs
    "CheckpointManager", "__version__",
}  # fmt: skip

# Kept names that their namespace offers too, so one import line serves a namespace's users.
ALSO_IN_NAMESPACE = {
    "resumable_data.checkpoint": {"CheckpointManager"},
    "resumable_data.rng": {"capture_rng_state", "restore_rng_state", "seed_everything"},
    "resumable_data.streams": {"ShardedIterable", "Stream", "StreamLoader", "mix"},
}

# Our own code, which must not use a moved name by its old path.
SCANNED = ("resumable_data", "examples", "benchmarks", "tests", "trainer")


def _packages() -> list[str]:
    """The library and each of its subpackages (packages only: importing them imports no framework)."""
    names = ["resumable_data"]
    for name in names:
        module = importlib.import_module(name)
        names += [f"{name}.{info.name}" for info in pkgutil.iter_modules(module.__path__) if info.ispkg]
    return names


NAMESPACES = sorted({*_packages(), *MOVED.values()})


def _isort_key(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 keeps ``__all__`` in: CONSTANTS, then Classes, then the rest."""
    if name.isupper() and len(name) > 1:
        return 0, name
    return (1, name) if name[:1].isupper() else (2, name)


@pytest.mark.parametrize("name", NAMESPACES)
def test_each_all_is_sorted_and_every_name_in_it_resolves(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", [])
    assert exported == sorted(exported, key=_isort_key), (
        f"{name}.__all__ is not sorted (constants, classes, then the rest)"
    )
    missing = [export for export in exported if export not in vars(module)]
    assert not missing, f"{name}.__all__ names what {name} does not hold: {missing}"


def test_the_top_level_is_exactly_the_quickstart_set() -> None:
    assert set(resumable_data.__all__) == KEPT
    assert not KEPT & set(MOVED)
    # A moved name is no longer an attribute of the package: it is found only through the
    # deprecation path, so nothing reaches it there without a warning.
    assert not set(MOVED) & set(vars(resumable_data))


def test_the_library_moves_exactly_the_names_in_this_table() -> None:
    assert resumable_data._MOVED == MOVED


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_still_works_with_a_warning_naming_its_new_path(name: str) -> None:
    home = importlib.import_module(MOVED[name])
    with pytest.warns(DeprecationWarning, match=re.escape(f"from {MOVED[name]} import {name}")):
        old = getattr(resumable_data, name)
    assert old is getattr(home, name)
    assert name in home.__all__


def test_the_old_import_statement_warns_too() -> None:
    namespace: dict[str, object] = {}
    with pytest.warns(DeprecationWarning, match=re.escape("from resumable_data.checkpoint import DcpStore")):
        exec("from resumable_data import DcpStore", namespace)
    assert namespace["DcpStore"] is importlib.import_module("resumable_data.checkpoint").DcpStore


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        _ = resumable_data.NoSuchName  # type: ignore[attr-defined]


@pytest.mark.parametrize("home", sorted(ALSO_IN_NAMESPACE))
def test_a_namespace_offers_the_kept_names_of_its_part_as_the_same_objects(home: str) -> None:
    module = importlib.import_module(home)
    for name in ALSO_IN_NAMESPACE[home]:
        assert name in module.__all__
        assert getattr(module, name) is getattr(resumable_data, name)


def test_the_old_signals_module_imports_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "resumable_data.signals", raising=False)
    with pytest.warns(DeprecationWarning, match=re.escape("from resumable_data.checkpoint import GracefulStop")):
        old: ModuleType = importlib.import_module("resumable_data.signals")
    assert old.GracefulStop is importlib.import_module("resumable_data.checkpoint").GracefulStop


def test_after_import_resumable_data_its_namespaces_and_the_old_signals_module_are_attributes() -> None:
    # A fresh interpreter: `import resumable_data` alone, as a user's script starts.
    probe = (
        "import warnings, resumable_data\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    print(resumable_data.distributed.global_state.__name__, resumable_data.streams.mix.__name__)\n"
        "    assert not caught, caught\n"
        "    print(resumable_data.signals.GracefulStop.__name__)\n"
        "print(*{w.category.__name__ for w in caught})\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["global_state", "mix", "GracefulStop", "DeprecationWarning"]


def _old_paths(path: Path) -> list[str]:
    """Each use in ``path`` of a moved name by its old path (``from resumable_data import NAME``,
    ``resumable_data.NAME``) or of the moved module ``resumable_data.signals``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            if node.module == "resumable_data":
                found += [
                    f"{path}:{node.lineno}: {a.name}" for a in node.names if a.name in MOVED or a.name == "signals"
                ]
            elif node.module == "resumable_data.signals":
                found.append(f"{path}:{node.lineno}: resumable_data.signals")
        elif isinstance(node, ast.Import):
            found += [f"{path}:{node.lineno}: {a.name}" for a in node.names if a.name == "resumable_data.signals"]
        elif isinstance(node, ast.Attribute) and node.attr in MOVED and ast.unparse(node.value) == "resumable_data":
            found.append(f"{path}:{node.lineno}: resumable_data.{node.attr}")
    return found


def test_our_own_code_uses_no_moved_name_by_its_old_path() -> None:
    files = [path for folder in SCANNED for path in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 100
    found = [use for path in files for use in _old_paths(path)]
    assert not found, "moved names used by their old path:\n" + "\n".join(found)


def test_an_example_runs_with_our_deprecation_warnings_as_errors() -> None:
    # The filter matches the library's own deprecation messages, not those of torch or numpy.
    command = [sys.executable, "-W", "error:resumable_data.:DeprecationWarning", "examples/token_streaming.py"]
    result = subprocess.run([*command, "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "identical: True"
