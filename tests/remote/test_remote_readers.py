"""Text lines and Parquet rows read from a real S3-compatible server through the node-local cache
(``TextLineReader`` / ``ParquetReader`` with ``cache_dir=``), as token windows are.

Specification, for each reader: a window shuffle over the remote shards, read through a cache,
stopped mid-epoch and restored (in the loader's process and in 2 workers), yields bitwise what an
uninterrupted run over the same files read locally yields; a second epoch is served from the
cache (no object is downloaded again, counted at the proxy); a shard rewritten on the server
since the checkpoint is refused by name, even with the old copy in the cache.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import json_roundtrip, resumed_run
from resumable_data import ResumeError
from resumable_data.streams import ParquetReader, ShardedIterable, StreamLoader, TextLineReader, TokenShardReader
from resumable_data.testing import assert_same

ROWS = [37, 12, 50, 29]  # records per shard


class Shards:
    """One format's shards on the server, and as the local files it serves (the same bytes)."""

    def __init__(self, server: Any, kind: str, tmp_path: Path) -> None:
        self.server, self.kind, self.tmp = server, kind, tmp_path
        self.name = server.bucket()
        self.suffix = "jsonl" if kind == "text" else "parquet"
        self.urls = [f"s3://{self.name}/part-{s}.{self.suffix}" for s in range(len(ROWS))]
        for s in range(len(ROWS)):
            self.write(s, first=s * 1000)
        self.local = [str(server.root / self.name / f"part-{s}.{self.suffix}") for s in range(len(ROWS))]

    def write(self, s: int, first: int) -> None:
        """Shard ``s`` with ids from ``first`` (and a payload that makes each record ~100 bytes)."""
        ids = range(first, first + ROWS[s])
        if self.kind == "text":
            data = "".join(json.dumps({"id": i, "text": f"{i:x}" * 20}) + "\n" for i in ids).encode()
        else:
            pq = pytest.importorskip("pyarrow.parquet")
            import pyarrow as pa

            pq.write_table(
                pa.table({"id": list(ids), "text": [f"{i:x}" * 20 for i in ids]}),
                self.tmp / "f.parquet",
                row_group_size=8,
            )
            data = (self.tmp / "f.parquet").read_bytes()
        self.server.put(self.urls[s], data)

    def source(self, endpoint: str | None, cache: Path | None, seed: int = 0) -> ShardedIterable:
        """Over the server at ``endpoint`` through a cache in ``cache``, or (None) over the local files."""
        reader_options: dict[str, Any] = {}
        if endpoint is not None:
            reader_options = {"storage_options": self.server.options(endpoint), "cache_dir": cache, "prefetch": 1}
        if self.kind == "text":
            reader: Any = TextLineReader(lambda line: json.loads(line)["id"], **reader_options)
        else:
            reader = ParquetReader(["id"], parse=lambda row: row["id"], **reader_options)
        shards = f"s3://{self.name}/*.{self.suffix}" if endpoint is not None else self.local
        return ShardedIterable(shards, read_shard=reader, seed=seed)


@pytest.fixture(params=["text", "parquet"])
def shards(request: pytest.FixtureRequest, s3_server: Any, tmp_path: Path) -> Shards:
    return Shards(s3_server, request.param, tmp_path)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_cached_window_shuffle_stopped_mid_epoch_resumes_as_the_local_run(
    shards: Shards, s3_server: Any, tmp_path: Path, num_workers: int
) -> None:
    def loader(endpoint: str | None) -> StreamLoader:
        stream = shards.source(endpoint, tmp_path / "cache", seed=1).shuffle_window(40, seed=2)  # spans shards
        workers = {"num_workers": num_workers, "timeout": 60} if num_workers else {}
        return StreamLoader(stream, batch_size=4, **workers)

    reference = list(loader(None))
    assert sorted(int(i) for batch in reference for i in batch) == sorted(
        s * 1000 + i for s, n in enumerate(ROWS) for i in range(n)
    )
    # The server directly: forked workers would hold copies of the proxy's sockets (test_remote_cache).
    assert_same(reference, resumed_run(lambda: loader(s3_server.endpoint), len(reference) // 2), "cached resumed run")


def test_a_second_epoch_is_served_from_the_cache(shards: Shards, proxy: Any, tmp_path: Path) -> None:
    stream = shards.source(proxy.endpoint, tmp_path / "cache", seed=3).shuffle_window(40, seed=4)
    first = list(stream)
    data = sum(len(Path(path).read_bytes()) for path in shards.local)
    assert proxy.bytes_down >= data  # every shard downloaded (or read by ranges) once
    stream.set_epoch(1)
    proxy.reset_counters()
    second = list(stream)
    assert sorted(first) == sorted(second) and first != second
    # No request at all: no object is read again, and a shard entered takes its cached copy's identity.
    assert proxy.requests == 0 and proxy.bytes_down == 0, (proxy.methods, proxy.bytes_down)


def test_a_shard_rewritten_on_the_server_is_refused_by_name(shards: Shards, proxy: Any, tmp_path: Path) -> None:
    first = shards.source(proxy.endpoint, tmp_path / "cache", seed=5)
    reading = iter(first)
    for _ in range(ROWS[0] // 2):
        next(reading)
    state = json_roundtrip(first.state_dict())
    # The shard being read: text keeps cursors (the first is in it), Parquet a position.
    position = first.position
    index = state["remaining"][0][0] if position is None else first.keys_at(np.array([position]))[0][1]
    shards.write(index, first=index * 1000 + 7)  # other records where the cursor points
    restored = shards.source(proxy.endpoint, tmp_path / "cache", seed=5)  # its cache holds the old copy
    restored.load_state_dict(state)
    with pytest.raises(
        ResumeError, match=rf"shard {index} .*part-{index}\.{shards.suffix}.* changed since the checkpoint"
    ):
        next(iter(restored))


def test_the_next_shard_of_the_schedule_downloads_while_the_first_is_read(shards: Shards, tmp_path: Path) -> None:
    stream = shards.source(shards.server.endpoint, tmp_path / "cache", seed=6)  # prefetch=1
    next(iter(stream))  # the first shard of the slot's schedule, read from its start: downloaded
    schedule = [stream.shards[i] for i in stream.shard_order(0)]
    complete = tmp_path / "cache" / "shards"
    deadline = time.monotonic() + 20
    while len(list(complete.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # a third download would have begun by now
    # And the next one, in the background; no more (prefetch=1). Cached files are named by URL key.
    cached = {path.name.split(".")[0] for path in complete.iterdir()}
    assert cached == {hashlib.sha256(url.encode()).hexdigest()[:32] for url in schedule[:2]}


@pytest.mark.parametrize("reader", [TextLineReader, ParquetReader, TokenShardReader])
def test_every_reader_checks_the_cache_arguments_alike(reader: Any, tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    args = (8,) if reader is TokenShardReader else ()
    with pytest.raises(ValueError, match="cache_limit=100 needs cache_dir="):
        reader(*args, cache_limit=100)
    with pytest.raises(ValueError, match="cache_limit should be"):
        reader(*args, cache_dir=tmp_path, cache_limit=0)
    with pytest.raises(ValueError, match="prefetch should be"):
        reader(*args, cache_dir=tmp_path, prefetch=-1)
    if reader is ParquetReader:
        with pytest.raises(ValueError, match="not what an opener returns"):
            reader(opener=open, cache_dir=tmp_path)
