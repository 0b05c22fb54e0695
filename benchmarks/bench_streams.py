"""Stream pipelines: restore time at 90% of a 10^8-token shard set, versus replaying to that point.

Data: 100 shards x 10^6 uint16 tokens (10^8 tokens, 200 MB) in a temp dir, read as windows of
1024 + 1 tokens by ``TokenShardReader``; batches of 32 windows through ``StreamLoader``.

Pipelines:

- source: ``ShardedIterable`` alone (shard order shuffled per epoch).
- realistic: source -> ``shuffle_buffer(1000)`` -> ``map`` with random token dropout -> batch.
- realistic, 2 workers: the same with ``num_workers=2``.

For each, a fresh loader iterates to 90% of the epoch: the time to the next batch from there is
what "replay" (consume and discard, the usual fallback) costs. Its state is then loaded into a
freshly built loader and timed from ``load_state_dict`` to the first batch in hand ("restore",
median of 3), and that batch is checked to equal the uninterrupted run's.

Run: ``python benchmarks/bench_streams.py`` (``--quick``: 10 shards, < 30 s).
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from _common import format_seconds, machine_header, markdown_table, parse_args, write_report

from resumable_data.streams import ShardedIterable, Stream, StreamLoader, TokenShardReader

TOKENS_PER_SHARD = 10**6
WINDOW = 1025
BATCH = 32
BUFFER = 1000
FRACTION = 0.9


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
        f"realistic (buffer {BUFFER})": lambda: StreamLoader(realistic(), batch_size=BATCH),
        f"realistic (buffer {BUFFER}), 2 workers": lambda: StreamLoader(realistic(), batch_size=BATCH, num_workers=2),
    }


def measure(make: Callable[[], StreamLoader], position: int) -> tuple[float, float, int]:
    """(replay seconds, median restore seconds, state bytes) at ``position`` batches."""
    loader = make()
    start = time.perf_counter()
    batches = iter(loader)
    for _ in itertools.islice(batches, position):
        pass
    state = json.loads(json.dumps(loader.state_dict()))
    expected = next(batches)
    replay = time.perf_counter() - start
    del batches
    restores = []
    for _ in range(3):
        restored = make()
        start = time.perf_counter()
        restored.load_state_dict(state)
        first = next(iter(restored))
        restores.append(time.perf_counter() - start)
        if not torch.equal(first, expected):
            raise SystemExit("restored batch differs from the uninterrupted run's: not exact")
    return replay, statistics.median(restores), len(json.dumps(state))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    num_shards = 10 if args.quick else 100
    windows = num_shards * ((TOKENS_PER_SHARD - WINDOW) // WINDOW + 1)
    position = int(FRACTION * (windows // BATCH))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-streams-") as tmp:
        paths = write_shards(Path(tmp), num_shards)
        for name, make in pipelines(paths).items():
            replay, restore, size = measure(make, position)
            rows.append([name, f"{position:,} of {windows // BATCH:,}", format_seconds(replay), format_seconds(restore), f"{replay / restore:,.0f}x", f"{size:,} B"])
            print(" | ".join(rows[-1]), flush=True)
    text = "\n".join(
        [
            machine_header(f"Stream restore at {FRACTION:.0%} of {num_shards * TOKENS_PER_SHARD:.0e} tokens"),
            f"{num_shards} shards x {TOKENS_PER_SHARD:,} uint16 tokens, windows of {WINDOW}, batches of {BATCH}. "
            "Replay: consume and discard up to the position, then the next batch. Restore: "
            "`load_state_dict` + first batch (median of 3), checked equal to the uninterrupted batch.",
            "",
            markdown_table(["pipeline", "position (batches)", "replay", "restore", "speed-up", "state (JSON)"], rows),
        ]
    )
    print()
    print(text)
    write_report(args.out, "streams", text)


if __name__ == "__main__":
    main()
