"""What checkpointing costs a training loop: step time with none, synchronous and asynchronous saves.

A small GPT (``trainer.model``) trains with AdamW on batches from a ``ResumableDataLoader``; every
K steps the full training state (model, optimizer, data position, step) goes to a
``CheckpointManager``, either written before the step returns (``async_save=False``) or copied to
memory and written by a background thread (``async_save=True``). The cost of a mode is the total
time of the measured steps, plus the wait for the last write at the end, divided by the same total
without checkpoints, taken as the median over rounds that interleave the modes (each run in a fresh
process). After each run the newest checkpoint is loaded back and compared with the state it
should hold.

    python benchmarks/bench_checkpoint.py            # full run, writes benchmarks/results/
    python benchmarks/bench_checkpoint.py --quick    # < 1 minute smoke test, writes to a temp dir
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common  # first: it puts this checkout's resumable_data and trainer on the path
import torch
from _common import format_seconds, markdown_table, run_isolated

from resumable_data import CheckpointManager, ResumableDataLoader
from trainer.model import GPT, ModelConfig

SEED = 1234
NONE, SYNC, ASYNC = "no checkpoints", "synchronous", "asynchronous"


@dataclass(frozen=True)
class Plan:
    model: dict[str, int]  # ModelConfig fields
    batch_size: int
    steps: int
    warmup: int  # first steps left out of the totals (allocator and autograd warm-up)
    intervals: tuple[int, ...]  # K: one checkpoint every K steps
    rounds: int


FULL = Plan(
    model={"block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 256},
    batch_size=8,
    steps=160,
    warmup=10,
    intervals=(50, 10),
    rounds=2,
)
QUICK = Plan(
    model={"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 64},
    batch_size=4,
    steps=24,
    warmup=2,
    intervals=(5,),
    rounds=1,
)


class TokenWindows(torch.utils.data.Dataset):
    """Deterministic token windows computed from the index (the benchmark measures saving, not data)."""

    def __init__(self, length: int, block_size: int, vocab_size: int) -> None:
        self.length = length
        self.block_size = block_size
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = (torch.arange(self.block_size + 1) * (index % 97 + 1) + index) % self.vocab_size
        return tokens[:-1], tokens[1:]


def _tensors_equal(a: Any, b: Any) -> bool:
    """Deep equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_tensors_equal(x, y) for x, y in zip(a, b, strict=False))
        )
    return a == b


def train_cell(
    model_config: dict[str, int], batch_size: int, steps: int, warmup: int, mode: str, interval: int, directory: str
) -> dict[str, Any]:
    """Train ``steps`` steps, checkpointing every ``interval`` in ``mode``; times and a restore check."""
    # One compute thread: on a shared machine a step that wants every core is at the mercy of
    # everything else running, and a spare core for the writer thread is what a GPU job's host
    # CPU offers. The README states this condition next to the numbers.
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    config = ModelConfig(**model_config)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.param_groups(weight_decay=0.1), lr=3e-4)
    loader = ResumableDataLoader(
        TokenWindows(10**6, config.block_size, config.vocab_size), batch_size=batch_size, seed=SEED
    )
    batches = iter(loader)
    manager = CheckpointManager(directory, async_save=(mode == ASYNC)) if mode != NONE else None
    step_times, save_call_times = [], []
    expected: dict[str, Any] | None = None
    for step in range(steps):
        start = time.perf_counter()
        x, y = next(batches)
        _, loss = model(x, targets=y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        saved = manager is not None and step > 0 and step % interval == 0
        if saved:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "dataloader": loader.state_dict(),
                "train_state": {"step": step},
            }
            call = time.perf_counter()
            manager.save(step, state)
            save_call_times.append(time.perf_counter() - call)
        step_times.append(time.perf_counter() - start)
        if saved:  # outside the timed region: what the newest checkpoint must hold
            expected = {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "dataloader": loader.state_dict(),
                "step": step,
            }
    drain = 0.0
    restored = "—"
    if manager is not None:
        start = time.perf_counter()
        manager.close()  # a job is done only once its last checkpoint is on disk
        drain = time.perf_counter() - start
        with CheckpointManager(directory) as reader:
            state = reader.load()
            payload = reader.latest() / "state.pt"
        ok = (
            expected is not None
            and state["train_state"]["step"] == expected["step"]
            and state["dataloader"] == expected["dataloader"]
            and _tensors_equal(state["model"], expected["model"])
        )
        restored = "ok" if ok else "MISMATCH: the newest checkpoint does not hold the state saved at its step"
        size = payload.stat().st_size
    else:
        size = 0
    measured = step_times[warmup:]
    return {
        "total_s": sum(measured) + drain,
        "median_step_s": statistics.median(measured),
        "max_step_s": max(measured),
        "save_call_s": statistics.median(save_call_times) if save_call_times else 0.0,
        "saves": len(save_call_times),
        "drain_s": drain,
        "checkpoint_bytes": size,
        "parameters": model.num_parameters(),
        "restored": restored,
    }


def run(plan: Plan, root: Path) -> dict[tuple[str, int], list[dict[str, Any]]]:
    modes = [(NONE, 0)] + [(mode, k) for k in plan.intervals for mode in (SYNC, ASYNC)]
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for round_ in range(plan.rounds):
        for mode, interval in modes:
            directory = root / f"{mode}-{interval}-{round_}"
            kwargs = {
                "model_config": plan.model,
                "batch_size": plan.batch_size,
                "steps": plan.steps,
                "warmup": plan.warmup,
                "mode": mode,
                "interval": interval,
                "directory": str(directory),
            }
            result = run_isolated(train_cell, kwargs, timeout_s=900)
            shutil.rmtree(directory, ignore_errors=True)
            results.setdefault((mode, interval), []).append(result)
            shown = (
                f"{result['total_s']:.2f} s, restored {result['restored']}" if "total_s" in result else result["error"]
            )
            print(f"round {round_ + 1}: {mode} every {interval or '-'}: {shown}", flush=True)
    return results


def _round_ratios(results: dict[tuple[str, int], list[dict[str, Any]]], key: tuple[str, int]) -> list[float]:
    """Per round: total time / the no-checkpoint total of the same round."""
    pairs = zip(results[key], results[(NONE, 0)], strict=False)
    return [r["total_s"] / base["total_s"] for r, base in pairs if "total_s" in r and "total_s" in base]


def _ratio(results: dict[tuple[str, int], list[dict[str, Any]]], key: tuple[str, int]) -> float | None:
    """Median over rounds of total time / the no-checkpoint total of the same round."""
    ratios = _round_ratios(results, key)
    return statistics.median(ratios) if ratios else None


def report(plan: Plan, results: dict[tuple[str, int], list[dict[str, Any]]]) -> str:
    fmt = format_seconds
    rows = []
    for (mode, interval), runs in results.items():
        ok = [r for r in runs if "total_s" in r]
        if not ok:
            rows.append([mode, interval or "—", runs[0].get("error", "error"), "", "", "", "", "", ""])
            continue
        ratio = _ratio(results, (mode, interval))
        rows.append(
            [
                mode,
                interval or "—",
                f"{ratio:.3f}" if ratio is not None else "",
                fmt(statistics.median(r["median_step_s"] for r in ok)),
                fmt(max(r["max_step_s"] for r in ok)),
                fmt(statistics.median(r["save_call_s"] for r in ok)) if mode != NONE else "—",
                fmt(statistics.median(r["drain_s"] for r in ok)) if mode != NONE else "—",
                f"{ok[0]['checkpoint_bytes'] / 2**20:.1f} MB" if mode != NONE else "—",
                ", ".join(r["restored"] for r in ok),
            ]
        )
    first = next(r for runs in results.values() for r in runs if "parameters" in r)
    targets = []
    if 50 in plan.intervals and (ratio := _ratio(results, (ASYNC, 50))) is not None:
        targets.append(
            f"- asynchronous checkpoints every 50 steps: step time × {ratio:.3f} ({ratio - 1:+.1%}; target ≤ +5 %: "
            f"{'met' if ratio <= 1.05 else 'missed'})"
        )
    if 50 in plan.intervals and (ratio := _ratio(results, (SYNC, 50))) is not None:
        targets.append(
            f"- synchronous checkpoints every 50 steps, for comparison: step time × {ratio:.3f} ({ratio - 1:+.1%})"
        )
    return "\n".join(
        [
            _common.machine_header("Checkpointing cost in a training loop"),
            f"GPT {plan.model} ({first['parameters'] / 1e6:.2f} M parameters), AdamW, batch {plan.batch_size}, "
            f"{plan.steps} steps of which the first {plan.warmup} are not counted, {plan.rounds} round(s), one torch thread. "
            "Ratio: (measured steps + final wait for the last write) / the same without checkpoints, median over rounds. "
            "Max step: the slowest step (a synchronous save stalls one step for the whole write). Save call: time "
            "inside `CheckpointManager.save()`.",
            "",
            "## Targets",
            "",
            *targets,
            "",
            "## Step time",
            "",
            markdown_table(
                [
                    "mode",
                    "every K steps",
                    "time ratio",
                    "median step",
                    "max step",
                    "save call",
                    "final wait",
                    "checkpoint",
                    "restored",
                ],
                rows,
            ),
        ]
    )


def plot(results: dict[tuple[str, int], list[dict[str, Any]]], out: Path) -> None:
    """Each mode's time ratio to no checkpoints (the 1.0 line), written on its bar; error bars: min–max over rounds."""
    groups: dict[str, dict[str, float]] = {}
    spreads: dict[str, dict[str, tuple[float, float]]] = {}
    for (mode, interval), _ in results.items():
        ratios = _round_ratios(results, (mode, interval))
        if mode == NONE or not ratios:
            continue
        group = f"every {interval} steps"
        groups.setdefault(group, {})[mode] = statistics.median(ratios)
        spreads.setdefault(group, {})[mode] = (min(ratios), max(ratios))
    _common.plot_bars(
        out / "checkpoint_step_time.png",
        "Training time with checkpoints / without (lower is better; bars: min–max over rounds)",
        groups,
        ylabel="time ratio",
        reference=1.0,
        spreads=spreads,
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ckpt-dir", type=Path, default=None, help="where the checkpoints are written (default: a temp dir)"
    )


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0], _add_arguments)
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.ckpt_dir))
    try:
        results = run(plan, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = report(plan, results) + f"\n\nTotal run time: {time.perf_counter() - started:.0f} s."
    print(text)
    _common.write_report(args.out, "bench_checkpoint", text)
    plot(results, args.out)


if __name__ == "__main__":
    main()
