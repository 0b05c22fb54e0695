"""Hugging Face Trainer: time from ``train()`` to the first training step, fresh and resumed.

``transformers.Trainer`` resumes an epoch by accelerate's ``skip_first_batches`` over its plain
DataLoader: the skipped batches' indices are drawn and thrown away, so the wait grows with the
position. ``ResumableTrainer`` loads the loader's position from ``resumable_data.json`` and hands
the skip stand-ins. Each cell builds a Trainer in a fresh process and times ``trainer.train()`` up
to the first ``training_step``, for a fresh start and for checkpoints at 50 % and 90 % of one epoch;
rounds interleave the methods. The checkpoints are written once by a one-step run and then moved
to the position (``trainer_state.json``'s ``global_step``, and the loader's position), which is
what a run that trained that far would leave. After each resume the first batch's samples are
compared with the samples at that position of the uninterrupted order where that order is known
(``ResumableTrainer``'s: the loader's keyed permutation).

    python benchmarks/bench_hf_trainer.py            # full run (10^6 samples), writes benchmarks/results/
    python benchmarks/bench_hf_trainer.py --quick    # smoke test (10^4 samples), writes to a temp dir
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import _common  # first: it puts this checkout's resumable_data on the path
import torch
from _common import REPO_ROOT, format_count, format_seconds, markdown_table, run_isolated

SEED = 0
BATCH = 32
TRAINER, RESUMABLE = "Trainer (skip_first_batches)", "ResumableTrainer"
METHODS = (TRAINER, RESUMABLE)


@dataclass(frozen=True)
class Plan:
    samples: int
    fractions: tuple[float, ...]  # checkpoint positions as fractions of the epoch (0: fresh start)
    rounds: int


FULL = Plan(samples=10**6, fractions=(0.0, 0.5, 0.9), rounds=5)
QUICK = Plan(samples=10**4, fractions=(0.0, 0.9), rounds=1)


def _transformers() -> Any:
    """transformers, after the tests' torchvision workaround (transformers imports torchvision)."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from torchvision_compat import load_torchvision

    load_torchvision()
    import transformers

    return transformers


class IndexData(torch.utils.data.Dataset):
    """``length`` samples whose first feature is the sample's index (how the checks identify it)."""

    def __init__(self, length: int) -> None:
        self.x = torch.zeros(length, 4)
        self.x[:, 0] = torch.arange(length, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.x[index, :1]}


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}


class _Reached(Exception):
    """Raised by the first training step: the time is taken, the rest of the run is not needed."""


def _trainer(method: str, out: Path, samples: int, max_steps: int = -1) -> Any:
    transformers = _transformers()
    from resumable_data.integrations.transformers import ResumableTrainer

    base = ResumableTrainer if method == RESUMABLE else transformers.Trainer

    class FirstStep(base):  # type: ignore[misc, valid-type]
        reached: ClassVar[float | None] = None
        first_batch: ClassVar[list[int]] = []

        def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if FirstStep.reached is None and max_steps < 0:
                FirstStep.reached = time.perf_counter()
                FirstStep.first_batch = inputs["x"][:, 0].long().tolist()
                raise _Reached
            return super().training_step(model, inputs, *args, **kwargs)

    args = transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        num_train_epochs=1,
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=1,
        report_to=[],
        use_cpu=True,
        seed=SEED,
        disable_tqdm=True,
        logging_steps=10**9,
    )
    torch.manual_seed(SEED)
    return FirstStep(model=Regressor(), args=args, train_dataset=IndexData(samples))


def write_checkpoint(method: str, root: str, samples: int, steps: int) -> dict[str, Any]:
    """A one-step run's checkpoint, moved to ``steps`` optimizer steps into the epoch."""
    out = Path(root) / method.split()[0]
    _trainer(method, out, samples, max_steps=1).train()
    checkpoint = out / "checkpoint-1"
    state_path = checkpoint / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state["global_step"] = steps
    state_path.write_text(json.dumps(state))
    loader_path = checkpoint / "resumable_data.json"
    if loader_path.exists():
        saved = json.loads(loader_path.read_text())
        saved["batches_per_process"] = steps
        saved["loader"]["position"] = steps * BATCH
        loader_path.write_text(json.dumps(saved))
    return {"checkpoint": str(checkpoint)}


def first_step(method: str, root: str, samples: int, checkpoint: str | None) -> dict[str, Any]:
    """Seconds from ``trainer.train()`` to the first training step, and that step's sample indices."""
    trainer = _trainer(method, Path(root) / f"run-{method.split()[0]}", samples)
    started = time.perf_counter()
    with contextlib.suppress(_Reached):
        trainer.train(resume_from_checkpoint=checkpoint)
    reached = type(trainer).reached
    if reached is None:
        return {"error": "the run ended without a training step"}
    return {"seconds": reached - started, "first_batch": type(trainer).first_batch}


def expected_batch(samples: int, steps: int) -> list[int]:
    """The samples at ``steps`` batches into ResumableTrainer's uninterrupted epoch 0."""
    from resumable_data import ResumableDataLoader

    loader = ResumableDataLoader(range(samples), batch_size=BATCH, seed=SEED)
    state = loader.state_dict()
    loader.load_state_dict({**state, "position": steps * BATCH})
    return next(iter(loader)).tolist()


def run(plan: Plan, root: Path) -> dict[tuple[str, float], list[dict[str, Any]]]:
    steps_per_epoch = plan.samples // BATCH + (plan.samples % BATCH > 0)
    checkpoints: dict[tuple[str, float], str | None] = {}
    for method in METHODS:
        for fraction in plan.fractions:
            if fraction == 0:
                checkpoints[method, fraction] = None
                continue
            made = run_isolated(
                write_checkpoint,
                {
                    "method": method,
                    "root": str(root / f"{fraction}"),
                    "samples": plan.samples,
                    "steps": round(fraction * steps_per_epoch),
                },
                timeout_s=600,
            )
            if "error" in made:
                raise RuntimeError(f"writing the {method} checkpoint at {fraction:.0%}: {made['error']}")
            checkpoints[method, fraction] = made["checkpoint"]
    results: dict[tuple[str, float], list[dict[str, Any]]] = {key: [] for key in checkpoints}
    for round_ in range(plan.rounds):
        for fraction in plan.fractions:
            for method in METHODS if round_ % 2 == 0 else METHODS[::-1]:
                cell = run_isolated(
                    first_step,
                    {
                        "method": method,
                        "root": str(root / f"cells-{round_}"),
                        "samples": plan.samples,
                        "checkpoint": checkpoints[method, fraction],
                    },
                    timeout_s=900,
                )
                if method == RESUMABLE and "first_batch" in cell:
                    want = expected_batch(plan.samples, round(fraction * steps_per_epoch))
                    cell["exact"] = cell["first_batch"] == want
                results[method, fraction].append(cell)
                print(f"round {round_ + 1}/{plan.rounds} {method} at {fraction:.0%}: {_summary(cell)}", flush=True)
    return results


def _summary(cell: dict[str, Any]) -> str:
    return cell["error"] if "error" in cell else format_seconds(cell["seconds"])


def _median(cells: list[dict[str, Any]]) -> float | None:
    times = [c["seconds"] for c in cells if "seconds" in c]
    return statistics.median(times) if times else None


def report(plan: Plan, results: dict[tuple[str, float], list[dict[str, Any]]]) -> str:
    rows, targets = [], []
    for (method, fraction), cells in results.items():
        times = [c["seconds"] for c in cells if "seconds" in c]
        errors = [c["error"] for c in cells if "error" in c]
        fresh = _median(results[method, 0.0])
        median = statistics.median(times) if times else None
        ratio = f"{median / fresh:.2f}" if median is not None and fresh else "—"
        checks = [c["exact"] for c in cells if "exact" in c]
        exact = "—" if not checks else ("yes" if all(checks) else "NO")
        spread = f"{format_seconds(min(times))} – {format_seconds(max(times))}" if times else "—"
        rows.append(
            [
                method,
                "fresh start" if fraction == 0 else f"{fraction:.0%}",
                format_seconds(median) if median is not None else f"error: {errors[0]}",
                spread,
                ratio,
                exact,
            ]
        )
        if fraction == 0.9 and median is not None and fresh:
            verdict = "met" if median <= 2 * fresh else "missed"
            goal = f"; target ≤ 2× a fresh start: {verdict}" if method == RESUMABLE else ""
            targets.append(f"- {method}, resume at 90 %: {median / fresh:.2f}× its fresh start{goal}")
    return "\n".join(
        [
            _common.machine_header("Hugging Face Trainer: time to the first training step, fresh and resumed"),
            f"{format_count(plan.samples)} samples, batch {BATCH}, one epoch, 0 workers, {plan.rounds} round(s) "
            "interleaving the methods, each cell a fresh process. Time: `trainer.train()` called → first "
            "`training_step` entered (checkpoint loading, the loader and any skip included; importing excluded). "
            "Ratio: to the same trainer's fresh start. Exact: the first resumed batch holds the samples at "
            "that position of the uninterrupted order (checked where that order is known).",
            "",
            "## Targets",
            "",
            *targets,
            "",
            "## Time to the first training step",
            "",
            markdown_table(["method", "checkpoint", "median", "min – max", "÷ fresh", "exact"], rows),
        ]
    )


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    plan = QUICK if args.quick else FULL
    if args.quick:  # its cells fork from this process (see _common.parse_args): import once, here
        _transformers()
        import resumable_data.integrations.transformers  # noqa: F401
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="bench-hf-"))
    try:
        results = run(plan, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = report(plan, results) + f"\n\nTotal run time: {time.perf_counter() - started:.0f} s."
    print(text)
    _common.write_report(args.out, "bench_hf_trainer", text)


if __name__ == "__main__":
    main()
