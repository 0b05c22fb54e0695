"""WebDataset tar shards read from a real S3-compatible server (``rclone serve s3``, see conftest.py).

Specification: every sample read over ``s3://`` (by ranged reads, or through the node-local
cache) equals what WebDataset's own reader yields from the same files on disk (but the shard's
name); a shuffle-buffer pipeline over the remote shards (named by a brace pattern), stopped
mid-epoch and restored (its buffer re-read by ranged reads), yields bitwise the local run.
"""

from __future__ import annotations

import random
import zlib
from pathlib import Path
from typing import Any

import pytest

wds = pytest.importorskip("webdataset", reason="the tests compare with webdataset (in the [dev] extra)")

import torch  # noqa: E402

from harness import resumed_run  # noqa: E402
from resumable_data.streams import Stream  # noqa: E402
from resumable_data.streams.formats import WebDatasetReader, webdataset_stream  # noqa: E402
from resumable_data.testing import assert_same  # noqa: E402

SIZES = [14, 9, 21]


def to_tensor(sample: dict[str, Any]) -> torch.Tensor:
    return torch.tensor([int(sample["id"]), zlib.crc32(sample["bin"])])


def without_location(sample: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sample.items() if k not in ("__url__", "__local_path__")}


def test_remote_webdataset_shards_read_and_resume_as_the_local_files(s3_server: Any, tmp_path: Path) -> None:
    bucket, options, rng = s3_server.bucket(), s3_server.options(), random.Random(0)
    with wds.ShardWriter(str(tmp_path / "shard-%04d.tar"), maxcount=10**9, verbose=0) as writer:
        for s, n in enumerate(SIZES):
            if s:
                writer.next_stream()
            for i in range(n):
                record = {"id": str(s * 1000 + i).encode(), "bin": rng.randbytes(rng.randrange(0, 200_000))}
                writer.write({"__key__": f"{s}/{i:05d}", **record})
    local = [str(tmp_path / f"shard-{s:04d}.tar") for s in range(len(SIZES))]
    urls = [f"s3://{bucket}/wds/shard-{s:04d}.tar" for s in range(len(SIZES))]
    for path, url in zip(local, urls, strict=True):
        s3_server.put(url, Path(path).read_bytes())

    expected = [without_location(sample) for sample in wds.WebDataset(local, shardshuffle=False)]
    for cache in (None, tmp_path / "cache"):
        reader = WebDatasetReader(storage_options=options, cache_dir=cache)
        samples = [sample for url in urls for sample in reader(url, 0)]
        assert [without_location(sample) for sample in samples] == expected
        assert samples[0]["__url__"] == urls[0] and "__local_path__" not in samples[0]
        assert reader.read_records(urls[2], [3, 4, 19]) == [samples[SIZES[0] + SIZES[1] + i] for i in (3, 4, 19)]

    def make(remote: bool) -> Stream:
        reader = WebDatasetReader(to_tensor, storage_options=options if remote else None)
        shards = f"s3://{bucket}/wds/shard-{{0000..0002}}.tar" if remote else local
        return webdataset_stream(shards, read_shard=reader, seed=3).shuffle_buffer(6, seed=4)

    assert_same(list(make(False)), resumed_run(lambda: make(True), 17), "remote webdataset samples")
