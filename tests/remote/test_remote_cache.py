"""Remote token shards read through the node-local cache (``TokenShardReader(cache_dir=...)``) from a
real S3-compatible server behind the counting proxy.

Specification: a pipeline read through the cache yields bitwise what it yields over the same files
read locally, uninterrupted or stopped mid-epoch and restored; the workers sharing one cache
download each shard once; the schedule from the keyed order makes eviction download no more than
an LRU cache of the same size does; a restore fetches the shard it resumes in, by ranged reads
first, and never a shard its epoch read before the checkpoint; a shard changed on the server is
refused through the cache by name.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import json_roundtrip, resumed_run
from resumable_data import ResumeError
from resumable_data.storage import ShardCache
from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader, mix, write_token_shards
from resumable_data.testing import assert_same

WINDOW = 8
SHARDS = [8 * 30 + 3, 8 * 17, 8 * 25 + 5, 8 * 9, 8 * 21, 8 * 12]  # tokens per shard
EVEN = [8 * 4096] * 8  # equal 64 KiB shards for the byte counts: half the data is four shards


class Bucket:
    """Token shards on the server and as the local files it serves (the same bytes)."""

    def __init__(self, server: Any, sizes: list[int]) -> None:
        self.server, self.name = server, server.bucket()
        self.urls = [f"s3://{self.name}/tok_{s:02d}.bin" for s in range(len(sizes))]
        for s, (url, n) in enumerate(zip(self.urls, sizes, strict=True)):
            server.put(url, ((s * 1000 + np.arange(n)) % 65536).astype(np.uint16).tobytes())
        self.local = [str(server.root / self.name / f"tok_{s:02d}.bin") for s in range(len(sizes))]
        self.bytes = 2 * sum(sizes)

    def source(self, endpoint: str | None, cache: Path | None, seed: int = 0, **reader: Any) -> ShardedIterable:
        """Over the server (through ``endpoint``) with a cache in ``cache``, or over the local files."""
        if endpoint is None:
            return ShardedIterable(self.local, read_shard=TokenShardReader(WINDOW), seed=seed)
        options = self.server.options(endpoint)
        token_reader = TokenShardReader(WINDOW, storage_options=options, cache_dir=cache, **reader)
        return ShardedIterable(f"s3://{self.name}/*.bin", read_shard=token_reader, seed=seed)


def cached_files(cache: Path) -> set[str]:
    """The URL keys of the shards in the cache (complete or downloading)."""
    names = [p.name for sub in ("shards", "partial") if (cache / sub).exists() for p in (cache / sub).iterdir()]
    return {name.split(".")[0] for name in names}


def url_key(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:32]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_cached_pipeline_stopped_mid_epoch_resumes_as_the_local_run(
    s3_server: Any, tmp_path: Path, num_workers: int
) -> None:
    bucket = Bucket(s3_server, SHARDS)

    def loader(endpoint: str | None) -> StreamLoader:
        # Two sources on one cache: a window shuffle reads by key, a buffer fills by key.
        a = bucket.source(endpoint, tmp_path / "cache", seed=1).shuffle_window(16, seed=2)
        b = bucket.source(endpoint, tmp_path / "cache", seed=3).shuffle_buffer(7, seed=4)
        workers = {"num_workers": num_workers, "timeout": 60} if num_workers else {}
        return StreamLoader(mix([a, b], [0.5, 0.5], seed=5), batch_size=4, **workers)

    reference = list(loader(None))
    # The server directly: forked workers would hold copies of the proxy's sockets (see epochs_read).
    assert_same(reference, resumed_run(lambda: loader(s3_server.endpoint), len(reference) // 2), "cached resumed run")
    assert cached_files(tmp_path / "cache") == {url_key(url) for url in bucket.urls}


class Unplanned(TokenShardReader):
    """A reader whose cache is told no schedule: it evicts the least recently used shard (and
    prefetches nothing), what a cache that cannot see the order does."""

    def planner(self) -> None:
        return None


def epochs_read(stream: ShardedIterable, epochs: int, num_workers: int = 0) -> None:
    # Workers through the proxy are spawned: a forked one would keep copies of the proxy's sockets
    # open, so that a connection the proxy closes stays open and its client waits for a timeout.
    workers = {"timeout": 60, "multiprocessing_context": "spawn"} if num_workers else {}
    loader = StreamLoader(stream, batch_size=16, num_workers=num_workers, **workers)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for _ in loader:
            pass


# 21 s of the default suite (two spawned workers per epoch); the default suite keeps the same property
# for processes through test_torchrun_cache.py (two ranks with two workers each: one download per shard
# over both epochs).
@pytest.mark.slow
def test_two_workers_sharing_one_cache_download_each_shard_once_over_two_epochs(
    s3_server: Any, proxy: Any, tmp_path: Path
) -> None:
    bucket = Bucket(s3_server, EVEN)
    stream = bucket.source(proxy.endpoint, tmp_path / "cache", seed=3)  # each epoch deals the shards anew
    proxy.reset_counters()
    epochs_read(stream, 2, num_workers=2)
    # Every shard's bytes once (plus the listing and HEAD answers, a few KiB): without the cache the
    # two epochs would read them twice.
    assert bucket.bytes <= proxy.bytes_down < bucket.bytes + 64 * 1024


def test_eviction_by_next_use_downloads_no_more_than_lru_over_three_epochs(
    s3_server: Any, proxy: Any, tmp_path: Path
) -> None:
    bucket = Bucket(s3_server, EVEN)
    downloaded = {}
    for name, reader in (("next-use", TokenShardReader), ("lru", Unplanned)):
        options = s3_server.options(proxy.endpoint)
        # prefetch=1: with a cache of four shards, two prefetched and one being read leave one to keep
        token_reader = reader(
            WINDOW, storage_options=options, cache_dir=tmp_path / name, cache_limit=bucket.bytes // 2, prefetch=1
        )
        stream = ShardedIterable(f"s3://{bucket.name}/*.bin", read_shard=token_reader, seed=4)
        proxy.reset_counters()
        epochs_read(stream, 3)
        downloaded[name] = proxy.bytes_down
    print(f"bytes over 3 epochs, cache = half of {bucket.bytes}: {downloaded}")
    # Any policy downloads every shard once and, per later epoch, at least the half not cached: 2x
    # the data is the floor, LRU at most 3x.
    assert 2 * bucket.bytes <= downloaded["next-use"] <= downloaded["lru"]


def test_a_restore_late_in_the_epoch_fetches_only_the_shard_it_resumes_in(
    s3_server: Any, proxy: Any, tmp_path: Path
) -> None:
    bucket = Bucket(s3_server, EVEN)
    first = bucket.source(proxy.endpoint, tmp_path / "first", seed=5, prefetch=1)
    reading = iter(first)
    records = sum(EVEN) // WINDOW
    read_before = [next(reading) for _ in range(records * 9 // 10)]
    state = json_roundtrip(first.state_dict())
    index = first.keys_at(np.array([first.position]))[0][1]  # the shard the checkpoint is in
    restored = bucket.source(proxy.endpoint, tmp_path / "cold", seed=5, prefetch=1)  # a new machine
    restored.load_state_dict(state)
    proxy.reset_counters()
    reading = iter(restored)
    batch = [next(reading) for _ in range(4)]
    first_requests = proxy.requests
    deadline = time.monotonic() + 20
    while url_key(bucket.urls[index]) not in cached_files(tmp_path / "cold") and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # any other download would have begun by now
    # On the first batch's path: the identity check (a HEAD, whose size the read reuses) and one ranged
    # read; in the background the shard's download (a HEAD and a GET) may have begun.
    assert first_requests <= 4, first_requests
    assert cached_files(tmp_path / "cold") == {url_key(bucket.urls[index])}
    assert proxy.bytes_down <= 2 * 2 * EVEN[index] + 16 * 1024
    rest = batch + list(reading)
    assert_same(read_before + rest, list(bucket.source(None, None, seed=5)), "restored through a cold cache")


@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "cold-cache"])
def test_a_restore_at_90_percent_costs_one_head_and_one_ranged_read_before_its_first_batch(
    s3_server: Any, proxy: Any, tmp_path: Path, cached: bool
) -> None:
    bucket = Bucket(s3_server, EVEN)
    first = bucket.source(proxy.endpoint, tmp_path / "first" if cached else None, seed=7, prefetch=0)
    reading = iter(first)
    read_before = [next(reading) for _ in range(sum(EVEN) // WINDOW * 9 // 10)]
    state = json_roundtrip(first.state_dict())
    restored = bucket.source(proxy.endpoint, tmp_path / "cold" if cached else None, seed=7, prefetch=0)
    restored.load_state_dict(state)
    proxy.reset_counters()
    reading = iter(restored)
    batch = [next(reading) for _ in range(4)]
    # The shard-changed check's HEAD (its size also counts the shard's windows) and one ranged GET of
    # the records from the cursor on; prefetch=0 keeps background downloads out of the count.
    assert dict(proxy.methods) == {"HEAD": 1, "GET": 1}, proxy.methods
    rest = batch + list(reading)
    assert_same(read_before + rest, list(bucket.source(None, None, seed=7)), "restored at 90 % of the epoch")


def test_a_shard_changed_on_the_server_is_refused_through_the_cache(s3_server: Any, proxy: Any, tmp_path: Path) -> None:
    bucket = Bucket(s3_server, SHARDS)
    first = bucket.source(proxy.endpoint, tmp_path / "cache", seed=6)
    reading = iter(first)
    for _ in range(20):
        next(reading)
    state = json_roundtrip(first.state_dict())
    index, offset = first.keys_at(np.array([first.position]))[0][1:]
    tokens = (np.arange(SHARDS[index]) + 7).astype(np.uint16).tobytes()  # same size, other bytes
    s3_server.put(bucket.urls[index], tokens)
    restored = bucket.source(proxy.endpoint, tmp_path / "cache", seed=6)
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=f"shard {index} .*tok_{index:02d}.bin.* changed since the checkpoint"):
        next(iter(restored))
    allowed = ShardedIterable(
        f"s3://{bucket.name}/*.bin",
        read_shard=TokenShardReader(
            WINDOW, storage_options=s3_server.options(proxy.endpoint), cache_dir=tmp_path / "cache"
        ),
        seed=6,
        allow_changed_shards=True,
    )
    allowed.load_state_dict(state)
    assert next(iter(allowed))[0].item() == 7 + offset * WINDOW  # the shard as it is now, read through the cache


# A second process sharing the cache: the same pipeline (two slots: its two readers), one epoch.
SLOT_PROCESS = """
import json, sys
from resumable_data.streams import StreamLoader
sys.path[:0] = [{tests!r}, {tests!r} + "/.."]
from test_remote_cache import two_slot_pipeline
config = json.loads(sys.argv[1])
for _ in StreamLoader(two_slot_pipeline(**config), batch_size=64):
    pass
"""


def two_slot_pipeline(urls: list[str], options: dict[str, Any], cache: str, limit: int) -> Any:
    """Two readers on one cache over the same shards, each a slot: a window shuffle spanning three
    shards, reading by key, and an in-order read, which waits for the download of each shard."""

    def reader() -> TokenShardReader:
        return TokenShardReader(WINDOW, storage_options=options, cache_dir=cache, cache_limit=limit, prefetch=1)

    by_key = ShardedIterable(urls, read_shard=reader(), seed=1).shuffle_window(3 * BOUND_SHARD // WINDOW, seed=2)
    in_order = ShardedIterable(urls, read_shard=reader(), seed=1, sizes="unknown")
    return mix([by_key, in_order], [0.5, 0.5], seed=3)


BOUND_SHARD, BOUND_SHARDS = 4096, 20  # tokens per shard (8 KiB) and shards in the bound's test


def test_the_cache_exceeds_its_limit_by_at_most_one_shard_per_slot(s3_server: Any, tmp_path: Path) -> None:
    bucket = Bucket(s3_server, [BOUND_SHARD] * BOUND_SHARDS)
    shard_bytes, cache = 2 * BOUND_SHARD, tmp_path / "cache"
    config = {"urls": bucket.urls, "options": s3_server.options(), "cache": str(cache), "limit": 2 * shard_bytes}
    code = SLOT_PROCESS.format(tests=str(Path(__file__).parent))
    other = subprocess.Popen([sys.executable, "-c", code, json.dumps(config)], stderr=subprocess.PIPE)
    try:
        loader = StreamLoader(two_slot_pipeline(**config), batch_size=64, num_workers=2, timeout=60)
        batches = sum(1 for _ in loader)
        _, errors = other.communicate(timeout=90)
    finally:
        other.kill()
    assert other.returncode == 0, errors.decode()[-3000:]
    assert batches == 2 * BOUND_SHARDS * BOUND_SHARD // WINDOW // 64
    slots = 2 * 3  # two readers in each of two workers and the other process
    # The high-water mark taken at every reservation (under the lock each process takes for it).
    peak = ShardCache.peak_bytes(cache)
    print(f"peak {peak} bytes: limit {config['limit']} + {peak - config['limit']} ({slots} slots of {shard_bytes})")
    # Above the limit (the in-order reads find no room and go over it), by at most a shard per slot.
    assert config["limit"] < peak <= config["limit"] + slots * shard_bytes


def test_a_restore_over_an_index_waits_for_no_lookup_of_the_shards_it_reads_later(
    s3_server: Any, proxy: Any, tmp_path: Path
) -> None:
    # Shards listed by an index: their sizes are known, their ETags are not until asked. The schedule
    # a restore hands the cache names every shard of the rest of the epoch and of the next one; the
    # first batch must not wait for those lookups (a listing of the folder, or a HEAD each), only for
    # the identity check of the shard it resumes in and its ranged read.
    bucket = s3_server.bucket()
    folder = f"s3://{bucket}/tokens"
    tokens = (np.arange(16 * 8 * 64) % 65536).astype(np.uint16)
    index = write_token_shards([tokens], folder, shard_tokens=8 * 64, storage_options=s3_server.options())
    local = write_token_shards([tokens], tmp_path / "local", shard_tokens=8 * 64)

    def source(index: str, cache: Path | None, options: dict[str, Any] | None) -> ShardedIterable:
        reader = TokenShardReader(WINDOW, storage_options=options, cache_dir=cache, prefetch=2 if cache else 0)
        return ShardedIterable.from_index(index, read_shard=reader, storage_options=options, seed=9)

    options = s3_server.options(proxy.endpoint)
    first = source(index, tmp_path / "first", options)
    reading = iter(first)
    read_before = [next(reading) for _ in range(len(tokens) // WINDOW * 9 // 10)]
    state = json_roundtrip(first.state_dict())
    resumes_in = first.keys_at(np.array([first.position]))[0][1]
    restored = source(index, tmp_path / "cold", options)
    restored.load_state_dict(state)
    resumed_path = f"/{bucket}/tokens/shard-{resumes_in:05d}.bin"
    proxy.reset_counters()

    def lookup(method: str, path: str) -> bool:  # of other shards: a HEAD each, or a listing of the folder
        return (method == "HEAD" and path != resumed_path) or (method == "GET" and path.rstrip("/") == f"/{bucket}")

    proxy.hold = lookup
    head: list[Any] = []
    reading = iter(restored)
    first_batch = threading.Thread(target=lambda: head.extend(next(reading) for _ in range(4)), daemon=True)
    first_batch.start()
    first_batch.join(30)
    held = [entry for entry in proxy.log if lookup(entry[0], entry[1])]
    proxy.release()
    assert len(head) == 4, "the first batch waited for the lookups of shards it reads later"
    assert held, "no lookup of a later shard was asked: the test no longer holds what it meant to"
    reference = list(source(local, None, None))
    assert_same(read_before + head + list(reading), reference, "restored over an index, lookups held")


def test_a_window_reading_by_key_from_more_shards_than_prefetch_gets_them_all_cached(
    s3_server: Any, proxy: Any, tmp_path: Path
) -> None:
    # A shuffle window spanning four shards reads their records by key, ahead of the one-shard
    # prefetch: each shard it reads that is not cached yet downloads in the background, so the
    # second epoch reads nothing from the server (before, half of the shards stayed uncached and
    # were read by ranged requests every epoch).
    bucket = Bucket(s3_server, EVEN)
    stream = bucket.source(proxy.endpoint, tmp_path / "cache", seed=5, prefetch=1).shuffle_window(4 * 4096, seed=6)
    epochs_read(stream, 1)
    deadline = time.monotonic() + 10  # the last downloads may still be finishing
    while time.monotonic() < deadline and len(cached_files(tmp_path / "cache")) < len(bucket.urls):
        time.sleep(0.05)
    assert cached_files(tmp_path / "cache") == {url_key(url) for url in bucket.urls}
    proxy.reset_counters()
    epochs_read(stream, 2)
    assert proxy.methods.get("GET", 0) <= 1, f"the second epoch read from the server: {proxy.log}"
