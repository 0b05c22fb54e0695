"""MDSReader: Mosaic Streaming's MDS shards read as its MDSWriter wrote them, with an O(1) seek.

Specifications: every sample of the committed fixtures (written by Mosaic's own MDSWriter, see
tests/fixtures/formats/mds/make_mds.py) equals, in value, type and bits, what Mosaic's own reader
yields, plain and zstd-compressed, and a multi-stream root; a read from sample ``k`` reads no sample
before it; the sizes come from index.json alone; a pipeline over the shards (shuffle_window, mix,
StreamLoader with 0 and 2 workers) stopped and restored equals the uninterrupted run bitwise and
reads each sample once per epoch, also across a change of layout; a truncated or rewritten shard is
refused by name; a malformed index is an error naming the field; ``pkl`` is refused unless allowed,
an image encoding unless a ``decode`` hook is given. Where ``streaming`` imports (the peers
environment), a dataset written live by MDSWriter is read by both and compared.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_resumes_identically, json_roundtrip
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, Stream, StreamLoader, mix
from resumable_data.streams.formats import MDSReader, mds_stream
from streams_harness import assert_exactly_once_across_layout_change, ids

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "formats"
MDS = FIXTURES / "mds"
sys.path.insert(0, str(MDS))  # the script that wrote the fixtures, next to them
from make_mds import encode  # noqa: E402

EXPECTED = json.loads((MDS / "expected.json").read_text())
PLAIN_IDS = [json.loads(s["dict"]["id"]["int"]) for s in EXPECTED["plain"]]
MULTI_IDS = [json.loads(s["dict"]["id"]["int"]) for s in EXPECTED["multi/part0"] + EXPECTED["multi/part1"]]


def encoded(records: Any) -> list[Any]:
    return [encode(record) for record in records]


def shard_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.startswith("shard."))


@pytest.fixture()
def plain(tmp_path: Path) -> Path:
    """A copy of the plain dataset that a test may damage."""
    return Path(shutil.copytree(MDS / "plain", tmp_path / "plain"))


# -- what is read --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["plain", "zstd"])
def test_every_sample_is_what_mosaics_own_reader_yields(name: str) -> None:
    stream = mds_stream(MDS / name, shuffle=False)
    assert stream.sizes == [shard["samples"] for shard in _index(MDS / name)["shards"]]
    assert encoded(stream) == EXPECTED["plain"]


def test_a_multi_stream_root_reads_its_subfolders_in_order() -> None:
    stream = mds_stream(MDS / "multi", shuffle=False)
    assert [Path(s).parent.name for s in stream.shards][:1] == ["part0"]
    assert encoded(stream) == EXPECTED["multi/part0"] + EXPECTED["multi/part1"]


def test_read_from_any_sample_and_by_offsets_gives_those_samples() -> None:
    reader = MDSReader()
    first = 0
    for shard in MDSReader().shards(MDS / "zstd") + MDSReader().shards(MDS / "plain"):
        n = reader.num_records(shard)
        for start in (0, n // 2, n):
            assert encoded(reader(shard, start)) == EXPECTED["plain"][first + start : first + n]
        assert encoded(reader.read_records(shard, [0, n - 1])) == [
            EXPECTED["plain"][first],
            EXPECTED["plain"][first + n - 1],
        ]
        first = (first + n) % 48


def test_a_read_from_sample_k_reads_no_sample_before_it(plain: Path) -> None:
    shard = shard_files(plain)[0]
    reader = MDSReader()
    n = reader.num_records(shard)
    data = bytearray(shard.read_bytes())
    offsets = np.frombuffer(bytes(data[4 : 4 * (n + 2)]), "<u4")
    k = n - 2
    data[offsets[0] : offsets[k]] = b"\xff" * int(offsets[k] - offsets[0])  # every sample before k ruined
    shard.write_bytes(bytes(data))
    assert encoded(MDSReader()(shard, k)) == EXPECTED["plain"][k:n]
    with pytest.raises(ResumeError, match=rf"'.*{shard.name}' is damaged: sample 0 is \d+ bytes long but its columns"):
        encoded(MDSReader()(shard, 0))  # its column lengths read as 0xffffffff: longer than the sample


def test_sizes_come_from_the_index_without_opening_a_shard(plain: Path) -> None:
    for shard in shard_files(plain):
        shard.unlink()
    stream = mds_stream(plain, seed=0)
    assert sum(stream.sizes) == 48 and len(stream.sizes) == len(
        json.loads((plain / "index.json").read_text())["shards"]
    )
    with pytest.raises(ResumeError, match=r"MDS shard '.*shard\.0000\d\.mds' is missing"):
        next(iter(stream))


def test_only_the_columns_asked_are_decoded() -> None:
    records = list(mds_stream(MDS / "plain", read_shard=MDSReader(["id", "text"]), shuffle=False))
    assert records[3] == {"id": 3 * 1_000_003 - 2**40, "text": "sample 3 ééé"}
    with pytest.raises(ResumeError, match=r"lacks the column\(s\) \['label'\]; its columns are \['blob', 'f16'"):
        mds_stream(MDS / "plain", read_shard=MDSReader(["label"]))
    with pytest.raises(TypeError, match=r"pass \['id'\]"):
        MDSReader("id")


# -- what is refused -----------------------------------------------------------------------------
def test_pickle_is_refused_unless_allowed() -> None:
    with pytest.raises(ResumeError, match=r"column 'obj' of MDS shard .* is pickled \('pkl'\).*allow_pickle=True"):
        mds_stream(MDS / "pickled")
    with pytest.raises(ResumeError, match=r"'obj' .* pickled"):
        next(MDSReader()(MDS / "pickled" / "shard.00000.mds", 0))
    allowed = mds_stream(MDS / "pickled", read_shard=MDSReader(allow_pickle=True), shuffle=False)
    assert encoded(allowed) == EXPECTED["pickled"]
    assert [r["id"] for r in mds_stream(MDS / "pickled", read_shard=MDSReader(["id"]), shuffle=False)] == [0, 1, 2, 3]


def test_an_image_column_needs_a_decode_hook() -> None:
    with pytest.raises(ResumeError, match=r"column 'img' .* has the encoding 'png', which MDSReader does not decode"):
        mds_stream(MDS / "image")
    image = pytest.importorskip("PIL.Image")
    import io

    reader = MDSReader(decode={"png": lambda data: image.open(io.BytesIO(data))})
    assert encoded(mds_stream(MDS / "image", read_shard=reader, shuffle=False)) == EXPECTED["image"]
    raw = MDSReader(decode={"img": bytes})  # by column name: kept encoded
    assert next(iter(mds_stream(MDS / "image", read_shard=raw, shuffle=False)))["img"][:4] == b"\x89PNG"


def _index(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "index.json").read_text())


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda index: "{not json", r"index.json' is not valid JSON"),
        (lambda index: {**index, "version": 3}, r"'version' is 3; MDSReader reads Mosaic Streaming's version 2"),
        (lambda index: {"version": 2}, r"index.json' has no 'shards': expected the list of shards"),
        (
            lambda index: {**index, "shards": [{**index["shards"][0], "samples": "5"}]},
            r"shards\[0\]: 'samples' should be the shard's sample count \(an integer >= 0\), but got '5'",
        ),
        (
            lambda index: {**index, "shards": [{**index["shards"][0], "column_sizes": [None]}]},
            r"shards\[0\]: column_names, column_encodings and column_sizes should have one entry per column, but "
            r"have 21, 21 and 1",
        ),
        (
            lambda index: {**index, "shards": [{**index["shards"][0], "raw_data": None}]},
            r"shards\[0\].raw_data should be an object with basename, bytes and hashes, but got None",
        ),
        (
            lambda index: {**index, "shards": [{**index["shards"][0], "format": "json"}]},
            r"shards\[0\]: 'format' is 'json'; MDSReader reads Mosaic's 'mds' shards only",
        ),
    ],
    ids=["not-json", "version", "no-shards", "samples", "columns", "raw-data", "format"],
)
def test_a_malformed_index_is_an_error_naming_the_field(plain: Path, damage: Any, message: str) -> None:
    broken = damage(_index(plain))
    (plain / "index.json").write_text(broken if isinstance(broken, str) else json.dumps(broken))
    with pytest.raises(ResumeError, match=message):
        mds_stream(plain)


def test_no_index_is_an_error_saying_what_was_expected(tmp_path: Path) -> None:
    with pytest.raises(ResumeError, match=r"no index.json at .* nor in the folders under it: expected the folder"):
        mds_stream(tmp_path)


def test_a_truncated_shard_is_refused_by_name(plain: Path) -> None:
    shard = shard_files(plain)[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    named = rf"MDS shard '.*{shard.name}' holds \d+ bytes but index.json says \d+: truncated or rewritten"
    with pytest.raises(ResumeError, match=named):
        MDSReader().identity(shard)
    with pytest.raises(ResumeError, match=named):
        list(MDSReader()(shard, 0))


def test_an_index_that_no_longer_fits_its_shard_is_refused_by_name(plain: Path) -> None:
    index = _index(plain)
    index["shards"][0]["samples"] += 1  # as if the index were written for another version of the shard
    (plain / "index.json").write_text(json.dumps(index))
    shard = plain / index["shards"][0]["raw_data"]["basename"]
    with pytest.raises(ResumeError, match=rf"MDS shard '.*{shard.name}' holds \d+ samples but index.json says"):
        list(MDSReader()(shard, 0))


def _after(stream: ShardedIterable, n: int) -> dict[str, Any]:
    items = iter(stream)
    for _ in range(n):
        next(items)
    return json_roundtrip(stream.state_dict())


def test_a_shard_rewritten_since_the_checkpoint_is_refused_by_name(plain: Path) -> None:
    state = _after(mds_stream(plain, shuffle=False), 2)
    shard = shard_files(plain)[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # same size: only the identity (and the index's hashes) can tell
    shard.write_bytes(bytes(data))
    restored = mds_stream(plain, shuffle=False)
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=rf"shard 0 '.*{shard.name}' .* changed since the checkpoint"):
        next(iter(restored))
    with pytest.raises(ResumeError, match=rf"MDS shard '.*{shard.name}': its sha1 is [0-9a-f]+ but index.json says"):
        list(MDSReader(verify_hashes=True)(shard, 0))
    assert len(list(MDSReader(verify_hashes=True)(shard_files(plain)[1], 0))) > 0  # an intact one passes


def test_a_zstd_shard_cut_short_is_refused_by_name(tmp_path: Path) -> None:
    folder = Path(shutil.copytree(MDS / "zstd", tmp_path / "zstd"))
    shard = shard_files(folder)[0]
    shard.write_bytes(shard.read_bytes()[:-5])
    with pytest.raises(ResumeError, match=rf"MDS shard '.*{shard.name}' holds \d+ bytes but index.json says"):
        list(MDSReader()(shard, 0))


# -- a damaged offset table ----------------------------------------------------------------------
def _table(shard: Path) -> tuple[bytearray, int, list[int]]:
    """The shard's bytes, its sample count and its offset table (``count + 1`` uint32 after the count)."""
    data = bytearray(shard.read_bytes())
    count = int.from_bytes(data[:4], "little")
    return data, count, np.frombuffer(bytes(data[4 : 4 * (count + 2)]), "<u4").tolist()


def _first_sample(folder: Path, shard: Path) -> int:
    """Where the shard's samples start in the dataset's index order (``EXPECTED``'s)."""
    shards = _index(folder)["shards"]
    names = [entry["raw_data"]["basename"] for entry in shards]
    return sum(entry["samples"] for entry in shards[: names.index(shard.name)])


@pytest.mark.parametrize(
    ("entry", "value", "message"),
    [
        (2, lambda offsets, size: offsets[1] - 5, r"sample 2 starts at byte \d+, before sample 1 \(at \d+\)"),
        (3, lambda offsets, size: size + 100, r"sample 3 starts at byte \d+, past the end of the file \(\d+ bytes\)"),
        (0, lambda offsets, size: 0, r"sample 0 starts at byte 0, inside the offset table \(bytes 0 to \d+\)"),
        (0, lambda offsets, size: offsets[0] - 40, r"the column config before the samples \(bytes \d+ to \d+\) is not"),
        (2, lambda offsets, size: offsets[2] + 3, r"sample 1 is \d+ bytes long but its columns take \d+"),
        (2, lambda offsets, size: offsets[3], r"sample 2 is empty \(it starts and ends at byte \d+\)"),
    ],
    ids=["decreasing", "past-the-end", "inside-the-table", "inside-the-config", "shifted", "empty-sample"],
)
def test_a_damaged_offset_table_is_refused_naming_the_shard(plain: Path, entry: int, value: Any, message: str) -> None:
    # The writer's default: no hashes checked, so only the table's own structure can tell (the file
    # keeps its size, so its identity holds only if the damage missed its first and last 4 KiB).
    shard = shard_files(plain)[0]
    data, count, offsets = _table(shard)
    data[4 + 4 * entry : 8 + 4 * entry] = int(value(offsets, len(data))).to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    named = rf"MDS shard '.*{shard.name}' is damaged: .*{message}"
    with pytest.raises(ResumeError, match=named):
        list(MDSReader()(shard, 0))
    with pytest.raises(ResumeError, match=rf"MDS shard '.*{shard.name}' is damaged"):
        MDSReader().read_records(shard, list(range(count)))


@settings(max_examples=80)
@given(data=st.data())
def test_any_damage_to_an_offset_table_gives_the_samples_or_an_error_naming_the_shard(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)  # the index and the one shard damaged
        shutil.copy(MDS / "plain" / "index.json", folder)
        shard = Path(shutil.copy(data.draw(st.sampled_from(shard_files(MDS / "plain"))), folder))
        content, count, _ = _table(shard)
        table = 4 * (count + 2)  # the count and the offsets
        for at, new in data.draw(st.lists(st.tuples(st.integers(0, table - 1), st.binary(min_size=1, max_size=8)))):
            new = new[: table - at]
            content[at : at + len(new)] = new
        shard.write_bytes(bytes(content))
        first = _first_sample(folder, shard)
        start = data.draw(st.integers(0, count))
        picked = sorted(data.draw(st.sets(st.integers(0, count - 1), max_size=4)))
        for read, expected in (
            (lambda: MDSReader()(shard, start), EXPECTED["plain"][first + start : first + count]),
            (lambda: MDSReader().read_records(shard, picked), [EXPECTED["plain"][first + i] for i in picked]),
        ):
            try:
                samples = encoded(read())
            except ResumeError as exc:
                assert f"MDS shard '{shard}'" in str(exc)
            else:
                assert samples == expected


# -- pipelines -----------------------------------------------------------------------------------
def as_tensor(record: dict[str, Any]) -> torch.Tensor:
    """The sample's id and a checksum of its token bytes: a wrong sample or a wrong byte shows."""
    tokens = record.get("tokens")
    check = 0 if tokens is None else zlib.crc32(tokens.tobytes())
    return torch.tensor([record["id"], check], dtype=torch.int64)


def pipeline(seed: int = 0) -> Stream:
    plain = mds_stream(MDS / "zstd", read_shard=MDSReader(["id", "tokens"]), seed=seed).shuffle_window(
        16, seed=seed + 1
    )
    multi = mds_stream(MDS / "multi", read_shard=MDSReader(["id"]), seed=seed + 2)
    return mix([plain, multi], weights=[3, 1], seed=seed + 3).map(as_tensor)


def test_a_shuffled_mixed_pipeline_resumes_identically() -> None:
    assert_resumes_identically(pipeline, [0, 7, 7, 30, 51, 60, 81], epochs=2)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_loader_resumes_identically_and_reads_each_sample_once(workers: int) -> None:
    def make() -> StreamLoader:
        source = mds_stream(MDS / "plain", read_shard=MDSReader(["id", "tokens"]), seed=4).shuffle_window(20, seed=5)
        extra = {"num_workers": workers, "timeout": 60} if workers else {}
        return StreamLoader(source.map(as_tensor), batch_size=5, **extra)

    epoch = list(make())
    assert sorted(int(batch[i, 0]) for batch in epoch for i in range(len(batch))) == sorted(PLAIN_IDS)
    assert_resumes_identically(make, [3, len(epoch) - 1], total=len(epoch) + 4)


def sample_id(record: dict[str, Any]) -> int:
    return record["id"]


def id_stream() -> Stream:
    return mds_stream(MDS / "plain", read_shard=MDSReader(["id"]), seed=6).shuffle_window(12, seed=7).map(sample_id)


def test_each_sample_once_across_a_change_of_world_size() -> None:
    assert_exactly_once_across_layout_change(id_stream, PLAIN_IDS, (2, 0), (3, 0), [2, 3])


@pytest.mark.slow
@pytest.mark.parametrize(("old", "new"), [((3, 0), (1, 2)), ((1, 2), (2, 0))])
def test_each_sample_once_across_a_change_of_world_size_and_workers(old: Any, new: Any) -> None:
    assert_exactly_once_across_layout_change(id_stream, PLAIN_IDS, old, new, [2, 3, 1][: old[0]])


def test_a_shuffle_buffer_restores_by_reading_records_by_offset() -> None:
    def make() -> Stream:
        return mds_stream(MDS / "zstd", read_shard=MDSReader(["id"]), seed=8).shuffle_buffer(10, seed=9).map(sample_id)

    assert_resumes_identically(make, [0, 5, 23, 47, 50], epochs=2)
    assert sorted(ids(list(make()))) == sorted(PLAIN_IDS)


# -- against Mosaic live (the peers environment) -------------------------------------------------
def _mosaic() -> Any:
    """Mosaic's ``streaming``, or a visible skip where it does not import (the dev environment)."""
    if importlib.util.find_spec("streaming") is None:
        pytest.skip("mosaicml-streaming is not installed here (it pins numpy < 2.2); see make_mds.py")
    sys.path.insert(0, str(FIXTURES.parents[1]))  # tests/, for the torchvision workaround
    try:
        from torchvision_compat import load_torchvision

        load_torchvision()
        import streaming
    except Exception as exc:  # any import failure means "not here"
        pytest.skip(f"mosaicml-streaming does not import here ({type(exc).__name__}: {exc}); see make_mds.py")
    return streaming


@pytest.mark.parametrize("compression", [None, "zstd:7"])
def test_a_dataset_written_live_reads_as_mosaic_reads_it(tmp_path: Path, compression: str | None) -> None:
    streaming = _mosaic()
    rng = np.random.default_rng(1)
    columns = {"id": "int", "x": "ndarray:float16", "t": "str", "n": "uint32", "j": "json"}
    out = tmp_path / "live"
    with streaming.MDSWriter(out=str(out), columns=columns, size_limit=4096, compression=compression) as writer:
        for i in range(300):
            writer.write(
                {
                    "id": i,
                    "x": rng.standard_normal(int(rng.integers(1, 40))).astype(np.float16),
                    "t": "x" * int(rng.integers(0, 50)),
                    "n": np.uint32(rng.integers(0, 2**32)),
                    "j": {"k": [i] * (i % 4)},
                }
            )
    copy = Path(shutil.copytree(out, tmp_path / "mosaic-copy"))  # Mosaic decompresses into its folder
    dataset = streaming.StreamingDataset(local=str(copy), shuffle=False, batch_size=1)
    theirs = [encode(dataset[i]) for i in range(dataset.num_samples)]
    assert encoded(mds_stream(out, shuffle=False)) == theirs
