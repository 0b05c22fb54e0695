"""Scale on paper, measured by simulation: restore latency and state size of rank W-1 as W and N grow.

Ranks are simulated in one process: a loader built with ``rank=W-1, world_size=W`` does exactly
what rank W-1 of a W-rank job does on restore (the state it loads is the global state every rank
agrees on; the agreement check of a real job is one all-reduce of a 16-byte digest, whatever W).

Map-style (``ResumableDataLoader``): datasets of N = 10^6, 10^9, 10^12 samples (indices only: the
dataset returns its index, nothing is stored), batch 32 per rank, the state taken halfway through
an epoch. "restore" = ``load_state_dict`` into a freshly built loader + the first batch in hand.

Streams (``StreamLoader`` over ``ShardedIterable``): S = 10^4 and 10^5 shards of 10 records, one
loader per simulated rank; every rank's state at the start of an epoch is gathered and merged
(``StreamLoader.merge_states``) into the global state a checkpoint holds. "restore" = loading the
merged state into rank W-1 of a fresh job of the same size, or of half the size (elastic: the
unfinished shards are dealt again), + the first batch.

Timings are medians of 5 repetitions (interleaved over the configurations), with min-max.

Run: ``python benchmarks/bench_scale.py`` (``--quick``: small sizes, < 30 s).
"""

from __future__ import annotations

import functools
import io
import json
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _common import format_seconds, machine_header, markdown_table, parse_args, write_report

from resumable_data import ResumableDataLoader, ShardedIterable, StreamLoader

BATCH = 32
REPS = 5
RECORDS_PER_SHARD = 10


class Indices(torch.utils.data.Dataset):
    """N samples, each its own index: nothing is materialized, so N can be 10^12."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class CountingShards:
    """``read_shard`` for shards of ``RECORDS_PER_SHARD`` records: record j of shard "s7" is 7 * 1000 + j."""

    def __call__(self, shard: str, start: int) -> Iterator[int]:
        base = int(shard[1:]) * 1000
        return iter(range(base + start, base + RECORDS_PER_SHARD))


def sizes(state: dict[str, Any]) -> tuple[int, int]:
    """(JSON bytes, torch.save bytes) of a state."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return len(json.dumps(state)), buffer.getbuffer().nbytes


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def summary(times: list[float]) -> str:
    return f"{format_seconds(statistics.median(times))} ({format_seconds(min(times))}-{format_seconds(max(times))})"


def map_cases(worlds: list[int], lengths: list[int]) -> list[list[Any]]:
    cases = []
    for n in lengths:
        for w in worlds:
            if w * BATCH > n:
                continue
            source = ResumableDataLoader(Indices(n), batch_size=BATCH, shuffle=True, seed=0, rank=w - 1, world_size=w)
            # Halfway through the epoch, on a batch boundary (every rank has taken k batches).
            k = (n // 2) // (w * BATCH)
            state = dict(source.state_dict(), position=k * w * BATCH)
            cases.append([n, w, state])
    rows: dict[tuple[int, int], list[float]] = {(n, w): [] for n, w, _ in cases}
    for _ in range(REPS):
        for n, w, state in cases:
            loader = ResumableDataLoader(Indices(n), batch_size=BATCH, shuffle=True, seed=0, rank=w - 1, world_size=w)

            def restore(loader: ResumableDataLoader = loader, state: dict[str, Any] = state) -> Any:
                loader.load_state_dict(state)
                return next(iter(loader))

            rows[(n, w)].append(timed(restore))
    return [[f"10^{len(str(n)) - 1}", w, *sizes(state), summary(rows[(n, w)])] for n, w, state in cases]


def stream_cases(worlds: list[int], shard_counts: list[int]) -> list[list[Any]]:
    cases = []
    for s in shard_counts:
        names = [f"s{i}" for i in range(s)]
        pipeline = ShardedIterable(names, read_shard=CountingShards(), seed=0)
        for w in worlds:
            if w > s:
                continue
            started = time.perf_counter()
            states = [StreamLoader(pipeline, batch_size=4, rank=r, world_size=w).state_dict() for r in range(w)]
            simulate = time.perf_counter() - started
            merge = [timed(functools.partial(StreamLoader.merge_states, states)) for _ in range(3)]
            merged = StreamLoader.merge_states(states)
            cases.append([s, w, pipeline, states[-1], merged, merge, simulate])
    restores: dict[tuple[int, int, str], list[float]] = {}
    for _ in range(REPS):
        for s, w, pipeline, _own, merged, _merge, _sim in cases:
            for label, new_world in (("same", w), ("elastic", max(1, w // 2) if w > 1 else 2)):
                loader = StreamLoader(pipeline, batch_size=4, rank=new_world - 1, world_size=new_world)

                def restore(loader: StreamLoader = loader, merged: dict[str, Any] = merged) -> Any:
                    loader.load_state_dict(merged)
                    return next(iter(loader))

                restores.setdefault((s, w, label), []).append(timed(restore))
    rows = []
    for s, w, _pipeline, own, merged, merge, simulate in cases:
        elastic_to = max(1, w // 2) if w > 1 else 2
        rows.append([
            f"10^{len(str(s)) - 1}", w, sizes(own)[0], sizes(merged)[0], summary(merge),
            summary(restores[(s, w, "same")]), f"{summary(restores[(s, w, 'elastic')])} (to W={elastic_to})",
            format_seconds(simulate),
        ])  # fmt: skip
    return rows


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    if args.quick:
        worlds, lengths, stream_worlds, shard_counts = [1, 8, 1024], [10**6, 10**12], [1, 8], [10**3]
    else:
        worlds, lengths = [1, 8, 1024, 16384], [10**6, 10**9, 10**12]
        stream_worlds, shard_counts = [1, 8, 1024], [10**4, 10**5]
    map_rows = map_cases(worlds, lengths)
    stream_rows = stream_cases(stream_worlds, shard_counts)
    text = "\n".join(
        [
            machine_header("Scale: restore latency and state size of rank W-1 (ranks simulated in one process)"),
            "## Map-style: ResumableDataLoader, halfway through an epoch, batch 32 per rank",
            "",
            markdown_table(
                ["N", "W", "state JSON (B)", "state torch.save (B)", "restore + first batch, median (min-max)"],
                map_rows,
            ),
            "",
            "## Streams: StreamLoader over S shards, the merged global state of W ranks",
            "",
            markdown_table(
                [
                    "S",
                    "W",
                    "rank W-1 own state (B)",
                    "merged global state (B)",
                    "merge_states",
                    "restore same W",
                    "restore elastic",
                    "simulating W ranks' states",
                ],
                stream_rows,
            ),
        ]
    )
    print(text)
    write_report(args.out, "bench_scale", text)


if __name__ == "__main__":
    main()
