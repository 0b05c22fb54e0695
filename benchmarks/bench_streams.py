"""Stream pipelines: restore time at 90% of a 10^8-token shard set, versus replaying to that point.

Data: 100 shards x 10^6 uint16 tokens (10^8 tokens, 200 MB) in a temp dir, read as windows of
1024 + 1 tokens by ``TokenShardReader``; batches of 32 windows through ``StreamLoader``.

Pipelines:

- source: ``ShardedIterable`` alone (shard order shuffled per epoch).
- realistic: source -> ``shuffle_buffer(1000)`` -> ``map`` with random token dropout -> batch.
- realistic, 2 workers: the same with ``num_workers=2``.
- parquet source, and parquet through a shuffle buffer (``bench_parquet.py``'s pipelines): 20
  Parquet shards x 10,000 rows of 256 int32 token ids, row groups of 1,000 rows (the layout of a
  tokenized Hugging Face dataset saved with ``Dataset.to_parquet``), read by ``ParquetReader``;
  at 90 % of its own epoch. Needs pyarrow (the ``[parquet]`` extra); without it these rows say so.

For each, a fresh loader iterates to 90% of the epoch: the time to the next batch from there is
what "replay" (consume and discard, the usual fallback) costs. Its state is then loaded into a
freshly built loader and timed from ``load_state_dict`` to the first batch in hand ("restore"),
and that batch is checked to equal the uninterrupted run's. "Fresh start" is a new loader's first
batch without a state: what any start costs (a buffered pipeline first fills its buffer). Restores
and fresh starts of all pipelines are interleaved over several rounds; the table gives the median
and the range.

A shuffle buffer re-reads its records ahead of its draws, not all before the first batch (see
``resumable_data/streams/shuffle.py``), so part of the re-reading happens after the restore's first
batch. For the 0-worker buffered pipeline each round therefore also times (CPU) a restore through
the 40 batches after its first (1,280 draws: every buffered record is re-read by then), and the
same 41 batches from a loader restored 80 batches earlier (its re-reads long done, so it runs as
an uninterrupted one would); the difference is what a restore costs in all, re-reads left for
later included. The two runs' batches are checked equal.

Run: ``python benchmarks/bench_streams.py`` (``--quick``: 4 token shards, 4 Parquet shards of 2,000
rows, one restore per pipeline: a smoke test of every pipeline and the exactness check, not a
measurement).
"""

from __future__ import annotations

import gc
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import format_seconds, machine_header, markdown_table, parse_args, write_report

from resumable_data.streams import ShardedIterable, Stream, StreamLoader, TokenShardReader

TOKENS_PER_SHARD = 10**6
WINDOW = 1025
BATCH = 32
BUFFER = 1000
FRACTION = 0.9
ROUNDS = 9  # restores (and fresh starts) timed per pipeline, a fresh loader each
BUFFERED = f"realistic (buffer {BUFFER})"
FOLLOW = 40  # batches timed after a restored first batch (see the module docstring)
SETTLE = 80  # batches an earlier restore runs before its FOLLOW + 1 are timed as the baseline


def write_shards(directory: Path, num_shards: int) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for s in range(num_shards):
        path = directory / f"tok_{s:04d}.bin"
        rng.integers(0, 50_257, TOKENS_PER_SHARD, dtype=np.uint16).tofile(path)
        paths.append(path)
    return paths


def dropout(window: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return window * (torch.rand(window.shape, generator=g) > 0.1)


def pipelines(paths: list[Path]) -> dict[str, Callable[[], StreamLoader]]:
    def source() -> Stream:
        return ShardedIterable(paths, read_shard=TokenShardReader(WINDOW), seed=0)

    def realistic() -> Stream:
        return source().shuffle_buffer(BUFFER, seed=1).map(dropout, seed=2)

    return {
        "source": lambda: StreamLoader(source(), batch_size=BATCH),
        BUFFERED: lambda: StreamLoader(realistic(), batch_size=BATCH),
        f"realistic (buffer {BUFFER}), 2 workers": lambda: StreamLoader(realistic(), batch_size=BATCH, num_workers=2),
    }


@dataclass
class Pipeline:
    """One pipeline's checkpoint at the position, and its timings."""

    make: Callable[[], StreamLoader]
    position: int  # batches consumed at the checkpoint
    epoch_batches: int
    state: dict[str, Any]
    expected: torch.Tensor
    replay: float
    restores: list[float] = field(default_factory=list)
    restores_cpu: list[float] = field(default_factory=list)  # this process's CPU time (workers not included)
    fresh: list[float] = field(default_factory=list)
    earlier: tuple[int, dict[str, Any]] | None = None  # (batches before ``position``, the state there)
    followed: list[float] = field(default_factory=list)  # CPU seconds of a restore and FOLLOW more batches
    settled: list[float] = field(default_factory=list)  # CPU seconds of the same batches, settled loader


def checkpoint(make: Callable[[], StreamLoader], position: int, epoch_batches: int, follow: bool = False) -> Pipeline:
    """Replay a fresh loader to ``position`` batches (timed): its JSON state there and the next batch.

    With ``follow``, also its state SETTLE batches earlier (see :func:`follow_round`).
    """
    loader = make()
    start = time.perf_counter()
    batches = iter(loader)
    settle = min(SETTLE, position) if follow else 0
    for _ in itertools.islice(batches, position - settle):
        pass
    earlier = (settle, json.loads(json.dumps(loader.state_dict()))) if follow else None
    for _ in itertools.islice(batches, settle):
        pass
    state = json.loads(json.dumps(loader.state_dict()))
    expected = next(batches)
    replay = time.perf_counter() - start
    del batches
    return Pipeline(make, position, epoch_batches, state, expected, replay, earlier=earlier)


def follow_round(pipeline: Pipeline, earlier: tuple[int, dict[str, Any]]) -> None:
    """CPU seconds of a restore and FOLLOW batches, and of the same batches from a settled loader."""
    settle, earlier_state = earlier
    settled = pipeline.make()
    settled.load_state_dict(earlier_state)
    iterator = iter(settled)
    for _ in itertools.islice(iterator, settle):  # every re-read of that restore is done by now
        pass
    gc.collect()
    start_cpu = time.process_time()
    baseline = list(itertools.islice(iterator, FOLLOW + 1))
    pipeline.settled.append(time.process_time() - start_cpu)
    del iterator
    loader = pipeline.make()
    gc.collect()
    start_cpu = time.process_time()
    loader.load_state_dict(pipeline.state)
    iterator = iter(loader)
    restored = list(itertools.islice(iterator, FOLLOW + 1))
    pipeline.followed.append(time.process_time() - start_cpu)
    del iterator
    if len(restored) != len(baseline) or not all(map(torch.equal, restored, baseline)):
        raise SystemExit("batches after a restore differ from the uninterrupted run's: not exact")


def first_batch(pipeline: Pipeline, restore: bool) -> tuple[float, float]:
    """Seconds and CPU seconds (this process) from a freshly built loader (restored or not) to its first batch."""
    loader = pipeline.make()
    gc.collect()  # garbage of earlier runs is not this start's cost
    start, start_cpu = time.perf_counter(), time.process_time()
    if restore:
        loader.load_state_dict(pipeline.state)
    iterator = iter(loader)
    batch = next(iterator)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    if restore and not torch.equal(batch, pipeline.expected):
        raise SystemExit("restored batch differs from the uninterrupted run's: not exact")
    del iterator  # workers shut down outside the timed part
    return seconds, cpu_seconds


def time_rounds(measured: dict[str, Pipeline], rounds: int) -> None:
    """Restore and fresh-start every pipeline once per round, pipelines interleaved."""
    for round_ in range(rounds):
        for name, pipeline in measured.items():
            seconds, cpu_seconds = first_batch(pipeline, restore=True)
            pipeline.restores.append(seconds)
            pipeline.restores_cpu.append(cpu_seconds)
            pipeline.fresh.append(first_batch(pipeline, restore=False)[0])
            if pipeline.earlier is not None:
                follow_round(pipeline, pipeline.earlier)
            print(
                f"round {round_ + 1}: {name}: restore {format_seconds(pipeline.restores[-1])}, fresh start {format_seconds(pipeline.fresh[-1])}",
                flush=True,
            )


def table_row(name: str, p: Pipeline) -> list[str]:
    restore = statistics.median(p.restores)
    return [
        name,
        f"{p.position:,} of {p.epoch_batches:,}",
        format_seconds(p.replay),
        spread(p.restores),
        spread(p.restores_cpu),
        spread(p.fresh),
        f"{p.replay / restore:,.0f}x",
        f"{len(json.dumps(p.state)):,} B",
    ]


TABLE_HEADERS = [
    "pipeline",
    "position (batches)",
    "replay",
    "restore",
    "restore, CPU time",
    "fresh start",
    "speed-up (replay / restore)",
    "state (JSON)",
]


def spread(times: list[float]) -> str:
    return f"{signed(statistics.median(times))} ({signed(min(times))}–{signed(max(times))})"


def signed(seconds: float) -> str:
    """``format_seconds`` that keeps a negative difference's sign."""
    return ("-" if seconds < 0 else "") + format_seconds(abs(seconds))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    num_shards = 4 if args.quick else 100
    rounds = 1 if args.quick else ROUNDS
    parquet_shards, parquet_rows_per_shard = (4, 2000) if args.quick else (20, 10_000)
    windows = num_shards * ((TOKENS_PER_SHARD - WINDOW) // WINDOW + 1)
    position = int(FRACTION * (windows // BATCH))
    started = time.perf_counter()
    try:
        import bench_parquet  # needs pyarrow, the [parquet] extra
    except ImportError as e:
        bench_parquet, parquet_note = None, f"Parquet rows: not run ({e}; install the [parquet] extra)."
    else:
        parquet_note = (
            f"Parquet rows: {parquet_shards} shards x {parquet_rows_per_shard:,} rows of {bench_parquet.TOKENS} int32 token ids, row "
            f"groups of {bench_parquet.ROW_GROUP:,} rows (a tokenized Hugging Face dataset's Parquet layout), batches of "
            f"{bench_parquet.BATCH} rows, read by `ParquetReader`; a restore reads one row group of the current shard "
            "(through the shuffle buffer: the row groups its buffered rows come from)."
        )
    with tempfile.TemporaryDirectory(prefix="bench-streams-") as tmp:
        paths = write_shards(Path(tmp), num_shards)
        measured = {
            name: checkpoint(make, position, windows // BATCH, follow=name == BUFFERED)
            for name, make in pipelines(paths).items()
        }
        if bench_parquet is not None:
            parquet_dir = Path(tmp) / "parquet"
            parquet_dir.mkdir()
            measured |= bench_parquet.checkpoints(parquet_dir, parquet_shards, parquet_rows_per_shard)
        time_rounds(measured, rounds)  # pipelines and fresh starts interleaved in every round
    rows = [table_row(name, p) for name, p in measured.items()]
    buffered = measured[BUFFERED]
    restore = statistics.median(buffered.restores)
    extra = [f - s for f, s in zip(buffered.followed, buffered.settled, strict=True)]
    text = "\n".join(
        [
            machine_header(f"Stream restore at {FRACTION:.0%} of {num_shards * TOKENS_PER_SHARD:.0e} tokens"),
            f"{num_shards} shards x {TOKENS_PER_SHARD:,} uint16 tokens, windows of {WINDOW}, batches of {BATCH}. "
            "Replay: consume and discard up to the position, then the next batch. Restore: "
            "`load_state_dict` + first batch, checked equal to the uninterrupted batch. Fresh start: a new loader's first "
            "batch from the epoch's beginning (a buffered pipeline fills its buffer first). Median (min–max) over "
            f"{rounds} round(s), pipelines and fresh starts interleaved in each. CPU time is this process's "
            "(`time.process_time`): all of a 0-worker restore, none of the workers' part.",
            "",
            f"- target: {BUFFERED} restore ≤ 5 ms: {format_seconds(restore)} wall clock ({'met' if restore <= 5e-3 else 'missed'}); "
            f"its CPU time {format_seconds(statistics.median(buffered.restores_cpu))} (the whole restore runs in this process; CPU "
            "time is less stretched than the wall clock by other jobs, though not immune: they share the caches and cores)",
            f"- with what it leaves for later (re-reads ahead of the draws): that restore and the {FOLLOW} batches after it took "
            f"{spread(buffered.followed)} of CPU time, the same {FOLLOW + 1} batches from a loader restored {SETTLE} batches "
            f"earlier {spread(buffered.settled)}; difference per round {spread(extra)}"
            + (" (the epoch ends within these batches in --quick)" if args.quick else ""),
            "",
            parquet_note,
            "",
            markdown_table(TABLE_HEADERS, rows),
            "",
            f"Total run time: {time.perf_counter() - started:.0f} s.",
        ]
    )
    print()
    print(text)
    write_report(args.out, "streams", text)


if __name__ == "__main__":
    main()
