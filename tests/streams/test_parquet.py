"""ParquetReader: rows of Parquet files, the cursor a row number, a restore reads one row group.

Specifications: resumed == uninterrupted, bitwise, mid-row-group, at a row-group boundary, at a
shard boundary, through a shuffle buffer, through mix and with 2 workers; every row exactly once
across a change of world size; a restore reads no byte of an earlier row group (proved on the bytes
the file hands out) and at most one row group; a missing or cut shard is a ResumeError naming the
shard and the row, with nothing consumed.
"""

from __future__ import annotations

import io
import itertools
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow", reason="the [parquet] extra (pyarrow) is not installed")
pq = pytest.importorskip("pyarrow.parquet", reason="the [parquet] extra (pyarrow) is not installed")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from harness import assert_resumes_identically, consume, json_roundtrip  # noqa: E402
from resumable_data import ResumeError  # noqa: E402
from resumable_data.streams import ParquetReader, ShardedIterable, Stream, StreamLoader, mix  # noqa: E402
from streams_harness import assert_exactly_once_across_layout_change, ids  # noqa: E402

ROW_GROUP = 5


def write_parquet_shards(
    directory: Path, sizes: Sequence[int], *, row_group: int = ROW_GROUP, base: int = 0
) -> list[Path]:
    """Shard ``s`` holds rows ``id = base + s * 1000 + i`` with a few derived columns."""
    paths = []
    for s, n in enumerate(sizes):
        row_ids = [base + s * 1000 + i for i in range(n)]
        table = pa.table(
            {
                "id": pa.array(row_ids, type=pa.int64()),
                "tokens": pa.array([[r % 97, r % 89, r % 83] for r in row_ids], type=pa.list_(pa.int32())),
                "text": pa.array([f"row {r}" for r in row_ids]),
            }
        )
        path = directory / f"train-{s:05d}-of-{len(sizes):05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group)
        paths.append(path)
    return paths


def row_id(row: dict[str, Any]) -> int:
    return row["id"]


def as_tensors(row: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(row["id"]), torch.tensor(row["tokens"], dtype=torch.int64)


@pytest.fixture()
def shards(tmp_path: Path) -> list[Path]:
    return write_parquet_shards(tmp_path, [12, 10, 7])


def test_rows_golden(shards: list[Path]) -> None:
    assert ParquetReader().num_records(shards[0]) == 12
    assert list(ParquetReader()(shards[1], 9)) == [
        {"id": 1009, "tokens": [1009 % 97, 1009 % 89, 1009 % 83], "text": "row 1009"}
    ]
    assert [r["id"] for r in ParquetReader(["id"])(shards[0], 3)] == list(range(3, 12))
    assert next(iter(ParquetReader(["id"])(shards[0], 3))) == {"id": 3}  # only the selected column
    assert list(ParquetReader(parse=row_id)(shards[2], 5)) == [2005, 2006]
    assert list(ParquetReader()(shards[2], 7)) == []  # the cursor of a finished shard


def unshuffled(paths: list[Path], **kwargs: Any) -> ShardedIterable:
    return ShardedIterable(
        paths, read_shard=ParquetReader(["id", "tokens"], parse=as_tensors, **kwargs), shuffle=False, sizes="unknown"
    )


@pytest.mark.parametrize(
    ("cut", "cursor"),
    [(3, (0, 3)), (5, (0, 5)), (10, (0, 10)), (12, (0, 12)), (14, (1, 2)), (22, (1, 10)), (29, (2, 7))],
    ids=[
        "mid-row-group",
        "row-group-boundary",
        "last-row-group",
        "shard-boundary",
        "next-shard",
        "next-shard-end",
        "epoch-end",
    ],
)
def test_resume_at_each_kind_of_position(shards: list[Path], cut: int, cursor: tuple[int, int]) -> None:
    stream = unshuffled(shards)
    items = iter(stream)
    [next(items) for _ in range(cut)]
    first = stream.state_dict()["remaining"][0]
    assert (first[0], first[2]) == cursor  # the cursor is a row number (a finished shard: its row count)
    assert_resumes_identically(lambda: unshuffled(shards), [cut], epochs=2)


def test_shuffled_shards_resume_identically_several_times(shards: list[Path]) -> None:
    def make() -> ShardedIterable:
        return ShardedIterable(shards, read_shard=ParquetReader(parse=as_tensors), seed=7)

    assert_resumes_identically(make, [0, 3, 5, 5, 12, 17, 29, 31, 40], epochs=2)


@settings(max_examples=15)
@given(
    sizes=st.lists(st.integers(0, 13), min_size=1, max_size=4),
    row_group=st.integers(1, 6),
    buffer=st.integers(1, 5),
    seed=st.integers(0, 2**31),
    cuts=st.lists(st.integers(0, 50), max_size=3),
)
def test_shuffle_buffer_pipeline_resumes_for_any_layout_of_row_groups(sizes, row_group, buffer, seed, cuts) -> None:
    with tempfile.TemporaryDirectory() as directory:
        paths = write_parquet_shards(Path(directory), sizes, row_group=row_group)

        def make() -> Stream:
            source = ShardedIterable(paths, read_shard=ParquetReader(["id"], parse=row_id), seed=seed)
            return source.shuffle_buffer(buffer, seed=seed).batch(2)

        n = len(consume(make(), epochs=2))
        assert_resumes_identically(make, sorted(min(c, n) for c in cuts), epochs=2)


def noisy(item: tuple[torch.Tensor, torch.Tensor], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token dropout drawn from the record's generator."""
    row, tokens = item
    return row, tokens * (torch.rand(tokens.shape, generator=g) > 0.3)


def mixed(web: list[Path], books: list[Path]) -> Stream:
    sources = [
        ShardedIterable(paths, read_shard=ParquetReader(parse=as_tensors), seed=i)
        for i, paths in enumerate((web, books))
    ]
    return mix(sources, weights=[2, 1], seed=3).shuffle_buffer(4, seed=4).map(noisy, seed=5)


def test_mix_shuffle_buffer_and_two_workers_resume_identically(tmp_path: Path) -> None:
    (tmp_path / "web").mkdir()
    (tmp_path / "books").mkdir()
    web = write_parquet_shards(tmp_path / "web", [13, 9, 11, 6])
    books = write_parquet_shards(tmp_path / "books", [8, 10], base=500)

    def make() -> StreamLoader:
        return StreamLoader(mixed(web, books), batch_size=3, num_workers=2)

    n = len(list(make()))
    assert_resumes_identically(make, [1, 4, 4, n, n + 2], total=n + 4)


@pytest.mark.parametrize(("old", "new"), [((2, 0), (3, 0)), ((3, 0), (1, 2))])
def test_world_size_change_reads_every_row_exactly_once(tmp_path: Path, old, new) -> None:
    sizes = [13, 9, 0, 11, 6, 8]
    paths = write_parquet_shards(tmp_path, sizes)

    def make() -> Stream:
        return ShardedIterable(paths, read_shard=ParquetReader(["id"], parse=row_id), seed=5).shuffle_buffer(4, seed=6)

    every = [s * 1000 + i for s, n in enumerate(sizes) for i in range(n)]
    assert_exactly_once_across_layout_change(make, every, old, new, [2, 4, 3][: old[0]])


# -- what a restore reads ------------------------------------------------------------------------
class RecordingFile(io.FileIO):
    """A real file that logs the byte range of every read pyarrow makes through it."""

    log: list[tuple[int, int]]

    def read(self, size: int = -1) -> bytes:
        at = self.tell()
        data = super().read(size)
        self.log.append((at, at + len(data)))
        return data

    def readinto(self, buffer: Any) -> int:
        at = self.tell()
        n = super().readinto(buffer)
        self.log.append((at, at + (n or 0)))
        return n


def row_group_byte_ranges(path: Path) -> list[tuple[int, int]]:
    """``[start, end)`` of each row group's column chunks, from the footer."""
    metadata = pq.ParquetFile(path).metadata
    ranges = []
    for g in range(metadata.num_row_groups):
        chunks = [metadata.row_group(g).column(c) for c in range(metadata.num_columns)]
        starts = [c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in chunks]
        ranges.append((min(starts), max(s + c.total_compressed_size for s, c in zip(starts, chunks, strict=True))))
    return ranges


def test_restore_reads_no_byte_of_an_earlier_row_group_and_at_most_one_group(tmp_path: Path) -> None:
    # 8 row groups of 100 rows x 1 KiB of incompressible payload: each group ~100 KiB, larger
    # than pyarrow's 64 KiB speculative footer read, so the byte ranges tell the groups apart.
    rng = np.random.default_rng(0)
    path = tmp_path / "big.parquet"
    payload = [rng.bytes(1024) for _ in range(800)]
    pq.write_table(pa.table({"id": list(range(800)), "payload": payload}), path, row_group_size=100)
    groups = row_group_byte_ranges(path)
    log: list[tuple[int, int]] = []

    def opener(shard: Any) -> RecordingFile:
        file = RecordingFile(shard, "rb")
        file.log = log
        return file

    stream = ShardedIterable([path], read_shard=ParquetReader(["id"], parse=row_id), sizes="unknown")
    items = iter(stream)
    [next(items) for _ in range(537)]  # row 537: row group 5, 37 rows in
    restored = ShardedIterable([path], read_shard=ParquetReader(parse=row_id, opener=opener), sizes="unknown")
    restored.load_state_dict(json_roundtrip(stream.state_dict()))
    assert next(iter(restored)) == 537
    touched = {g for g, (lo, hi) in enumerate(groups) for a, b in log if a < hi and lo < b}
    assert min(touched) == 5, f"bytes of row groups {sorted(touched)} were read"
    footer_read = 64 * 1024
    identity_read = 8 + int.from_bytes(path.read_bytes()[-8:-4], "little") + 8  # the shard check reads the footer
    assert sum(b - a for a, b in log) <= (groups[5][1] - groups[5][0]) + footer_read + 4096 + identity_read


def test_shuffle_buffer_restore_decodes_a_few_row_groups_not_one_per_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (path,) = write_parquet_shards(tmp_path, [200], row_group=20)

    def make() -> Stream:
        return ShardedIterable([path], read_shard=ParquetReader(parse=row_id)).shuffle_buffer(16, seed=1)

    stream = make()
    items = iter(stream)
    [next(items) for _ in range(97)]
    state, expected = json_roundtrip(stream.state_dict()), next(items)
    decoded: list[int] = []
    read_row_group = pq.ParquetFile.read_row_group

    def counting(self: Any, group: int, *args: Any, **kwargs: Any) -> Any:
        decoded.append(group)
        return read_row_group(self, group, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    restored = make()
    restored.load_state_dict(state)
    assert next(iter(restored)) == expected
    buffered_groups = {offset // 20 for _, _, offset in state["buffer"]}
    assert len(state["buffer"]) == 16 and len(buffered_groups) <= 4  # the default cache_row_groups
    # The 16 buffered rows are re-read through the row-group cache (it holds as many groups as the
    # buffer spans here): each group decoded once, plus the group at the shard's cursor.
    assert len(decoded) <= len(buffered_groups) + 1, decoded


# -- errors ----------------------------------------------------------------------------------------
def after_three_rows(paths: list[Path]) -> tuple[ShardedIterable, dict[str, Any]]:
    stream = ShardedIterable(paths, read_shard=ParquetReader(parse=row_id), shuffle=False, sizes="unknown")
    items = iter(stream)
    [next(items) for _ in range(3)]
    return stream, stream.state_dict()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.unlink(), r"parquet shard '.*train-00000-of-00003.parquet' is missing"),
        (
            lambda p: p.write_bytes(p.read_bytes()[:100]),
            r"shard 0 '.*train-00000-of-00003.parquet' \(cursor at offset 3\) changed since the checkpoint",
        ),
    ],
    ids=["missing", "cut"],
)
def test_missing_or_damaged_shard_is_named_and_consumes_nothing(shards: list[Path], damage, message) -> None:
    stream, state = after_three_rows(shards)
    backup = shards[0].read_bytes()
    damage(shards[0])
    restored = ShardedIterable(shards, read_shard=ParquetReader(parse=row_id), shuffle=False, sizes="unknown")
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=message):
        next(iter(restored))
    assert restored.state_dict() == state
    shards[0].write_bytes(backup)  # once the shard is back, the stream continues where it was
    assert list(itertools.islice(iter(restored), 2)) == list(itertools.islice(iter(stream), 2)) == [3, 4]


def test_shard_shorter_than_the_cursor_names_shard_and_row(shards: list[Path]) -> None:
    _, state = after_three_rows(shards)
    write_parquet_shards(shards[0].parent, [2, 10, 7])  # shard 0 rewritten with 2 rows
    restored = ShardedIterable(shards, read_shard=ParquetReader(parse=row_id), shuffle=False, sizes="unknown")
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=r"train-00000-of-00003.parquet' \(cursor at offset 3\) changed since the"):
        next(iter(restored))
    allowed = ShardedIterable(
        shards, read_shard=ParquetReader(parse=row_id), shuffle=False, sizes="unknown", allow_changed_shards=True
    )
    allowed.load_state_dict(state)  # read as it is now: the reader finds the cursor past its end
    with pytest.raises(ResumeError, match=r"train-00000-of-00003.parquet' has 2 rows but the cursor is at row 3"):
        next(iter(allowed))


def test_unknown_column_names_the_columns_there_are(shards: list[Path]) -> None:
    with pytest.raises(
        ResumeError, match=r"lacks the column\(s\) \['input_ids'\]; its columns are \['id', 'tokens', 'text'\]"
    ):
        ParquetReader(["input_ids"]).num_records(shards[0])
    with pytest.raises(TypeError, match=r"pass \['id'\]"):
        ParquetReader("id")


def test_rows_of_every_shard_once_per_epoch_in_a_stream_loader(shards: list[Path]) -> None:
    loader = StreamLoader(
        ShardedIterable(shards, read_shard=ParquetReader(["id"], parse=row_id)), batch_size=4, num_workers=2
    )
    assert sorted(ids(list(loader))) == [s * 1000 + i for s, n in enumerate([12, 10, 7]) for i in range(n)]
