"""Token shards over ``gs://`` (gcsfs, gcp-storage-emulator) and ``az://`` (adlfs, Azurite), each
skipped where its client or emulator is not installed (the ``dev`` extra brings adlfs, and ``.ci/run``
installs Azurite from npm; gcsfs and the GCS emulator are installed by hand: see pyproject.toml).

Specification: shards written to the URL by ``write_token_shards`` read as the same tokens written
to a local folder, uninterrupted and stopped and restored, with and without a cache; a glob keeps
the URL's scheme; a shard rewritten since the checkpoint is refused by name (its ETag changed).
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


@pytest.fixture(params=[("gs", "gcs_server"), ("az", "azure_server")], ids=["gs", "az"])
def cloud(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str, dict[str, Any]]:
    """Shards at a fresh bucket's URL and the same tokens in a local folder, and the client's options."""
    scheme, server = request.param
    options = request.getfixturevalue(server).options
    bucket = f"b{uuid.uuid4().hex[:12]}"
    Remote(options).resolve(f"{scheme}://{bucket}")[0].mkdir(bucket)
    url = f"{scheme}://{bucket}/tokens/"
    for where in (url, str(tmp_path / "local")):
        write_token_shards(
            [np.arange(SHARDS * SHARD_TOKENS)], where, shard_tokens=SHARD_TOKENS, storage_options=options
        )
    return url, str(tmp_path / "local"), options


@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "cache"])
def test_cloud_shards_stopped_and_restored_read_as_the_local_files(
    cloud: tuple[str, str, dict[str, Any]], tmp_path: Path, cached: bool
) -> None:
    url, local, options = cloud
    cache = tmp_path / "cache" if cached else None
    reference = list(source(local, None))
    assert sorted(int(window[0]) for window in reference) == list(range(0, SHARDS * SHARD_TOKENS, WINDOW))
    assert_same(reference, list(source(url, options, cache)), "uninterrupted")
    assert_same(reference, resumed_run(lambda: source(url, options, cache), RECORDS // 2), "restored")
    listed = ShardedIterable(f"{url}*.bin", read_shard=TokenShardReader(WINDOW, storage_options=options)).shards
    assert listed == [f"{url}shard-{s:05d}.bin" for s in range(SHARDS)]


def test_a_shard_rewritten_in_the_cloud_is_refused_by_name(cloud: tuple[str, str, dict[str, Any]]) -> None:
    url, _, options = cloud
    first = source(url, options)
    reading = iter(first)
    for _ in range(RECORDS // 2):
        next(reading)
    state = json_roundtrip(first.state_dict())
    fs = Remote(options).resolve(url)[0]
    for s in range(SHARDS):
        fs.pipe(f"{url}shard-{s:05d}.bin", (np.arange(SHARD_TOKENS, dtype=np.uint16) + 1).tobytes())
    restored = source(url, options)
    with pytest.raises(ResumeError, match=r"shard-0000\d\.bin.* changed since the checkpoint"):
        restored.load_state_dict(state)
        next(iter(restored))
