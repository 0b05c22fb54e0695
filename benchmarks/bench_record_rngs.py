"""What a seedless ``map`` below a re-reading stage costs per record: the global RNGs seeded per record.

Below ``pack``, ``shuffle_buffer``, ``batch_by_tokens`` or ``shuffle_window`` a ``map(fn)`` without
``seed=`` calls ``fn`` with torch's, numpy's and python's global RNGs seeded from the record's key
and puts them back afterwards (so a record read again after a restore is mapped as the first time).
This times one epoch of the same work, per record, median over rounds that interleave them: the
map above the shuffle (no per-record seeding), below it (seeded per record), and
``map(fn, seed=...)`` below it (a per-record ``torch.Generator`` instead); ``fn`` draws one
``torch.rand`` (or, with ``seed=``, from its generator). Then a deterministic ``fn`` (a tokenizer's
role) below the shuffle, seeded per record by default and with ``global_rng=None`` (no seeding).

    python benchmarks/bench_record_rngs.py            # full run, writes benchmarks/results/
    python benchmarks/bench_record_rngs.py --quick    # a few seconds, writes to a temp dir
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import machine_header, markdown_table, parse_args

from resumable_data.streams import ShardedIterable, Stream


class Shards:
    """``read_shard`` over shards of ints held in memory."""

    def __init__(self, num_shards: int, records: int) -> None:
        self.names = [f"s{s}" for s in range(num_shards)]
        self.records = records

    def __call__(self, shard: str, start: int) -> Any:
        return iter(range(start, self.records))


def draw(record: int) -> float:
    return record + float(torch.rand(()))


def draw_seeded(record: int, generator: torch.Generator) -> float:
    return record + float(torch.rand((), generator=generator))


def plain(record: int) -> float:
    return record + 0.5


def pipelines(shards: Shards) -> dict[str, Callable[[], Stream]]:
    def source() -> Stream:
        return ShardedIterable(shards.names, read_shard=shards, seed=0)

    return {
        "map above shuffle_buffer (batch-seeded)": lambda: source().shuffle_buffer(1000).map(draw),
        "map below shuffle_buffer (seeded per record)": lambda: source().map(draw).shuffle_buffer(1000),
        "map(seed=0) below shuffle_buffer": lambda: source().map(draw_seeded, seed=0).shuffle_buffer(1000),
        "deterministic map below shuffle_buffer (seeded per record)": lambda: source().map(plain).shuffle_buffer(1000),
        "deterministic map(global_rng=None) below shuffle_buffer": lambda: (
            source().map(plain, global_rng=None).shuffle_buffer(1000)
        ),
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    shards = Shards(16, 1_000 if args.quick else 12_500)
    rounds = 2 if args.quick else 7
    made = pipelines(shards)
    times: dict[str, list[float]] = {name: [] for name in made}
    count = 0
    for _ in range(rounds):
        for name, make in made.items():
            stream = make()
            start = time.perf_counter()
            count = sum(1 for _ in stream)
            times[name].append((time.perf_counter() - start) / count)
    base = statistics.median(next(iter(times.values())))
    rows = []
    for name, per_record in times.items():
        median = statistics.median(per_record)
        rows.append([name, f"{median * 1e6:.1f}", f"{(median - base) * 1e6:+.1f}", f"{min(per_record) * 1e6:.1f}"])
    text = "\n".join(
        [
            machine_header(f"Per-record global-RNG seeding ({count} records per epoch, {rounds} rounds)"),
            markdown_table(["pipeline", "us/record (median)", "vs first", "min"], rows),
            "",
        ]
    )
    (args.out / "bench_record_rngs.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
