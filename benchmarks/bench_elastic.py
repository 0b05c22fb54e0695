"""Elastic restore of ``shuffle_window``: loading a state into another number of workers.

Data: 10^5 records in 16 token shards (``TokenShardReader``, two tokens a record: its shard and
its offset, so a record names itself), sizes given, ``shuffle_window(10_000)``, batches of 32. Two
states: one of 2 workers after 100 batches (each worker inside its first window), one of 0 workers
after 1,000 batches (inside its fourth window). "restore" = ``load_state_dict`` into a freshly
built ``StreamLoader`` + the first batch in hand; the same layout is the reference. Loading into
another layout puts the open windows' records not handed out yet back to the sources as pending
records (thousands), which the new slots read first. With workers, warm start (the default) hands
out the first batch from the main process while the workers start; without it, the time includes
the workers' start-up.

The CPU time is the main process's (with workers: what the restore and warm start cost it), a
figure that other jobs on the machine inflate less than the wall time. Timings are medians over
rounds that interleave the cases, with min-max; the garbage collector runs before each restore, so
one that runs during it is due to the restore's own allocations (a layout change hands the new
slots thousands of pending records: built as lists several times, they set off a full collection,
tens of ms; the source keeps them as an array). Each case is also checked
once: the records before the state plus the rest of the epoch after the restore are every record
of the epoch exactly once.

    python benchmarks/bench_elastic.py            # full run, writes benchmarks/results/
    python benchmarks/bench_elastic.py --quick    # a few seconds, writes to a temp dir
"""

from __future__ import annotations

import gc
import itertools
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import format_seconds, machine_header, markdown_table, parse_args, write_report

from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader

SHARDS = 16
BATCH = 32
# (name, workers the state was saved with, batches before it, workers it is loaded into, warm start)
CASES = [
    ("2 workers -> 2 workers (same layout)", 2, 100, 2, True),
    ("0 workers -> 0 workers (same layout)", 0, 1000, 0, True),
    ("2 workers -> 0 workers", 2, 100, 0, True),
    ("0 workers -> 2 workers, warm start", 0, 1000, 2, True),
    ("0 workers -> 2 workers, no warm start", 0, 1000, 2, False),
]


def write_shards(directory: Path, per_shard: int) -> list[str]:
    """Shard ``s``'s record ``j`` is the two tokens ``[s, j]``."""
    paths = []
    for s in range(SHARDS):
        tokens = np.stack([np.full(per_shard, s), np.arange(per_shard)], axis=1).astype(np.uint16)
        path = directory / f"tok_{s:02d}.bin"
        tokens.tofile(path)
        paths.append(str(path))
    return paths


class Setup:
    def __init__(self, paths: list[str], window: int) -> None:
        self.paths = paths
        self.window = window
        self.reader = TokenShardReader(2)
        self.sizes = [self.reader.num_records(p) for p in paths]

    def loader(self, workers: int, warm_start: bool = True) -> StreamLoader:
        source = ShardedIterable(self.paths, read_shard=self.reader, seed=0, sizes=self.sizes)
        return StreamLoader(
            source.shuffle_window(self.window, seed=1), batch_size=BATCH, num_workers=workers, warm_start=warm_start
        )

    def state_after(self, workers: int, batches: int) -> tuple[dict[str, Any], list[tuple[int, int]]]:
        loader = self.loader(workers)
        taken = list(itertools.islice(iter(loader), batches))
        return loader.state_dict(), record_ids(taken)


def record_ids(batches: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(int(s), int(j)) for batch in batches for s, j in batch.tolist()]


def restore_time(setup: Setup, state: dict[str, Any], workers: int, warm_start: bool) -> tuple[float, float]:
    """Wall time and this process's CPU time of ``load_state_dict`` + the first batch."""
    loader = setup.loader(workers, warm_start)
    gc.collect()  # a collection during the restore is then one its own allocations caused
    start, cpu = time.perf_counter(), time.process_time()
    loader.load_state_dict(state)
    batches = iter(loader)
    next(batches)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    del batches  # shuts the workers down before the next case
    return elapsed, cpu


def exact(setup: Setup, state: dict[str, Any], before: list[tuple[int, int]], workers: int, warm: bool) -> str:
    loader = setup.loader(workers, warm)
    loader.load_state_dict(state)
    seen = Counter(before + record_ids(list(loader)))
    expected = Counter((s, j) for s, size in enumerate(setup.sizes) for j in range(size))
    return "ok" if seen == expected else f"WRONG ({sum((seen - expected).values())} extra)"


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rounds = 2 if args.quick else 7
    per_shard = 250 if args.quick else 100_000 // SHARDS
    window = 1000 if args.quick else 10_000
    batches = {100: 5 if args.quick else 100, 1000: 50 if args.quick else 1000}
    with tempfile.TemporaryDirectory() as directory:
        setup = Setup(write_shards(Path(directory), per_shard), window)
        states = {(w, n): setup.state_after(w, batches[n]) for w, n in {(c[1], c[2]) for c in CASES}}
        times: dict[str, list[tuple[float, float]]] = {c[0]: [] for c in CASES}
        for _ in range(rounds):
            for name, saved_workers, n, workers, warm in CASES:
                times[name].append(restore_time(setup, states[saved_workers, n][0], workers, warm))
        checks = {c[0]: exact(setup, *states[c[1], c[2]], c[3], c[4]) for c in CASES}
    rows = []
    for name, saved_workers, n, workers, _ in CASES:
        changed = "" if saved_workers == workers else "yes"
        walls, cpus = [t[0] for t in times[name]], [t[1] for t in times[name]]
        spread = f"{format_seconds(min(walls))} - {format_seconds(max(walls))}"
        cpu = format_seconds(statistics.median(cpus))
        rows.append([name, batches[n], changed, format_seconds(statistics.median(walls)), spread, cpu, checks[name]])
    title = (
        f"Elastic `shuffle_window({window:,})` restore: {SHARDS * per_shard:,} records in {SHARDS} token shards, "
        f"batch {BATCH}, {rounds} rounds"
    )
    text = "\n".join(
        [
            machine_header(title),
            markdown_table(
                [
                    "case",
                    "batches before the state",
                    "layout change",
                    "restore (median)",
                    "min - max",
                    "CPU of this process (median)",
                    "exact",
                ],
                rows,
            ),
        ]
    )
    write_report(args.out, "bench_elastic", text)
    print(text)


if __name__ == "__main__":
    main()
