"""Parquet streams: restore time at 90 % of a set of Parquet shards, versus replaying to that point.

Data: 20 shards x 10,000 rows (``--quick``: 4 shards x 2,000) of 256 int32 token ids each, row
groups of 1,000 rows (the layout of a tokenized Hugging Face dataset exported with
``Dataset.to_parquet``), written to a temp dir; batches of 32 rows through ``StreamLoader``.

Pipelines:

- source: ``ShardedIterable`` over ``ParquetReader(["input_ids"])`` (shard order shuffled per epoch).
- shuffled: source -> ``shuffle_buffer(1000)`` (the buffer's rows are re-read by key on restore).

For each, a fresh loader iterates to 90 % of the epoch: the time to the next batch from there is what
"replay" (consume and discard, the usual fallback) costs. Its state is then loaded into a freshly
built loader and timed from ``load_state_dict`` to the first batch in hand ("restore", median of 3, min–max),
and that batch is checked to equal the uninterrupted run's. A restore reads the footer of the
current shard and one row group; with a shuffle buffer, the row groups its rows come from.

Run: ``python benchmarks/bench_parquet.py`` (``--quick``: a few seconds).
"""

from __future__ import annotations

import gc
import itertools
import json
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from _common import format_seconds, machine_header, markdown_table, parse_args, write_report

from resumable_data.streams import ParquetReader, ShardedIterable, Stream, StreamLoader

TOKENS = 256
ROW_GROUP = 1000
BATCH = 32
BUFFER = 1000
FRACTION = 0.9
RESTORES = 3
HEADERS = ["pipeline", "position (batches)", "replay", "restore", "speed-up", "state (JSON)"]


def write_shards(directory: Path, num_shards: int, rows: int) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for s in range(num_shards):
        tokens = rng.integers(0, 50_257, (rows, TOKENS), dtype=np.int32)
        column = pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), TOKENS).cast(pa.list_(pa.int32()))
        path = directory / f"train-{s:05d}-of-{num_shards:05d}.parquet"
        pq.write_table(pa.table({"input_ids": column}), path, row_group_size=ROW_GROUP)
        paths.append(path)
    return paths


def to_tensor(row: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(row["input_ids"], dtype=torch.int64)


def pipelines(paths: list[Path]) -> dict[str, Callable[[], StreamLoader]]:
    def source() -> Stream:
        return ShardedIterable(paths, read_shard=ParquetReader(["input_ids"], parse=to_tensor), seed=0)

    return {
        "parquet source": lambda: StreamLoader(source(), batch_size=BATCH),
        f"parquet, shuffle buffer {BUFFER}": lambda: StreamLoader(
            source().shuffle_buffer(BUFFER, seed=1), batch_size=BATCH
        ),
    }


@dataclass
class Pipeline:
    """One pipeline's checkpoint at ``position`` batches: the replay time there, its state, the next batch."""

    make: Callable[[], StreamLoader]
    position: int
    of: int
    replay: float
    state: Any
    expected: torch.Tensor
    restores: list[float] = field(default_factory=list)


def checkpoint(make: Callable[[], StreamLoader], position: int, of: int) -> Pipeline:
    """Replay a fresh loader to ``position`` (timed to the next batch in hand) and keep its state there."""
    loader = make()
    start = time.perf_counter()
    batches = iter(loader)
    for _ in itertools.islice(batches, position):
        pass
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    expected = next(batches)
    replay = time.perf_counter() - start
    return Pipeline(make, position, of, replay, state, expected)


def restore_once(p: Pipeline) -> float:
    loader = p.make()
    gc.collect()
    start = time.perf_counter()
    loader.load_state_dict(p.state)
    got = next(iter(loader))
    elapsed = time.perf_counter() - start
    if not torch.equal(got, p.expected):
        raise SystemExit(f"restore at batch {p.position}: the first batch differs from the uninterrupted run's")
    return elapsed


def parquet_rows(num_shards: int, rows: int, rounds: int) -> list[list[str]]:
    """One table row per pipeline: replay to 90 % vs restore there, restores interleaved over the pipelines."""
    batches_per_epoch = -(-num_shards * rows // BATCH)  # one slot: batches run across shard ends
    position = int(FRACTION * batches_per_epoch)
    with tempfile.TemporaryDirectory(prefix="bench-parquet-") as tmp:
        paths = write_shards(Path(tmp), num_shards, rows)
        measured = {name: checkpoint(make, position, batches_per_epoch) for name, make in pipelines(paths).items()}
        for _ in range(rounds):
            for p in measured.values():
                p.restores.append(restore_once(p))
    table = []
    for name, p in measured.items():
        median = statistics.median(p.restores)
        restore = f"{format_seconds(median)} ({format_seconds(min(p.restores))}–{format_seconds(max(p.restores))})"
        table.append(
            [
                name,
                f"{p.position:,} of {p.of:,}",
                format_seconds(p.replay),
                restore,
                f"{p.replay / median:,.0f}x",
                f"{len(json.dumps(p.state)):,} B",
            ]
        )
    return table


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    num_shards, rows = (4, 2000) if args.quick else (20, 10_000)
    rounds = 1 if args.quick else RESTORES
    table = parquet_rows(num_shards, rows, rounds)
    text = "\n".join(
        [
            machine_header(f"Parquet stream restore at {FRACTION:.0%} of {num_shards * rows:,} rows"),
            f"{num_shards} Parquet shards x {rows:,} rows of {TOKENS} int32 tokens, row groups of {ROW_GROUP:,} rows, "
            f"batches of {BATCH}. Replay: consume and discard up to the position, then the next batch. Restore: "
            f"`load_state_dict` + first batch (median (min–max) of {rounds}, pipelines interleaved), checked equal to "
            "the uninterrupted batch.",
            "",
            markdown_table(HEADERS, table),
        ]
    )
    print()
    print(text)
    write_report(args.out, "parquet", text)


if __name__ == "__main__":
    main()
