"""Steady-state cost of being resumable: epoch throughput, and ``state_dict()`` latency and size.

Throughput: one full shuffled epoch per cell, timed from the first batch in hand to the end (so
worker start-up is left out), for a plain ``DataLoader``, torchdata's ``StatefulDataLoader`` and
``ResumableDataLoader``, with 0 and 2 workers. Each cell runs in a fresh process; the methods take
turns within each round, and the overhead is the median over rounds of the time ratio to the plain
``DataLoader`` of the same round, which cancels most of the drift of a shared machine. Every
epoch is also checked to hand out each sample exactly once.

``state_dict()``: called mid-epoch, timed call by call; size is the pickled size.

    python benchmarks/bench_overhead.py            # full run, writes benchmarks/results/
    python benchmarks/bench_overhead.py --quick    # < 1 minute smoke test, writes to a temp dir
"""

from __future__ import annotations

import json
import pickle
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import _common  # first: it puts this checkout's resumable_data on the path
from _common import SyntheticDataset, format_count, format_seconds, markdown_table, run_isolated

# torchdata 0.11 calls a deprecated torch API on every StatefulDataLoader; the warning is noise here.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

PLAIN = "DataLoader"
STATEFUL = "StatefulDataLoader"
OURS = "resumable_data"
METHODS = (PLAIN, STATEFUL, OURS)
STATEFUL_METHODS = (STATEFUL, OURS)  # a plain DataLoader has no state_dict()
BUILDERS: dict[str, Callable[..., Any]] = {
    PLAIN: _common.plain_loader,
    STATEFUL: _common.stateful_loader,
    OURS: _common.resumable_loader,
}
BATCH_SIZE = 32
SEED = 1234
STATE_DICT_CALLS = 2000


@dataclass(frozen=True)
class Plan:
    sizes: dict[float, int]  # per-sample work (µs) -> epoch size, so every epoch takes seconds
    workers: tuple[int, ...]
    rounds: int
    state_size: int  # dataset size for the state_dict() cells


FULL = Plan(sizes={0.0: 250_000, 50.0: 40_000}, workers=(0, 2), rounds=4, state_size=10**6)
QUICK = Plan(sizes={0.0: 2_000, 50.0: 1_000}, workers=(0, 2), rounds=1, state_size=10**3)


def epoch_cell(method: str, n: int, work_iterations: int, workers: int) -> dict[str, Any]:
    """One full epoch; steady-state seconds (first batch → end) and whether it covered N once."""
    torch.set_num_threads(1)
    loader = BUILDERS[method](SyntheticDataset(n, work_iterations), batch_size=BATCH_SIZE, seed=SEED, workers=workers)
    iterator = iter(loader)
    seen = [next(iterator)[:, 0]]
    start = time.perf_counter()
    seen += [batch[:, 0] for batch in iterator]
    seconds = time.perf_counter() - start
    indices = torch.cat(seen)
    covered = len(indices) == n and torch.equal(torch.sort(indices).values, torch.arange(n))
    coverage = "ok" if covered else f"MISMATCH: {len(indices)} samples, {len(torch.unique(indices))} distinct, of {n}"
    return {"seconds": seconds, "samples": n - len(seen[0]), "coverage": coverage}


def state_dict_cell(method: str, n: int, workers: int) -> dict[str, Any]:
    """Median and 99th percentile of ``state_dict()`` mid-epoch, and the state's size."""
    torch.set_num_threads(1)
    loader = BUILDERS[method](SyntheticDataset(n), batch_size=BATCH_SIZE, seed=SEED, workers=workers)
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    times = []
    for _ in range(STATE_DICT_CALLS):
        start = time.perf_counter_ns()
        state = loader.state_dict()
        times.append(time.perf_counter_ns() - start)
    times.sort()
    try:
        json.dumps(state)
        plain = "yes"
    except TypeError as e:  # e.g. a torch.Generator state tensor
        plain = f"no ({e})"
    return {
        "median_s": times[len(times) // 2] * 1e-9,
        "p99_s": times[int(len(times) * 0.99)] * 1e-9,
        "bytes": len(pickle.dumps(state)),
        "json": plain,
    }


def run(plan: Plan, work_iterations: dict[float, int]) -> tuple[dict[tuple[str, float, int], list[dict[str, Any]]], dict[tuple[str, int], dict[str, Any]]]:
    epochs: dict[tuple[str, float, int], list[dict[str, Any]]] = {}
    for round_ in range(plan.rounds):
        for cost, n in plan.sizes.items():
            for workers in plan.workers:
                for method in METHODS:
                    kwargs = {"method": method, "n": n, "work_iterations": work_iterations[cost], "workers": workers}
                    result = run_isolated(epoch_cell, kwargs, timeout_s=600)
                    epochs.setdefault((method, cost, workers), []).append(result)
                    shown = format_seconds(result["seconds"]) if "seconds" in result else result["error"]
                    print(f"round {round_ + 1}: {method} {cost:.0f}µs w{workers}: {shown} {result.get('coverage', '')}", flush=True)
    states = {}
    for workers in plan.workers:
        for method in STATEFUL_METHODS:
            states[(method, workers)] = run_isolated(state_dict_cell, {"method": method, "n": plan.state_size, "workers": workers}, timeout_s=600)
    return epochs, states


def _overhead(epochs: dict[tuple[str, float, int], list[dict[str, Any]]], method: str, cost: float, workers: int) -> float | None:
    """Median over rounds of (this method's epoch time / the plain DataLoader's in the same round) - 1."""
    pairs = zip(epochs[(method, cost, workers)], epochs[(PLAIN, cost, workers)])
    ratios = [mine["seconds"] / plain["seconds"] for mine, plain in pairs if "seconds" in mine and "seconds" in plain]
    return statistics.median(ratios) - 1 if ratios else None


def report(plan: Plan, epochs: dict[tuple[str, float, int], list[dict[str, Any]]], states: dict[tuple[str, int], dict[str, Any]], work_iterations: dict[float, int]) -> str:
    configs = [(cost, workers) for cost in plan.sizes for workers in plan.workers]
    headers = ["method", *(f"{cost:.0f} µs/sample, N = {format_count(plan.sizes[cost])}, {workers} workers" for cost, workers in configs)]
    rows = []
    for method in METHODS:
        row: list[str] = [method]
        for cost, workers in configs:
            runs = [r for r in epochs[(method, cost, workers)] if "seconds" in r]
            if not runs:
                row.append(epochs[(method, cost, workers)][0].get("error", "error"))
                continue
            rate = statistics.median(r["samples"] / r["seconds"] for r in runs)
            overhead = _overhead(epochs, method, cost, workers)
            row.append(f"{rate:,.0f} samples/s" + ("" if method == PLAIN or overhead is None else f" ({overhead:+.1%})"))
        rows.append(row)
    state_rows = []
    for method in STATEFUL_METHODS:
        for workers in plan.workers:
            r = states[(method, workers)]
            if "error" in r:
                state_rows.append([method, workers, r["error"], "", "", ""])
                continue
            state_rows.append([method, workers, format_seconds(r["median_s"]), format_seconds(r["p99_s"]), f"{r['bytes']:,} B", r["json"]])
    every = []
    for (method, cost, workers), runs in epochs.items():
        for i, r in enumerate(runs):
            timing = format_seconds(r["seconds"]) if "seconds" in r else r.get("error", "")
            every.append([method, f"{cost:.0f} µs", workers, i + 1, format_count(plan.sizes[cost]), timing, r.get("coverage", "error")])
    ours_worst = max((o for cost, workers in configs if (o := _overhead(epochs, OURS, cost, workers)) is not None), default=None)
    ours_state = max((states[(OURS, w)].get("median_s", float("inf")) for w in plan.workers), default=None)
    targets = []
    if ours_worst is not None:
        targets.append(f"- steady-state overhead of resumable_data vs DataLoader, worst configuration: {ours_worst:+.1%} "
                       f"(target ≤ 2 %: {'met' if ours_worst <= 0.02 else 'missed'})")
    if ours_state is not None:
        targets.append(f"- resumable_data `state_dict()` median, worst configuration: {format_seconds(ours_state)} "
                       f"(target ≤ 50 µs: {'met' if ours_state <= 50e-6 else 'missed'})")
    return "\n".join([
        _common.machine_header("Steady-state overhead and state_dict() cost"),
        f"Batch size {BATCH_SIZE}, shuffled, seed {SEED}; {plan.rounds} round(s), methods interleaved in each. Per-sample work: "
        + ", ".join(f"{us:.0f} µs ≈ {it} LCG iterations" for us, it in work_iterations.items())
        + ". Throughput is the median over rounds; the percentage is the median over rounds of the epoch-time ratio "
        "to the plain DataLoader in the same round (positive = slower).",
        "", "## Targets", "", *targets, "",
        "## Epoch throughput (first batch → end of epoch)", "", markdown_table(headers, rows), "",
        f"## `state_dict()` mid-epoch, N = {format_count(plan.state_size)} ({STATE_DICT_CALLS} calls)", "",
        markdown_table(["method", "workers", "median", "p99", "pickled size", "JSON-serializable"], state_rows), "",
        "## Every epoch", "",
        markdown_table(["method", "work", "workers", "round", "N", "first batch → end", "coverage"], every),
    ])


def plot(plan: Plan, epochs: dict[tuple[str, float, int], list[dict[str, Any]]], out: Any) -> None:
    groups: dict[str, dict[str, float]] = {}
    for cost in plan.sizes:
        for workers in plan.workers:
            group = groups.setdefault(f"{cost:.0f} µs/sample\n{workers} workers", {})
            for method in METHODS:
                overhead = _overhead(epochs, method, cost, workers)
                if overhead is not None:
                    group[method] = 1 / (1 + overhead)
    _common.plot_bars(out / "overhead_throughput.png", "Epoch throughput relative to a plain DataLoader (higher is better)",
                      groups, ylabel="throughput / DataLoader's", reference=1.0)


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    plan = QUICK if args.quick else FULL
    work_iterations = {cost: _common.calibrate_work(cost) for cost in plan.sizes}
    started = time.perf_counter()
    epochs, states = run(plan, work_iterations)
    text = report(plan, epochs, states, work_iterations) + f"\n\nTotal run time: {time.perf_counter() - started:.0f} s."
    print(text)
    _common.write_report(args.out, "bench_overhead", text)
    plot(plan, epochs, args.out)


if __name__ == "__main__":
    main()
