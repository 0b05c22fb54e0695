"""Token shards read over ``http://`` from a real HTTP server (``rclone serve http``, see conftest.py).

Specification: shards named by http URLs (through fsspec's HTTP filesystem, aiohttp) read as the
same files read locally, uninterrupted or stopped and restored, with and without a cache; a restore
reads ranges from its cursor, not whole shards; a shard rewritten on the server since the
checkpoint is refused by name, told by its Last-Modified (the server gives no ETag) though its size
and first and last 4 KiB are unchanged; a glob is matched against the folder's index page, and a
pattern that matches nothing says so.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import json_roundtrip, resumed_run
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader, write_token_shards
from resumable_data.testing import assert_same

SHARDS, SHARD_TOKENS, WINDOW = 4, 8192, 64  # 16 KiB shards of 128 windows; a window's first token names it
RECORDS = SHARDS * SHARD_TOKENS // WINDOW


class Shards:
    """Token shards in a fresh folder the HTTP server serves: ``url`` over http, ``local`` on disk."""

    def __init__(self, server: Any, base_url: str | None = None) -> None:
        name = f"t{uuid.uuid4().hex[:12]}"
        self.local = server.root / name
        self.url = f"{base_url or server.url}{name}/"
        write_token_shards([np.arange(SHARDS * SHARD_TOKENS)], self.local, shard_tokens=SHARD_TOKENS)

    def source(self, remote: bool, cache_dir: Path | None = None, **options: Any) -> ShardedIterable:
        reader = TokenShardReader(WINDOW, cache_dir=cache_dir, **options)
        index = self.url if remote else self.local
        return ShardedIterable.from_index(index, read_shard=reader, seed=3).shuffle_window(20, seed=4)


@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "cache"])
def test_http_shards_stopped_and_restored_read_as_the_local_files(
    http_server: Any, tmp_path: Path, cached: bool
) -> None:
    shards = Shards(http_server)
    reference = list(shards.source(False))
    assert sorted(int(window[0]) for window in reference) == list(range(0, SHARDS * SHARD_TOKENS, WINDOW))
    cache = tmp_path / "cache" if cached else None
    assert_same(reference, list(shards.source(True, cache)), "uninterrupted")
    assert_same(reference, resumed_run(lambda: shards.source(True, cache), RECORDS * 2 // 3), "restored")


def test_http_shards_through_a_cache_on_two_workers_read_as_the_local_files(http_server: Any, tmp_path: Path) -> None:
    shards = Shards(http_server)

    def batches(remote: bool) -> list[Any]:
        stream = shards.source(remote, tmp_path / "cache" if remote else None)
        return list(StreamLoader(stream, batch_size=8, num_workers=2, timeout=60))

    assert_same(batches(False), batches(True), "2 workers")
    assert sorted(os.listdir(tmp_path / "cache")), "the workers read through the cache"


def test_a_restore_over_http_reads_a_range_from_its_cursor_not_the_shard(http_server: Any, http_proxy: Any) -> None:
    shards = Shards(http_server, http_proxy.endpoint + "/")
    first = shards.source(True)
    reading = iter(first)
    before = [next(reading) for _ in range(RECORDS * 9 // 10)]
    restored = shards.source(True)
    restored.load_state_dict(json_roundtrip(first.state_dict()))
    http_proxy.reset_counters()
    rest = list(restored)

    gets = [(path, byte_range) for method, path, byte_range in http_proxy.log if method == "GET"]
    assert gets, "the restore read over http"
    for path, byte_range in gets:
        assert path.endswith(".bin") and byte_range is not None, (path, byte_range)
        start, end = map(int, byte_range.removeprefix("bytes=").split("-"))
        assert start > 0 and end - start < SHARD_TOKENS * 2, f"{path}: {byte_range} is not a part from the cursor"
    assert_same(list(shards.source(False)), before + rest, "restored at 90 % of the epoch")


def test_a_shard_rewritten_on_the_http_server_is_refused_by_name(http_server: Any) -> None:
    shards = Shards(http_server)
    first = shards.source(True)
    reading = iter(first)
    for _ in range(RECORDS // 2):
        next(reading)
    state = json_roundtrip(first.state_dict())
    for path in shards.local.glob("*.bin"):
        tokens = np.fromfile(path, dtype=np.uint16)
        tokens[2048:-2048] += 1  # the same size, first and last 4 KiB: only its Last-Modified tells
        written = path.stat().st_mtime
        tokens.tofile(path)
        os.utime(path, (written + 10, written + 10))  # a later second than the checkpoint saw
    restored = shards.source(True)
    with pytest.raises(ResumeError, match=r"shard-0000\d\.bin.* changed since the checkpoint"):
        restored.load_state_dict(state)
        next(iter(restored))


def test_an_http_glob_lists_the_folders_index_page_and_an_empty_match_says_so(http_server: Any) -> None:
    shards = Shards(http_server)
    listed = ShardedIterable(f"{shards.url}*.bin", read_shard=TokenShardReader(WINDOW)).shards
    assert listed == [f"{shards.url}shard-{s:05d}.bin" for s in range(SHARDS)]
    with pytest.raises(FileNotFoundError, match=r"matches no file .*index page"):
        ShardedIterable(f"{shards.url}none/*.bin", read_shard=TokenShardReader(WINDOW))
