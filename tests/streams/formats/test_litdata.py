"""LitdataReader: the chunks ``litdata.optimize`` wrote, read as they are, with exact O(1) resume.

The datasets were written by the real ``litdata.optimize`` (0.2.76), and ``expected.json`` holds what
litdata's own ``StreamingDataset`` yields over them (see tests/fixtures/formats/litdata/write_litdata.py:
litdata does not install into the dev environment).

Specifications: every record equals litdata's own, items (every plain serializer, the pytree rebuilt,
the three zstd layouts) and tokens (``TokensLoader`` blocks); a pipeline over them (shuffle_window,
mix, StreamLoader with 0 and 2 workers) stopped and restored yields bitwise the uninterrupted run,
each record once per epoch, and across a change of world size; a truncated or rewritten chunk is
refused by name; a malformed index is an error naming the field; pickle is refused by default.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("zstandard", reason="the [formats] extra (zstandard) is not installed")

from harness import assert_resumes_identically, json_roundtrip
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, Stream, StreamLoader, mix
from resumable_data.streams.formats import LitdataReader, litdata_stream
from streams_harness import assert_exactly_once_across_layout_change

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "formats" / "litdata"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
BLOCK = EXPECTED["block_size"]
# Importable by name: litdata.optimize's workers unpickle its functions (the live test).
sys.path.insert(0, str(FIXTURES))
import write_litdata  # noqa: E402

ITEMS = ["items", "pairs", "items_zstd", "items_zstd_chunk", "items_zstd_sample"]
TOKENS = ["tokens", "tokens_numpy", "tokens_zstd"]


def stream(name: str, **kwargs: Any) -> ShardedIterable:
    block = {"block_size": BLOCK} if name.startswith("tokens") else {}
    return litdata_stream(FIXTURES / name, **block, **kwargs)


def assert_as_litdata_reads(name: str, records: list[Any]) -> None:
    expected = EXPECTED[name]
    assert write_litdata.canonical(records[0]) == expected["first"]
    digests = [write_litdata.digest(record) for record in records]
    differ = [i for i, (a, b) in enumerate(zip(digests, expected["digests"], strict=False)) if a != b]
    assert len(records) == len(expected["digests"]) and not differ, (
        f"{len(records)} records, litdata {len(expected['digests'])}; first difference at {differ[:1]}: "
        f"{write_litdata.canonical(records[differ[0]]) if differ else None}"
    )


# -- every record as litdata's own reader yields it -----------------------------------------------
@pytest.mark.parametrize("name", ITEMS + TOKENS)
def test_every_record_equals_what_litdata_yields(name: str) -> None:
    assert_as_litdata_reads(name, list(stream(name, shuffle=False)))


@pytest.mark.parametrize("name", ["items_zstd", "tokens"])
def test_a_dataset_litdata_writes_here_reads_as_litdata_reads_it(tmp_path: Path, name: str) -> None:
    """Live where litdata installs (the peers' environment), against the installed version."""
    pytest.importorskip("litdata", reason="litdata is not installed here: the committed fixtures stand for it")
    records = write_litdata.write(name, tmp_path / name)
    block = {"block_size": BLOCK} if name.startswith("tokens") else {}
    assert_same_records(list(litdata_stream(tmp_path / name, shuffle=False, **block)), records)


def test_rows_litdata_keeps_in_an_arrow_footer_are_read_from_it() -> None:
    pytest.importorskip("pyarrow", reason="Arrow-footer chunks need pyarrow (the [parquet] extra)")
    for chunk in sorted((FIXTURES / "rows_arrow").glob("*.bin")):  # a header and a footer, no item bytes
        data = chunk.read_bytes()
        offsets = np.frombuffer(data, dtype="<u4", count=int.from_bytes(data[:4], "little") + 1, offset=4)
        assert len(set(offsets.tolist())) == 1 and data.endswith(b"LDARW01\0")
    assert_as_litdata_reads("rows_arrow", list(stream("rows_arrow", shuffle=False)))
    reader = LitdataReader(FIXTURES / "rows_arrow")
    shard = reader.shards[0]
    whole = list(reader(shard, 0))
    assert_same_records(reader.read_records(shard, [1, 7, 14]), [whole[i] for i in (1, 7, 14)])


def test_sizes_come_from_the_index_and_a_seek_reads_the_same_records(tmp_path: Path) -> None:
    reader = LitdataReader(FIXTURES / "items_zstd")  # framed zstd: a seek lands inside a frame
    index = json.loads((FIXTURES / "items_zstd" / "index.json").read_text())
    assert [reader.num_records(shard) for shard in reader.shards] == [c["chunk_size"] for c in index["chunks"]]
    shard = reader.shards[1]
    whole = list(reader(shard, 0))
    assert_same_records(list(reader(shard, 5)), whole[5:])
    assert_same_records(reader.read_records(shard, [0, 3, 4, 9, 12]), [whole[i] for i in (0, 3, 4, 9, 12)])
    tokens = LitdataReader(FIXTURES / "tokens", block_size=BLOCK)
    index = json.loads((FIXTURES / "tokens" / "index.json").read_text())
    assert [tokens.num_records(shard) for shard in tokens.shards] == [c["dim"] // BLOCK for c in index["chunks"]]


def assert_same_records(actual: list[Any], expected: list[Any]) -> None:
    assert [write_litdata.canonical(r) for r in actual] == [write_litdata.canonical(r) for r in expected]


@pytest.mark.parametrize("name", ["items", "tokens"])
def test_a_reader_pickles_for_spawned_workers_and_reads_the_same(name: str) -> None:
    reader = LitdataReader(FIXTURES / name, **({"block_size": BLOCK} if name == "tokens" else {}))
    copy = pickle.loads(pickle.dumps(reader))
    assert_same_records(list(copy(copy.shards[1], 2)), list(reader(reader.shards[1], 2)))


def test_pickle_is_refused_by_default_and_read_only_when_allowed() -> None:
    with pytest.raises(ResumeError, match=r"field 'obj' is stored with pickle.*allow_pickle=True"):
        litdata_stream(FIXTURES / "pickled")
    records = list(litdata_stream(FIXTURES / "pickled", allow_pickle=True, shuffle=False))
    assert_as_litdata_reads("pickled", [{"id": r["id"], "obj": sorted(r["obj"])} for r in records])
    seen = []
    hooked = litdata_stream(FIXTURES / "pickled", decode=lambda fmt, data: seen.append(fmt) or len(data), shuffle=False)
    assert [r["id"] for r in hooked] == [r["id"] for r in records] and set(seen) == {"pickle"}


def test_block_size_is_required_for_tokens_and_refused_for_items() -> None:
    with pytest.raises(ValueError, match="TokensLoader chunks: pass block_size="):
        LitdataReader(FIXTURES / "tokens")
    with pytest.raises(ValueError, match=r"holds items .* block_size=4 does not apply"):
        LitdataReader(FIXTURES / "items", block_size=4)


# -- a pipeline over them resumes exactly ---------------------------------------------------------
def key(record: Any) -> tuple[str, int]:
    """What names a record: an item's id, a token block's first token (every token is unique)."""
    if isinstance(record, dict):
        return ("item", record["id"])
    if isinstance(record, tuple):
        return ("pair", record[0])
    return ("tokens", int(record[0]))


def pipeline() -> Stream:
    sources = [stream("items_zstd", seed=1), stream("tokens", seed=2), stream("pairs", seed=3)]
    return mix([s.shuffle_window(16, seed=4 + i) for i, s in enumerate(sources)], weights=[2, 3, 1], seed=7)


def every_record() -> Counter[tuple[str, int]]:
    names = ["items_zstd", "tokens", "pairs"]
    return Counter(key(r) for name in names for r in stream(name, shuffle=False))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mixed_window_shuffle_resumes_bitwise_with_each_record_once_per_epoch(workers: int) -> None:
    def make() -> StreamLoader:
        options = {"num_workers": workers, "timeout": 60} if workers else {}
        return StreamLoader(pipeline(), batch_size=5, collate_fn=list, **options)

    first = list(make())
    # mix runs until its longest source ends (stopping strategy "all_exhausted" re-reads the shorter ones).
    epoch = Counter(key(r) for batch in first for r in batch)
    assert set(epoch) == set(every_record())
    n = len(first)
    cuts = [0, 3, n // 2, n // 2, n - 1, n + 2] if workers else [0, 3, n // 2, n - 1, n + 2]
    assert_resumes_identically(make, cuts, total=n + 6)


def test_each_token_block_once_per_epoch_and_across_a_change_of_world_size() -> None:
    def make() -> Stream:
        return stream("tokens", seed=5).shuffle_window(20, seed=6)

    every = [int(r[0]) for r in stream("tokens", shuffle=False)]
    assert sorted(int(r[0]) for r in make()) == sorted(every)
    assert_exactly_once_across_layout_change(make, every, (2, 0), (3, 0), [2, 4])


# -- damaged data is refused by name --------------------------------------------------------------
@pytest.fixture
def copy(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURES / "items", tmp_path / "items")
    return tmp_path / "items"


def test_a_truncated_chunk_is_refused_by_name(copy: Path) -> None:
    chunk = copy / "chunk-0-1.bin"
    chunk.write_bytes(chunk.read_bytes()[:-3])
    reader = LitdataReader(copy)
    with pytest.raises(ResumeError, match=r"chunk-0-1\.bin' holds \d+ bytes but index.json gives chunk_bytes=\d+"):
        list(ShardedIterable(reader.shards, read_shard=reader, shuffle=False))


def test_an_item_whose_bytes_were_damaged_is_refused_by_chunk(copy: Path) -> None:
    chunk = copy / "chunk-0-2.bin"
    data = bytearray(chunk.read_bytes())
    first = int.from_bytes(data[4:8], "little")  # where item 0 starts: its leaves' sizes
    data[first : first + 4] = b"\xff\xff\xff\x7f"  # same size, a leaf size past the item's end
    chunk.write_bytes(bytes(data))
    with pytest.raises(ResumeError, match=r"chunk-0-2\.bin' holds an item that does not decode"):
        list(litdata_stream(copy, shuffle=False))


def test_a_tokens_chunk_whose_first_offset_was_overwritten_is_refused_by_name(tmp_path: Path) -> None:
    # The same size, every offset ascending: only the first one tells, which litdata's writer puts
    # right after the table. Tokens have no item lengths to check them (the blocks came shifted).
    folder = Path(shutil.copytree(FIXTURES / "tokens", tmp_path / "tokens"))
    chunk = sorted(folder.glob("chunk-*.bin"))[0]
    data = bytearray(chunk.read_bytes())
    data[4:8] = (int.from_bytes(data[4:8], "little") - 2).to_bytes(4, "little")
    chunk.write_bytes(bytes(data))
    message = (
        rf"{chunk.name}' has a damaged header .*: its first offset is \d+, not the end of its offset table \(\d+\)"
    )
    with pytest.raises(ResumeError, match=message):
        list(litdata_stream(folder, shuffle=False, block_size=BLOCK))


def test_a_chunk_rewritten_since_the_checkpoint_is_refused_by_name(copy: Path) -> None:
    def make() -> ShardedIterable:
        return litdata_stream(copy, seed=3)

    first = make()
    reading = iter(first)
    for _ in range(5):
        next(reading)
    state = json_roundtrip(first.state_dict())
    shard = first.keys_at(np.array([first.position]))[0][1]
    path = Path(first.shards[shard])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: a rewrite
    path.write_bytes(bytes(data))
    restored = make()
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=rf"{path.name}.* changed since the checkpoint"):
        next(iter(restored))


def mutate(index: dict[str, Any], where: str, value: Any) -> None:
    *path, last = where.split(".")
    target: Any = index
    for part in path:
        target = target[int(part)] if part.isdigit() else target[part]
    if value is DELETE:
        del target[last]
    else:
        target[int(last) if last.isdigit() else last] = value


DELETE = object()


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("chunks", DELETE, r"'chunks' should be a list of chunk entries, but got None"),
        ("config", [], r"'config' should be a JSON object"),
        ("chunks.0.chunk_size", "7", r"chunks\[0\]\.chunk_size should be an integer >= 0, but got '7'"),
        ("chunks.1.chunk_bytes", -1, r"chunks\[1\]\.chunk_bytes should be an integer >= 0"),
        ("chunks.0.filename", "../x.bin", r"chunks\[0\]\.filename should be a file name in the dataset's folder"),
        ("config.data_format", "int", r"config\.data_format should be a non-empty list of serializer names"),
        ("config.item_loader", "ParquetLoader", r"config\.item_loader is 'ParquetLoader'; this reader reads"),
        ("config.encryption", {"level": "chunk"}, r"encrypted \(config\.encryption\)"),
        ("config.compression", "lz4", r"config\.compression should be null, 'zstd' or 'zstd:N', but got 'lz4'"),
        ("config.data_spec", "[1, {]", r"config\.data_spec is not litdata's treespec JSON"),
    ],
)
def test_a_malformed_index_names_the_field_and_what_was_expected(
    copy: Path, where: str, value: Any, message: str
) -> None:
    index = json.loads((copy / "index.json").read_text())
    mutate(index, where, value)
    (copy / "index.json").write_text(json.dumps(index))
    with pytest.raises(ResumeError, match=message):
        litdata_stream(copy)


def test_building_a_stream_opens_no_chunk(copy: Path) -> None:
    index = json.loads((copy / "index.json").read_text())
    for chunk in copy.glob("*.bin"):
        chunk.unlink()  # only index.json is left: the sizes must come from it
    assert litdata_stream(copy, shuffle=False).sizes == [c["chunk_size"] for c in index["chunks"]]


def test_a_missing_index_or_chunk_is_named(copy: Path) -> None:
    with pytest.raises(ResumeError, match=r"litdata index '.*nowhere/index.json' is missing"):
        litdata_stream(copy.parent / "nowhere")
    reader = LitdataReader(copy)
    gone = Path(reader.shards[-1])
    gone.unlink()
    with pytest.raises(ResumeError, match=rf"{gone.name}' is missing"):
        list(ShardedIterable(reader.shards, read_shard=reader, shuffle=False))
    with pytest.raises(ResumeError, match=r"other\.bin' is not a chunk of the litdata dataset"):
        reader.num_records(copy / "other.bin")


@pytest.mark.slow
@pytest.mark.parametrize("name", ITEMS + TOKENS)
def test_every_dataset_resumes_bitwise_through_two_workers(name: str) -> None:
    def make() -> StreamLoader:
        source = stream(name, seed=11).shuffle_window(12, seed=12)
        return StreamLoader(source, batch_size=3, collate_fn=list, num_workers=2, timeout=60)

    n = len(list(make()))
    assert_resumes_identically(make, [1, n // 3, n // 3, n - 1], total=n + 3)
