"""The trainer reads top to bottom: its reading path never imports the test instrumentation in
``trainer/harness/``, its six core files fit in 1,300 lines, the training function fits in one
sitting, the harness is cut into functions of at most 50 lines, and nothing is exempt from the formatter."""

from __future__ import annotations

import ast
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
READING_PATH = ["train", "parallel", "checkpointing", "config", "train_state", "model", "data", "documents", "metrics"]
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


def test_the_reading_path_never_imports_the_harness() -> None:
    for name in READING_PATH:
        tree = ast.parse((TRAINER / f"{name}.py").read_text())
        imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if "harness" in m], f"trainer/{name}.py imports the harness"


def test_the_six_core_files_of_the_reading_path_fit_in_1300_lines() -> None:
    # 1,250 until the refusals of issue 36 (the other checkpoint format, the corpus digest) took 33 more.
    lines = {name: len((TRAINER / f"{name}.py").read_text().splitlines()) for name in CORE}
    assert sum(lines.values()) <= 1300, lines


def test_the_training_function_fits_in_one_reading_and_the_harness_in_short_functions() -> None:
    assert max(functions(TRAINER / "train.py").values()) <= 300
    for path in sorted((TRAINER / "harness").glob("*.py")):
        long = {name: n for name, n in functions(path).items() if n > 50}
        assert not long, f"{path.name}: {long}"


def test_nothing_in_the_trainer_is_exempt_from_the_formatter() -> None:
    exempt = [str(p) for p in TRAINER.rglob("*.py") if "fmt: skip" in p.read_text() or "fmt: off" in p.read_text()]
    assert not exempt
