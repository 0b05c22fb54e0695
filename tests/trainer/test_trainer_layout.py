"""The trainer reads top to bottom: it holds no test instrumentation (the system checks live in
``tests/system/``) and never imports it, its six core files fit in 1,300 lines, the training function
fits in one sitting, the system checks are cut into functions of at most 50 lines, and nothing is
exempt from the formatter."""

from __future__ import annotations

import ast
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
SYSTEM_CHECKS = Path(__file__).resolve().parents[1] / "system"
# What a reader of the trainer reads first: the loop, parallelism, checkpoints, settings, model, data.
CORE = ["train", "model", "data", "config", "checkpointing", "parallel"]


def functions(path: Path) -> dict[str, int]:
    """Every function (methods and nested ones too) of a module, by name, with its length in lines."""
    tree = ast.parse(path.read_text())
    return {
        node.name: node.end_lineno - node.lineno + 1  # type: ignore[operator]
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def test_the_trainer_holds_no_test_instrumentation_and_never_imports_it() -> None:
    assert sorted(p.name for p in TRAINER.iterdir() if p.is_dir() and p.name != "__pycache__") == []
    for path in sorted(TRAINER.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        tests = [m for m in imported if m.split(".")[0] in ("system", "helpers", "tests") or "harness" in m]
        assert not tests, f"trainer/{path.name} imports {tests}"


def test_the_six_core_files_of_the_reading_path_fit_in_1310_lines() -> None:
    # 1,250 until the refusals of issue 36 (the other checkpoint format, the corpus digest) took 33 more;
    # 1,300 until --skip-batches over token shards (issue 33: TrainingData.skip) took 5 more.
    lines = {name: len((TRAINER / f"{name}.py").read_text().splitlines()) for name in CORE}
    assert sum(lines.values()) <= 1310, lines


def test_the_training_function_fits_in_one_reading_and_the_system_checks_in_short_functions() -> None:
    assert max(functions(TRAINER / "train.py").values()) <= 300
    for path in sorted(SYSTEM_CHECKS.glob("*.py")):
        long = {name: n for name, n in functions(path).items() if n > 50}
        assert not long, f"{path.name}: {long}"


def test_nothing_in_the_trainer_is_exempt_from_the_formatter() -> None:
    exempt = [str(p) for p in TRAINER.rglob("*.py") if "fmt: skip" in p.read_text() or "fmt: off" in p.read_text()]
    assert not exempt
