"""MDS shards (Mosaic Streaming's format) read from a real S3-compatible server with MDSReader.

Specification: the dataset's samples read over ``s3://`` (uncompressed shards by ranged requests,
zstd ones fetched whole, or either through the node-local cache) equal those of the same files
read locally; a shuffled pipeline over the cache, stopped and restored in 2 workers, equals the
uninterrupted local run; a shard rewritten on the server since the checkpoint is refused by name.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import json_roundtrip, resumed_run
from resumable_data import ResumeError
from resumable_data.streams import StreamLoader
from resumable_data.streams.formats import MDSReader, mds_stream
from resumable_data.testing import assert_same

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "formats"
sys.path.insert(0, str(FIXTURES / "mds"))  # the script that wrote the fixtures, next to them
from make_mds import encode  # noqa: E402


def upload(server: Any, name: str) -> str:
    """The fixture dataset ``name`` in a new bucket; its URL."""
    url = f"s3://{server.bucket()}/{name}"
    for path in sorted((FIXTURES / "mds" / name).iterdir()):
        server.put(f"{url}/{path.name}", path.read_bytes())
    return url


@pytest.mark.parametrize(
    ("name", "cached"),
    [
        ("plain", False),
        ("zstd", True),
        pytest.param("plain", True, marks=pytest.mark.slow),
        pytest.param("zstd", False, marks=pytest.mark.slow),
    ],
    ids=["plain-ranged", "zstd-cached", "plain-cached", "zstd-fetched"],
)
def test_an_mds_dataset_over_s3_reads_as_its_local_files(
    s3_server: Any, tmp_path: Path, name: str, cached: bool
) -> None:
    url = upload(s3_server, name)
    cache = {"cache_dir": tmp_path / "cache"} if cached else {}
    reader = MDSReader(storage_options=s3_server.options(), **cache)
    remote, local = mds_stream(url, read_shard=reader, seed=1), mds_stream(FIXTURES / "mds" / name, seed=1)
    assert remote.sizes == local.sizes
    assert [encode(r) for r in remote.shuffle_window(10, seed=2)] == [
        encode(r) for r in local.shuffle_window(10, seed=2)
    ]


def as_tensor(record: dict[str, Any]) -> torch.Tensor:
    return torch.tensor([record["id"], int(record["tokens"].sum() * 1000)], dtype=torch.int64)


def test_a_cached_loader_in_two_workers_resumes_as_the_local_run(s3_server: Any, tmp_path: Path) -> None:
    url = upload(s3_server, "zstd")

    def loader(location: Any, **options: Any) -> StreamLoader:
        reader = MDSReader(["id", "tokens"], **options)
        stream = mds_stream(location, read_shard=reader, seed=3).shuffle_window(16, seed=4).map(as_tensor)
        return StreamLoader(stream, batch_size=4, num_workers=2, timeout=60)

    reference = list(loader(FIXTURES / "mds" / "zstd"))
    remote = {"storage_options": s3_server.options(), "cache_dir": tmp_path / "cache", "prefetch": 1}
    assert_same(reference, resumed_run(lambda: loader(url, **remote), len(reference) // 2), "cached resumed run")


def test_a_shard_rewritten_on_the_server_is_refused_by_name(s3_server: Any, tmp_path: Path) -> None:
    url = upload(s3_server, "plain")

    def stream() -> Any:
        return mds_stream(url, read_shard=MDSReader(storage_options=s3_server.options()), shuffle=False)

    first = stream()
    items = iter(first)
    next(items)
    state = json_roundtrip(first.state_dict())
    shard = FIXTURES / "mds" / "plain" / "shard.00000.mds"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    s3_server.put(f"{url}/shard.00000.mds", bytes(data))  # same size, new ETag
    restored = stream()
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=r"shard 0 '.*shard\.00000\.mds' .* changed since the checkpoint"):
        next(iter(restored))


@pytest.mark.parametrize("damage", ["decreasing", "shifted"])
def test_a_damaged_offset_table_read_by_ranges_is_refused_by_name(s3_server: Any, damage: str) -> None:
    # Read by ranges, a restore reads only the table entries it needs: those are checked, and each
    # sample's length against its columns'; a damage before them leaves them right.
    url = upload(s3_server, "plain")
    shard = FIXTURES / "mds" / "plain" / "shard.00000.mds"
    data = bytearray(shard.read_bytes())
    offsets = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "little") for i in range(3)]
    value = offsets[1] - 5 if damage == "decreasing" else offsets[2] + 3
    data[12:16] = value.to_bytes(4, "little")  # where sample 2 starts
    s3_server.put(f"{url}/shard.00000.mds", bytes(data))  # the same size: no cache, no hashes checked
    reader = MDSReader(storage_options=s3_server.options())
    named = rf"MDS shard '{url}/shard\.00000\.mds' is damaged: .*sample (2 starts at byte \d+, before|1 is \d+ bytes)"
    for read in (lambda: list(reader(f"{url}/shard.00000.mds", 0)), lambda: list(reader(f"{url}/shard.00000.mds", 1))):
        with pytest.raises(ResumeError, match=named):
            read()
    with pytest.raises(ResumeError, match=named):
        reader.read_records(f"{url}/shard.00000.mds", [1])
    intact = [encode(r) for r in MDSReader()(shard, 3)]
    assert [encode(r) for r in reader(f"{url}/shard.00000.mds", 3)] == intact  # entries 3 on are right
