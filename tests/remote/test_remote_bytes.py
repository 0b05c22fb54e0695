"""What a shuffle window over remote token shards downloads, counted at the proxy.

Specification: with no cache, a window reading by key fetches the records it draws by ranged
requests of about those records' bytes: a gap between two drawn records is read through only where
it costs less than a request's headers. With a cache, reads by key of a shard downloading take at
most an eighth of it by ranges, and a loader's warm start leaves no schedule behind to keep shards
in the cache. Issue 48 found each of these costing multiples of the data (see each test).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from resumable_data.storage.files import _DOWNLOAD_BLOCK as DOWNLOAD_BLOCK  # the Range a download asks for
from resumable_data.storage.locks import held
from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader

TOKENS = 512  # uint16 tokens a record: 1 KiB records, a request's headers (about 1 KiB) for each
SHARDS, RECORDS = 4, 96  # records a shard: a window of 192 spans two or three shards


def test_a_window_without_a_cache_fetches_about_the_records_it_draws(s3_server: Any, proxy: Any) -> None:
    bucket = s3_server.bucket()
    for s in range(SHARDS):
        tokens = (s * 10_000 + np.arange(TOKENS * RECORDS)) % 65536
        s3_server.put(f"s3://{bucket}/tok_{s}.bin", tokens.astype(np.uint16).tobytes())
    data = 2 * TOKENS * RECORDS * SHARDS
    reader = TokenShardReader(TOKENS, storage_options=s3_server.options(proxy.endpoint))
    stream = ShardedIterable(f"s3://{bucket}/*.bin", read_shard=reader, seed=1).shuffle_window(2 * RECORDS, seed=2)
    proxy.reset_counters()
    records = [int(record[0]) for batch in StreamLoader(stream, batch_size=8) for record in batch]
    assert sorted(records) == sorted((s * 10_000 + r * TOKENS) % 65536 for s in range(SHARDS) for r in range(RECORDS))
    # Each record once, with a request's headers each at worst: under 2.5x the data (1.68x measured).
    # Before, one epoch fetched 2.96x (gaps read through, the same bytes again at every read by key).
    print(f"{proxy.bytes_down / data:.2f}x the data in {proxy.methods.get('GET', 0)} GETs")
    assert proxy.bytes_down < 2.5 * data, f"{proxy.bytes_down / data:.2f}x the data over one epoch"


def _ranged_gets(proxy: Any) -> int:
    """GETs the proxy forwarded that ask for less than a download's block: reads by key."""
    lengths = [ranges.split("=", 1)[1].split("-") for method, _, ranges in proxy.log if method == "GET" and ranges]
    return sum(1 for first, last in lengths if int(last) - int(first) + 1 < DOWNLOAD_BLOCK)


def test_reads_by_key_of_a_shard_downloading_take_at_most_an_eighth_of_it_by_ranges(
    s3_server: Any, proxy: Any, tmp_path: Path
) -> None:
    # 16-byte records: each read by key is a request of about 1 KiB of headers. Before, every read
    # while the shard downloaded (here 2 s, its bandwidth held low) went by ranges: 16 reads, 32
    # GETs; 1.8 D over three epochs of bench_remote_shapes' first shape came so.
    bucket, records = s3_server.bucket(), 4096
    url = f"s3://{bucket}/tok.bin"
    s3_server.put(url, (np.arange(8 * records) % 65536).astype(np.uint16).tobytes())
    reader = TokenShardReader(8, storage_options=s3_server.options(proxy.endpoint), cache_dir=tmp_path, prefetch=1)
    reader.identity(url)  # its size known, as once the slot's plan was looked up
    proxy.bandwidth = 32 << 10
    proxy.reset_counters()
    planner = reader.planner()
    assert planner is not None
    planner([url], reading=1)  # the shard read now: its download starts in the background
    for i in range(16):
        offsets = [200 * i, 200 * i + 100]  # two ranged requests apart (1,600 bytes between them)
        got = reader.read_records(url, offsets)
        assert [int(window[0]) for window in got] == [8 * offset for offset in offsets]
    # Each read takes 2 x (16 + ~1,024) bytes; the fourth would bring them to 1/8 of the 64 KiB shard.
    assert _ranged_gets(proxy) <= 6, f"{_ranged_gets(proxy)} ranged GETs while the shard downloaded"


def test_a_loader_with_workers_leaves_no_schedule_behind_in_the_main_process(
    s3_server: Any, proxy: Any, tmp_path: Path
) -> None:
    # The warm start makes a pass's first batch here and hands the slot to a worker. Before, this
    # process's schedule stayed live with its cursor at 0: its first shards counted as needed now all
    # pass, and with the cache below the working set the workers read theirs by ranges instead
    # (16 shards of 16-byte records, cache D/2, 2 workers: 4.6 D over three epochs in half the runs).
    bucket = s3_server.bucket()
    for s in range(4):
        s3_server.put(
            f"s3://{bucket}/tok_{s}.bin", ((s * 1000 + np.arange(8 * 500)) % 65536).astype(np.uint16).tobytes()
        )
    reader = TokenShardReader(8, storage_options=s3_server.options(proxy.endpoint), cache_dir=tmp_path)
    stream = ShardedIterable(f"s3://{bucket}/*.bin", read_shard=reader, seed=1).shuffle_window(600, seed=2)
    loader = StreamLoader(stream, batch_size=16, num_workers=2, timeout=60)  # the workers' own time limit
    assert sum(len(batch) for batch in loader) == 2000
    live = []
    for lock in (tmp_path / "plans").glob("*.lock"):
        plan = lock.with_suffix(".plan")
        if held(str(lock)) and plan.exists() and plan.read_text().partition("\n")[2]:
            live.append(plan.read_text().count("\n"))
    assert live == [], f"live schedules after the pass (their shard counts): {live}"
