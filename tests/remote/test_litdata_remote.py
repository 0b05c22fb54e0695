"""A litdata dataset read from a real S3-compatible server (``s3://``), by ranged reads and through the cache.

Specification: the records read over s3:// (index.json and chunks from the server) are those read
from the local files, without a cache (ranged reads) and with one; a window shuffle over the
remote chunks stopped mid-epoch and restored yields bitwise the local run; a chunk rewritten on the
server since the checkpoint is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("zstandard", reason="the [formats] extra (zstandard) is not installed")

from harness import json_roundtrip, resumed_run
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable
from resumable_data.streams.formats import litdata_stream
from resumable_data.testing import assert_same

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "formats" / "litdata"


def upload(server: Any, name: str) -> str:
    """The fixture dataset ``name`` put in a new bucket; its URL."""
    url = f"s3://{server.bucket()}/{name}"
    for path in sorted((FIXTURES / name).iterdir()):
        server.put(f"{url}/{path.name}", path.read_bytes())
    return url


@pytest.mark.parametrize(("name", "cached"), [("items_zstd", False), ("tokens", True)])
def test_records_over_s3_are_the_local_ones_and_a_restore_matches_the_local_run(
    s3_server: Any, tmp_path: Path, name: str, cached: bool
) -> None:
    url = upload(s3_server, name)
    block = {"block_size": 16} if name.startswith("tokens") else {}
    remote = {"storage_options": s3_server.options(), "cache_dir": tmp_path / "cache" if cached else None}

    def make(where: Any, **options: Any) -> ShardedIterable:
        return litdata_stream(where, seed=4, **block, **options)

    local = list(make(FIXTURES / name).shuffle_window(10, seed=5))
    assert_same(local, list(make(url, **remote).shuffle_window(10, seed=5)), "records over s3://")
    resumed = resumed_run(lambda: make(url, **remote).shuffle_window(10, seed=5), len(local) // 2)
    assert_same(local, resumed, "resumed run over s3://")


def test_a_chunk_rewritten_on_the_server_is_refused_by_name(s3_server: Any) -> None:
    url = upload(s3_server, "items")
    first = litdata_stream(url, storage_options=s3_server.options(), seed=1)
    reading = iter(first)
    for _ in range(3):
        next(reading)
    state = json_roundtrip(first.state_dict())
    shard = first.keys_at(np.array([first.position]))[0][1]
    chunk = first.shards[shard]
    data = bytearray((FIXTURES / "items" / chunk.rsplit("/", 1)[1]).read_bytes())
    data[-1] ^= 0xFF
    s3_server.put(chunk, bytes(data))  # same size, a new ETag
    restored = litdata_stream(url, storage_options=s3_server.options(), seed=1)
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=rf"{chunk.rsplit('/', 1)[1]}.* changed since the checkpoint"):
        next(iter(restored))
