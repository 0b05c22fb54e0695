"""Streams over shards on a real S3-compatible server (``rclone serve s3``, see conftest.py).

Specification: a pipeline over ``s3://`` shards yields bitwise what the same pipeline yields over
the same files read locally, uninterrupted or stopped mid-epoch and restored (also into another
number of workers), each record exactly once per epoch; token windows, text lines and Parquet rows.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import resumed_run
from resumable_data.streams import (
    ParquetReader,
    ShardedIterable,
    Stream,
    StreamLoader,
    TextLineReader,
    TokenShardReader,
    mix,
)
from resumable_data.testing import assert_same
from streams_harness import assert_exactly_once_across_layout_change, ids

A_SHARDS = [8 * 30 + 3, 8 * 17, 8 * 25 + 5, 8 * 9]  # tokens of the 8-token-window shards
B_SHARDS = [5 * 20, 5 * 33 + 2, 5 * 12]  # tokens of the 5-token-window shards


class Data:
    """The bucket's shards by URL and as the local files the server holds (the same bytes)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.bucket = server.bucket()
        self.options = server.options()
        for prefix, sizes, first in (("a", A_SHARDS, 0), ("b", B_SHARDS, 10)):
            for s, n in enumerate(sizes):
                tokens = ((first + s) * 1000 + np.arange(n)).astype(np.uint16)  # first token = record id
                server.put(f"s3://{self.bucket}/{prefix}/tok_{s:02d}.bin", tokens.tobytes())

    def shards(self, prefix: str, remote: bool) -> Any:
        if remote:
            return f"s3://{self.bucket}/{prefix}/*.bin"
        return sorted(str(p) for p in (self.server.root / self.bucket / prefix).glob("*.bin"))

    def source(self, prefix: str, window: int, remote: bool, seed: int, **options: Any) -> ShardedIterable:
        reader = TokenShardReader(window, storage_options={**self.options, **options} if remote else None)
        return ShardedIterable(self.shards(prefix, remote), read_shard=reader, seed=seed)


@pytest.fixture(scope="module")
def data(s3_server: Any) -> Data:
    return Data(s3_server)


def pipeline(data: Data, remote: bool) -> Stream:
    """shuffle_window and shuffle_buffer sources, mixed, packed into 12-token blocks."""
    a = data.source("a", 8, remote, seed=1).shuffle_window(16, seed=2)
    b = data.source("b", 5, remote, seed=3).shuffle_buffer(7, seed=4)
    return mix([a, b], [0.6, 0.4], seed=5).pack(12)


def _timeout(num_workers: int) -> dict[str, Any]:
    return {"timeout": 60} if num_workers else {}


def test_remote_shards_are_listed_sorted_and_counted_from_their_sizes(data: Data) -> None:
    remote, local = data.source("a", 8, True, seed=0), data.source("a", 8, False, seed=0)
    assert remote.shards == [f"s3://{data.bucket}/a/tok_{s:02d}.bin" for s in range(len(A_SHARDS))]
    assert remote.sizes == local.sizes == [n // 8 for n in A_SHARDS]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_remote_pipeline_stopped_mid_epoch_resumes_as_the_local_run(data: Data, num_workers: int) -> None:
    def loader(remote: bool) -> StreamLoader:
        # timeout: a worker blocked on the server fails the test instead of hanging it
        return StreamLoader(pipeline(data, remote), batch_size=4, num_workers=num_workers, **_timeout(num_workers))

    reference = list(loader(False))
    assert_same(reference, resumed_run(lambda: loader(True), len(reference) // 2), "remote resumed run")


def test_each_remote_record_is_read_exactly_once_per_epoch_and_across_a_worker_change(data: Data) -> None:
    every = [(s * 1000 + 8 * i) for s, n in enumerate(A_SHARDS) for i in range(n // 8)]
    loader = StreamLoader(
        data.source("a", 8, True, seed=6).shuffle_window(20, seed=7), batch_size=5, num_workers=2, timeout=60
    )
    assert Counter(ids(list(loader))) == Counter(every)
    assert_exactly_once_across_layout_change(
        lambda: data.source("a", 8, True, seed=6).shuffle_buffer(6, seed=7), every, (1, 2), (1, 1), [4]
    )


def test_remote_text_lines_resume_as_the_local_run(s3_server: Any) -> None:
    bucket, options = s3_server.bucket(), s3_server.options()
    for s, n in enumerate([9, 0, 14, 6]):
        lines = "".join(json.dumps({"id": s * 100 + i, "text": "é" * i}) + "\n" for i in range(n))
        s3_server.put(f"s3://{bucket}/text/part-{s}.jsonl", lines.encode())
    local = sorted(str(p) for p in (s3_server.root / bucket / "text").glob("*.jsonl"))

    def make(remote: bool) -> Stream:
        reader = TextLineReader(json.loads, storage_options=options if remote else None)
        shards = f"s3://{bucket}/text/*.jsonl" if remote else local
        return ShardedIterable(shards, read_shard=reader, seed=2).shuffle_buffer(5, seed=3)

    assert_same(list(make(False)), resumed_run(lambda: make(True), 11), "remote text lines")


def test_remote_parquet_rows_resume_as_the_local_run(s3_server: Any, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    bucket, options = s3_server.bucket(), s3_server.options()
    for s, n in enumerate([23, 7, 31]):
        table = pa.table({"id": list(range(s * 100, s * 100 + n)), "x": [float(i) for i in range(n)]})
        pq.write_table(table, tmp_path / "f.parquet", row_group_size=4)
        s3_server.put(f"s3://{bucket}/pq/part-{s}.parquet", (tmp_path / "f.parquet").read_bytes())
    local = sorted(str(p) for p in (s3_server.root / bucket / "pq").glob("*.parquet"))

    def make(remote: bool) -> Stream:
        reader = ParquetReader(["id"], storage_options=options if remote else None)
        shards = f"s3://{bucket}/pq/*.parquet" if remote else local
        return ShardedIterable(shards, read_shard=reader, seed=4).shuffle_window(9, seed=5)

    reference = list(make(False))
    assert ShardedIterable(f"s3://{bucket}/pq/*", read_shard=ParquetReader(storage_options=options)).sizes == [
        23,
        7,
        31,
    ]
    assert_same(reference, resumed_run(lambda: make(True), 30), "remote parquet rows")
