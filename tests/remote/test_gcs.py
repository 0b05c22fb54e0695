"""Token shards read over ``gs://`` from a GCS emulator (gcsfs; skipped where it is not installed).

Specification: shards written to ``gs://`` by ``write_token_shards`` read as the same tokens written
to a local folder, uninterrupted and stopped and restored; a shard rewritten since the checkpoint
is refused by name (its ETag, here the MD5 of its bytes, changed).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import json_roundtrip, resumed_run
from resumable_data import ResumeError
from resumable_data.storage.files import Remote
from resumable_data.streams import ShardedIterable, TokenShardReader, write_token_shards
from resumable_data.testing import assert_same

SHARDS, SHARD_TOKENS, WINDOW = 3, 1024, 16
RECORDS = SHARDS * SHARD_TOKENS // WINDOW


def source(index: str, options: dict[str, Any] | None, cache_dir: Path | None = None) -> ShardedIterable:
    reader = TokenShardReader(WINDOW, storage_options=options, cache_dir=cache_dir)
    return ShardedIterable.from_index(index, read_shard=reader, storage_options=options, seed=3).shuffle_window(
        10, seed=4
    )


@pytest.fixture
def shards(gcs_server: Any, tmp_path: Path) -> tuple[str, str]:
    bucket = f"b{uuid.uuid4().hex[:12]}"
    Remote(gcs_server.options).resolve(f"gs://{bucket}")[0].mkdir(bucket)
    url = f"gs://{bucket}/tokens/"
    for where in (url, str(tmp_path / "local")):
        write_token_shards(
            [np.arange(SHARDS * SHARD_TOKENS)], where, shard_tokens=SHARD_TOKENS, storage_options=gcs_server.options
        )
    return url, str(tmp_path / "local")


@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "cache"])
def test_gs_shards_stopped_and_restored_read_as_the_local_files(
    gcs_server: Any, shards: tuple[str, str], tmp_path: Path, cached: bool
) -> None:
    url, local = shards
    cache = tmp_path / "cache" if cached else None
    reference = list(source(local, None))
    assert sorted(int(window[0]) for window in reference) == list(range(0, SHARDS * SHARD_TOKENS, WINDOW))
    assert_same(reference, list(source(url, gcs_server.options, cache)), "uninterrupted")
    assert_same(reference, resumed_run(lambda: source(url, gcs_server.options, cache), RECORDS // 2), "restored")


def test_a_shard_rewritten_on_gcs_is_refused_by_name(gcs_server: Any, shards: tuple[str, str]) -> None:
    url, _ = shards
    first = source(url, gcs_server.options)
    reading = iter(first)
    for _ in range(RECORDS // 2):
        next(reading)
    state = json_roundtrip(first.state_dict())
    fs = Remote(gcs_server.options).resolve(url)[0]
    for s in range(SHARDS):
        fs.pipe(f"{url}shard-{s:05d}.bin", (np.arange(SHARD_TOKENS, dtype=np.uint16) + 1).tobytes())
    restored = source(url, gcs_server.options)
    with pytest.raises(ResumeError, match=r"shard-0000\d\.bin.* changed since the checkpoint"):
        restored.load_state_dict(state)
        next(iter(restored))
