"""WebDatasetReader: WebDataset tar shards read as WebDataset reads them, with an O(1) seek.

Specifications: over shards written by WebDataset's own ShardWriter (and tars with every kind of
header Python's tarfile writes), every sample equals what ``webdataset.WebDataset`` yields, from
every start; a pipeline (shuffle_window, shuffle_buffer, mix, StreamLoader with 0 and 2 workers)
stopped and restored yields bitwise the uninterrupted run, each sample once per epoch, also into
another layout; a cut or rewritten shard is refused by name, a malformed tar is a clear error;
the sample index is saved in cache_dir and read back instead of scanning; a wids index gives the
sizes without opening a shard.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import json
import random
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path
from typing import Any

import pytest

wds = pytest.importorskip("webdataset", reason="the tests compare with webdataset (in the [dev] extra)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from harness import assert_resumes_identically, json_roundtrip  # noqa: E402
from resumable_data import ResumeError  # noqa: E402
from resumable_data.streams import ShardedIterable, Stream, StreamLoader, mix  # noqa: E402
from resumable_data.streams.formats import WebDatasetReader, expand_braces, webdataset_stream  # noqa: E402
from resumable_data.streams.formats import webdataset as wds_module  # noqa: E402
from resumable_data.streams.formats.tar_index import scan  # noqa: E402
from streams_harness import assert_exactly_once_across_layout_change, ids  # noqa: E402

SIZES = [23, 9, 17]
SECOND = 3584  # where the second member of write_shards's first shard starts (checked where used)


def write_shards(directory: Path, sizes: list[int], *, base: int = 0, name: str = "shard", seed: int = 0) -> list[str]:
    """WebDataset's ShardWriter: sample ``i`` of shard ``s`` has id ``base + s * 1000 + i``, random
    bytes (from ``seed``) of varying length, a class and a JSON field; one shard per ``sizes`` entry."""
    rng = random.Random(base + seed)
    pattern = str(directory / f"{name}-%04d.tar")
    with wds.ShardWriter(pattern, maxcount=10**9, verbose=0) as writer:
        for s, n in enumerate(sizes):
            if s:
                writer.next_stream()
            for i in range(n):
                record = base + s * 1000 + i
                writer.write(
                    {
                        "__key__": f"sample{record:06d}",
                        "id": str(record).encode(),
                        "bin": rng.randbytes(rng.randrange(0, 3000)),
                        "cls": str(record % 7).encode(),
                        "json": json.dumps({"record": record}).encode(),
                    }
                )
    return [pattern % s for s in range(len(sizes))]


def to_tensor(sample: dict[str, Any]) -> torch.Tensor:
    """The sample's id and a checksum of its bytes: a collatable record that changes with any byte."""
    return torch.tensor([int(sample["id"]), zlib.crc32(sample["bin"]), int(sample["cls"])])


def noisy(record: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return record * 1000 + torch.randint(0, 1000, (3,), generator=g)


def theirs(urls: list[str], **kwargs: Any) -> list[dict[str, Any]]:
    return list(wds.WebDataset(urls, shardshuffle=False, **kwargs))


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_shards(tmp_path_factory.mktemp("wds"), SIZES)


def write_odd_tar(path: Path, tar_format: int) -> None:
    """A tar with what WebDataset groups or skips: directories, a link, metadata names, a name without
    extension, keys in folders, multi-dot and upper-case extensions, long and non-ASCII names."""
    long_folder = "a-folder-name-long-enough-to-need-a-long-name-header/" * 3
    members = [
        ("top/", None),
        ("__meta__", b"skipped"),
        ("top/0001.jpg", b"jpeg bytes"),
        ("top/0001.seg.png", b"png bytes"),
        ("top/0001.TXT", b"upper-case extension"),
        ("top/README", b"no extension: skipped"),
        ("top/0002.txt", b""),
        ("top/__sub__/0003.txt", b"metadata names are skipped only at the start of a name"),
        (f"{long_folder}0004.cls", b"4"),
        (f"{long_folder}0004.json", b"{}"),
        ("données/été.txt", b"non-ASCII name"),
        ("x.bad.txt", b"x"),
        ("y.txt", b"a sample with a non-empty __bad__ field is dropped"),
        ("y.__bad__", b"1"),
        ("z.__bad__", b""),
    ]
    with tarfile.open(path, "w", format=tar_format) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                continue
            info.size, info.mtime = len(data), 1_700_000_000.5  # a float mtime: a pax header per member
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("top/0001.lnk")
        link.type, link.linkname = tarfile.SYMTYPE, "0001.jpg"
        tar.addfile(link)


# -- what is read -----------------------------------------------------------------------------------
def test_every_sample_from_every_start_equals_webdatasets_own_reader(shards: list[str]) -> None:
    reader = WebDatasetReader()
    reference = theirs(shards)
    assert [reader.num_records(shard) for shard in shards] == SIZES
    assert [sample for shard in shards for sample in reader(shard, 0)] == reference
    assert reference[0]["__key__"] == "sample000000" and set(reference[0]) >= {"__url__", "bin", "cls", "json"}
    first = 0
    for shard, size in zip(shards, SIZES, strict=True):
        for start in range(size + 1):
            assert list(reader(shard, start)) == reference[first + start : first + size]
        picked = sorted(random.Random(size).sample(range(size), 5))
        assert reader.read_records(shard, picked) == [reference[first + i] for i in picked]
        first += size


FIELDS = ["jpg", "TXT", "seg.png", "cls", "json"]


@settings(max_examples=25)
@given(
    samples=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "dir/c", "dir/sub/d", "e-1", "__x__"]),
            st.dictionaries(st.sampled_from(FIELDS), st.binary(max_size=600), min_size=1),
        ),
        max_size=12,
    ),
    picked=st.lists(st.integers(0, 11), max_size=5),
)
def test_any_sequence_of_samples_reads_as_webdataset_reads_it(samples, picked) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = str(Path(directory) / "shard.tar")
        with wds.TarWriter(path) as writer:
            for key, fields in samples:  # a key repeated later is another sample, as in WebDataset
                writer.write({"__key__": key, **fields})
        # consecutive writes of one key make one sample: both readers refuse a field written twice
        if any(a[0] == b[0] and set(a[1]) & set(b[1]) for a, b in itertools.pairwise(samples)):
            with pytest.raises(ValueError, match="duplicate file name"):
                theirs([path], empty_check=False)
            with pytest.raises(ResumeError, match="has two members of field"):
                WebDatasetReader().num_records(path)
            return
        reference = theirs([path], empty_check=False)
        reader = WebDatasetReader()
        assert list(reader(path, 0)) == reference  # one pass (no index yet)
        assert reader.num_records(path) == len(reference)
        for start in range(len(reference) + 1):
            assert list(reader(path, start)) == reference[start:]
        offsets = sorted({i for i in picked if i < len(reference)})
        assert reader.read_records(path, offsets) == [reference[i] for i in offsets]


@pytest.mark.parametrize("tar_format", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_tars_of_every_header_format_group_as_webdataset_groups_them(tmp_path: Path, tar_format: int) -> None:
    path = tmp_path / "odd.tar"
    if tar_format == tarfile.USTAR_FORMAT:  # no long-name header: only names that fit a ustar prefix
        write_shards(tmp_path, [3])
        path = tmp_path / "shard-0000.tar"
        with tarfile.open(path, "a", format=tar_format) as tar:
            info = tarfile.TarInfo("a-folder-in-the-ustar-prefix-field/" * 3 + "sample000000.more")
            info.size = 4
            tar.addfile(info, io.BytesIO(b"more"))
    else:
        write_odd_tar(path, tar_format)
    reference = theirs([str(path)])
    if tar_format != tarfile.USTAR_FORMAT:  # the odd tar: y is dropped (its __bad__ field is not empty)
        long_key = "a-folder-name-long-enough-to-need-a-long-name-header/" * 3 + "0004"
        golden = ["top/0001", "top/0002", "top/__sub__/0003", long_key, "données/été", "x", "z"]
        assert [sample["__key__"] for sample in reference] == golden
    assert list(WebDatasetReader()(str(path), 0)) == reference
    # the headers are parsed as tarfile parses them: the same members, names and sizes
    data = path.read_bytes()
    ours = [(m.name, m.size) for m in scan(lambda at, n: data[at : at + n], len(data), str(path)) if m.regular]
    with tarfile.open(path) as tar:
        assert ours == [(m.name, m.size) for m in tar.getmembers() if m.isreg()]


def test_decode_takes_webdatasets_own_decoder(shards: list[str]) -> None:
    decoder = wds.autodecode.Decoder([wds.autodecode.basichandlers])
    ours = [sample for shard in shards for sample in WebDatasetReader(decode=decoder)(shard, 0)]
    assert ours == list(wds.WebDataset(shards, shardshuffle=False).decode())
    assert ours[3]["json"] == {"record": 3} and ours[3]["cls"] == 3  # decoded by the handlers


# -- pipelines resume exactly -----------------------------------------------------------------------
def source(paths: list[str], seed: int, **reader: Any) -> ShardedIterable:
    return ShardedIterable(paths, read_shard=WebDatasetReader(to_tensor, **reader), seed=seed)


def test_shuffle_window_and_buffer_resume_identically(shards: list[str]) -> None:
    def windowed() -> Stream:
        return source(shards, 1).shuffle_window(8, seed=2).map(noisy, seed=3)

    def buffered() -> Stream:
        return source(shards, 4).shuffle_buffer(6, seed=5)

    n = sum(SIZES)
    assert_resumes_identically(windowed, [0, 5, 23, 23, n, n + 11], epochs=2)
    assert_resumes_identically(buffered, [3, 17, 40, n + 1], epochs=2)
    state = windowed().state_dict()
    assert len(json.dumps(state)) < 1024  # a position: the sizes come from the indexes


def test_mix_in_a_stream_loader_with_two_workers_resumes_identically(tmp_path: Path, shards: list[str]) -> None:
    books = write_shards(tmp_path, [11, 14], base=500_000, name="books")

    def make() -> StreamLoader:
        stream = mix([source(shards, 6), source(books, 7)], weights=[2, 1], seed=8).shuffle_buffer(4, seed=9)
        return StreamLoader(stream.map(noisy, seed=10), batch_size=3, num_workers=2, timeout=60)

    n = len(list(make()))
    assert_resumes_identically(make, [2, 9, n, n + 3], total=n + 5)


def test_every_sample_once_per_epoch_and_across_a_layout_change(shards: list[str]) -> None:
    every = [s * 1000 + i for s, n in enumerate(SIZES) for i in range(n)]
    loader = StreamLoader(source(shards, 11), batch_size=4, num_workers=2, timeout=60)
    assert sorted(ids([batch[:, 0] for batch in loader])) == every

    def make() -> Stream:
        return source(shards, 12).shuffle_window(5, seed=13).map(lambda record: record[0])

    assert_exactly_once_across_layout_change(make, every, (2, 0), (1, 2), [3, 2])


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1, 3])
@pytest.mark.parametrize("stage", ["window", "buffer"])
def test_restores_into_other_worker_counts_read_every_sample_once(shards: list[str], workers: int, stage: str) -> None:
    every = [s * 1000 + i for s, n in enumerate(SIZES) for i in range(n)]

    def make() -> Stream:
        base = source(shards, 14)
        shuffled = base.shuffle_window(7, seed=15) if stage == "window" else base.shuffle_buffer(7, seed=15)
        return shuffled.map(lambda record: record[0])

    assert_exactly_once_across_layout_change(make, every, (1, 2), (1, workers), [4])
    assert_exactly_once_across_layout_change(make, every, (2, workers), (3, 1), [2, 5])


# -- what is refused --------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["cut", "rewritten"])
def test_a_cut_or_rewritten_shard_is_refused_by_name(tmp_path: Path, damage: str) -> None:
    paths = write_shards(tmp_path, [12, 8])

    def make() -> Stream:
        return ShardedIterable(paths, read_shard=WebDatasetReader(to_tensor), shuffle=False).shuffle_buffer(3, seed=1)

    stream = make()
    items = iter(stream)
    [next(items) for _ in range(5)]
    state = json_roundtrip(stream.state_dict())
    if damage == "cut":
        Path(paths[0]).write_bytes(Path(paths[0]).read_bytes()[:5000])
    else:  # written again with the same keys and counts, other bytes
        write_shards(tmp_path, [12, 8], seed=1)
    with pytest.raises(ResumeError, match=r"shard-0000\.tar"):
        restored = make()
        restored.load_state_dict(state)
        next(iter(restored))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (lambda tar: b"not a tar archive at all" * 40, r"bad\.tar' is not a tar file"),
        (lambda tar: gzip.compress(tar), r"bad\.tar' is gzip-compressed: .* decompress it"),
        (
            lambda tar: tar[:2000],
            r"bad\.tar' is cut: member 'sample000000\.bin' needs bytes up to offset \d+, the file holds 2000",
        ),
        (
            lambda tar: tar[:SECOND] + b"\x01" * 512 + tar[SECOND + 512 :],
            rf"bad\.tar' is damaged: the bytes at offset {SECOND}",
        ),
        (lambda tar: b"", r"bad\.tar' is empty"),
        (
            lambda tar: tar[:SECOND] + bytes(512) + tar[SECOND + 512 :],
            rf"bad\.tar' is damaged: a zero block at offset {SECOND} ends the archive, but non-zero bytes follow",
        ),
        (lambda tar: tar + tar, r"bad\.tar' is damaged: .* tars were concatenated"),
    ],
    ids=["not-a-tar", "gzip", "cut-in-data", "bad-header", "empty", "zeroed-header", "concatenated"],
)
def test_a_malformed_tar_is_a_clear_error_naming_the_shard(tmp_path: Path, content: Any, message: str) -> None:
    (good,) = write_shards(tmp_path, [4])
    with tarfile.open(good) as tar:
        assert tar.getmembers()[1].offset == SECOND  # the second member's first header
    bad = tmp_path / "bad.tar"
    bad.write_bytes(content(Path(good).read_bytes()))
    with pytest.raises(ResumeError, match=r"cannot count the records of shard 0 .*" + message):
        ShardedIterable([str(bad)], read_shard=WebDatasetReader())


def test_two_members_of_one_field_in_a_sample_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tar:
        for name in ("a.txt", "a.TXT"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ResumeError, match=r"dup\.tar': sample 'a' has two members of field 'txt'"):
        WebDatasetReader().num_records(str(path))


# -- the index: saved, and a wids index ------------------------------------------------------------
def test_the_index_is_saved_in_cache_dir_and_read_back_instead_of_scanning(
    tmp_path: Path, shards: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, shard = tmp_path / "cache", str(tmp_path / "copy.tar")
    shutil.copy(shards[0], shard)
    assert WebDatasetReader(cache_dir=cache).num_records(shard) == SIZES[0]
    assert len(list((cache / "tar-index").glob("*.npz"))) == 1

    def no_scan(*args: Any) -> Any:
        raise AssertionError("the shard was scanned")

    monkeypatch.setattr(wds_module, "scan", no_scan)
    assert [s["id"] for s in WebDatasetReader(cache_dir=cache)(shard, 20)] == [b"20", b"21", b"22"]
    with pytest.raises(AssertionError, match="scanned"):  # a shard without a saved index is scanned
        WebDatasetReader(cache_dir=cache).num_records(shards[1])
    shutil.copy(write_shards(tmp_path, [5], seed=2)[0], shard)  # rewritten: its saved index is not used
    with pytest.raises(AssertionError, match="scanned"):
        WebDatasetReader(cache_dir=cache).num_records(shard)
    monkeypatch.undo()
    assert WebDatasetReader(cache_dir=cache).num_records(shard) == 5


def test_an_index_saved_before_cut_shards_were_refused_is_built_again(
    tmp_path: Path, shards: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The release before this index version read a tar cut at a member's header short and saved
    # that short index in cache_dir: trusted, it would keep the cut shard silent.
    cache, cut = tmp_path / "cache", tmp_path / "cut.tar"
    cut.write_bytes(Path(shards[0]).read_bytes()[:SECOND])

    def scan_then_stop(read: Any, size: int, shard: str) -> Any:
        with contextlib.suppress(ResumeError):  # the older scan: the end of the file ended the archive
            yield from scan(read, size, shard)

    monkeypatch.setattr(wds_module, "scan", scan_then_stop)
    assert WebDatasetReader(cache_dir=cache).num_records(str(cut)) == 1
    monkeypatch.undo()
    (saved,) = (cache / "tar-index").glob("*.npz")
    with np.load(saved) as arrays:
        older = {**arrays, "version": np.array(1)}
    np.savez(saved, **older)
    with pytest.raises(ResumeError, match=rf"'{cut}' is cut: it ends at offset {SECOND}"):
        WebDatasetReader(cache_dir=cache).num_records(str(cut))


def test_a_shard_without_an_index_is_read_in_one_pass_that_keeps_the_index(
    shards: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    reader = WebDatasetReader()
    first = reader(shards[1], 0)
    assert [next(first) for _ in range(3)] == theirs(shards[1:2])[:3]
    first.close()  # a pass stopped part way keeps no index: the shard is scanned again
    assert list(reader(shards[1], 0)) == theirs(shards[1:2])
    monkeypatch.setattr(wds_module, "scan", lambda *args: pytest.fail("the shard was scanned again"))
    assert reader.num_records(shards[1]) == SIZES[1]
    assert reader.read_records(shards[1], [2, 8]) == [theirs(shards[1:2])[i] for i in (2, 8)]


def test_a_wids_index_gives_shards_and_sizes_without_opening_a_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "data").mkdir()
    paths = write_shards(tmp_path / "data", [5, 7])
    index = tmp_path / "data" / "train.json"
    shardlist = [{"url": Path(p).name, "nsamples": n} for p, n in zip(paths, [5, 7], strict=True)]
    index.write_text(json.dumps({"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": shardlist}))

    monkeypatch.setattr(wds_module, "scan", lambda *args: pytest.fail("a shard was opened to count it"))
    stream = webdataset_stream(index, shuffle=False)
    assert stream.shards == paths and stream.sizes == [5, 7]
    monkeypatch.undo()
    assert list(webdataset_stream(str(index), shuffle=False)) == theirs(paths)

    index.write_text(json.dumps({"wids_version": 1, "shardlist": [{"url": "a.tar", "nsamples": -1}]}))
    with pytest.raises(ResumeError, match=r"train\.json' shard 0: \"nsamples\" should be an integer >= 0, but got -1"):
        webdataset_stream(index)
    index.write_text(json.dumps({"shardlist": []}))
    with pytest.raises(ResumeError, match=r"should be a JSON object with \"wids_version\": 1"):
        webdataset_stream(index)


def test_brace_patterns_expand_as_webdatasets(tmp_path: Path, shards: list[str]) -> None:
    assert expand_braces("s-{08..11}.tar") == ["s-08.tar", "s-09.tar", "s-10.tar", "s-11.tar"]
    assert expand_braces("{a,b}/{1..2}.tar") == ["a/1.tar", "a/2.tar", "b/1.tar", "b/2.tar"]
    assert expand_braces("plain.tar") == ["plain.tar"]
    pattern = shards[0].replace("0000.tar", "{0000..0002}.tar")
    assert webdataset_stream(pattern).shards == shards
    assert list(webdataset_stream(pattern, shuffle=False)) == theirs(shards)


# -- a cut shard: read whole, or refused by name -----------------------------------------------------
def without_location(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples but their ``__url__`` and ``__local_path__`` (a cut copy lies elsewhere)."""
    return [{k: v for k, v in sample.items() if k not in ("__url__", "__local_path__")} for sample in samples]


def member_starts(path: str) -> list[int]:
    """Where each member's first header (a pax header before it counts) starts, as tarfile reads it."""
    with tarfile.open(path) as tar:
        return [member.offset for member in tar.getmembers()]


def archive_end(path: str) -> int:
    """Where the last member's padded data ends: the end-of-archive marker's first zero block."""
    with tarfile.open(path) as tar:
        last = tar.getmembers()[-1]
    return last.offset_data + -(-last.size // 512) * 512


def read_cut(intact: str, cut: int, directory: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | str:
    """The intact shard's first ``cut`` bytes as a shard of its own, read by a fresh reader in one pass
    (no index yet) and by a count then a read through the index: both reads, or the ResumeError's
    message (the two must agree: the same refusal)."""
    path = directory / "cut.tar"
    path.write_bytes(Path(intact).read_bytes()[:cut])
    messages, reads = [], []
    for counted in (False, True):
        reader = WebDatasetReader()
        try:
            if counted:
                reader.num_records(str(path))
            reads.append(list(reader(str(path), 0)))
        except ResumeError as exc:
            messages.append(str(exc))
    if messages:
        assert len(messages) == 2, f"cut at {cut}: one read refused ({messages[0]}), the other read"
        assert messages[0] == messages[1]
        return messages[0]
    return reads[0], reads[1]


def check_cut(intact: str, cut: int, directory: Path) -> None:
    """A shard cut at ``cut`` reads all its samples, equal to WebDataset's read of the intact shard,
    or is a ResumeError naming it: refused exactly where a sample (or a field of one) is lost, or where
    the end-of-archive marker is (a whole zero block after the last member: tarfile writes two)."""
    outcome = read_cut(intact, cut, directory)
    if cut < archive_end(intact) + 512:
        assert isinstance(outcome, str), f"cut at {cut} of {Path(intact).stat().st_size} bytes read silently"
        assert "'" + str(directory / "cut.tar") + "'" in outcome
    else:
        assert not isinstance(outcome, str), f"cut at {cut}, after the end marker, refused: {outcome}"
        expected = without_location(theirs([intact]))
        assert without_location(outcome[0]) == expected and without_location(outcome[1]) == expected


def test_a_tar_cut_at_a_4_kib_block_boundary_is_refused_by_name(tmp_path: Path) -> None:
    # What a block-wise partial copy leaves: the file ends on a 4 KiB block, which can be a member's
    # first header (the members are 512-byte aligned): no byte of it is damaged, the archive simply
    # stops there, without its end-of-archive marker, in the middle of a sample.
    (intact,) = write_shards(tmp_path, [50])
    full = theirs([intact])
    starts = member_starts(intact)
    cut = next(c for c in range(4096, len(Path(intact).read_bytes()), 4096) if c in starts[1:] and starts.index(c) % 4)
    copy = tmp_path / "copy.tar"
    copy.write_bytes(Path(intact).read_bytes()[:cut])
    short = theirs([str(copy)])  # WebDataset's own reader stops there silently, as the docs say
    assert 0 < len(short) < len(full) and set(short[-1]) < set(full[len(short) - 1])
    message = rf"tar shard '{copy}' is cut: it ends at offset {cut}, after member '.*', without the end-of-archive"
    with pytest.raises(ResumeError, match=message):
        ShardedIterable([str(copy)], read_shard=WebDatasetReader())
    with pytest.raises(ResumeError, match=message):
        list(WebDatasetReader()(str(copy), 0))


def test_a_tar_cut_at_any_512_byte_boundary_reads_whole_or_is_refused_by_name(
    tmp_path: Path, shards: list[str]
) -> None:
    intact = shards[1]
    assert archive_end(intact) + 1024 <= Path(intact).stat().st_size  # the marker and tarfile's padding
    for cut in range(512, Path(intact).stat().st_size + 1, 512):
        check_cut(intact, cut, tmp_path)


@settings(max_examples=60)
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_a_tar_cut_anywhere_reads_whole_or_is_refused_by_name(shards: list[str], fraction: float) -> None:
    # Mid-header, mid-member, inside a pax record, inside the end marker or tarfile's padding.
    intact = shards[1]
    with tempfile.TemporaryDirectory() as directory:
        check_cut(intact, 1 + int(fraction * (Path(intact).stat().st_size - 1)), Path(directory))


def test_webdatasets_own_reader_reads_damaged_tars_as_the_docs_say(tmp_path: Path) -> None:
    # The docs contrast this reader with WebDataset's: where the archive stops at a member's header
    # (a file cut there, or a header overwritten), tarfile ends the archive and WebDataset yields
    # fewer samples without a word; a member cut in its data is an error there too (tarfile's
    # "unexpected end of data"), naming the file but not the member.
    (intact,) = write_shards(tmp_path, [4])
    data, full = Path(intact).read_bytes(), theirs([intact])
    assert member_starts(intact)[1] == SECOND
    damaged = {"cut-at-a-header": data[:SECOND], "bad-header": data[:SECOND] + b"\x01" * 512 + data[SECOND + 512 :]}
    damaged["zeroed-header"] = data[:SECOND] + bytes(512) + data[SECOND + 512 :]
    for name, content in damaged.items():
        path = tmp_path / f"{name}.tar"
        path.write_bytes(content)
        assert len(theirs([str(path)])) < len(full), name
        with pytest.raises(ResumeError, match=rf"tar shard '{path}' is (cut|damaged)"):
            WebDatasetReader().num_records(str(path))
    path = tmp_path / "cut-in-data.tar"
    path.write_bytes(data[:2000])
    with pytest.raises(tarfile.ReadError, match="unexpected end of data"):
        theirs([str(path)])
