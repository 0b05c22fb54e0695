"""A shard that changed between save and restore is refused, naming it, unless allowed.

The state keeps an identity (size and a digest of the first and last bytes; for Parquet the footer)
of each shard it has partly read. A shard truncated but still longer than the cursor, or rewritten
with other content of the same size, would otherwise resume silently on other records. The check
happens before the shard's first record is read after the restore: nothing is consumed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import json_roundtrip
from resumable_data import ResumeError
from resumable_data.streams import ParquetReader, ShardedIterable, TextLineReader, TokenShardReader

RECORDS = 200


def token_shards(directory: Path) -> tuple[list[Path], Any]:
    paths = []
    for s in range(2):
        path = directory / f"tok_{s}.bin"
        (s * 1000 + np.arange(RECORDS * 2)).astype(np.uint16).tofile(path)
        paths.append(path)
    return paths, TokenShardReader(2)


def text_shards(directory: Path) -> tuple[list[Path], Any]:
    paths = []
    for s in range(2):
        path = directory / f"part{s}.txt"
        path.write_text("".join(f"{s:01d}{i:06d}\n" for i in range(RECORDS)))
        paths.append(path)
    return paths, TextLineReader()


def parquet_shards(directory: Path) -> tuple[list[Path], Any]:
    pa = pytest.importorskip("pyarrow", reason="the [parquet] extra (pyarrow) is not installed")
    pq = pytest.importorskip("pyarrow.parquet", reason="the [parquet] extra (pyarrow) is not installed")
    paths = []
    for s in range(2):
        path = directory / f"train-{s}.parquet"
        pq.write_table(pa.table({"id": [s * 1000 + i for i in range(RECORDS)]}), path, row_group_size=50)
        paths.append(path)
    return paths, ParquetReader(["id"])


def truncate(path: Path) -> None:
    """Keep the first 3/4 (a Parquet file is rewritten with its first 3/4 of rows)."""
    _rewrite(path, keep=3 * RECORDS // 4)


def same_size_other_content(path: Path) -> None:
    if path.suffix == ".parquet":
        _rewrite(path, keep=RECORDS, shift=7)
        return
    data = bytearray(path.read_bytes())
    data[-5] = ord("9") if data[-5] != ord("9") else ord("8")  # one byte near the end, same length
    path.write_bytes(bytes(data))


def _rewrite(path: Path, keep: int, shift: int = 0) -> None:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        ids = [i + shift for i in pq.read_table(path)["id"].to_pylist()[:keep]]
        pq.write_table(pa.table({"id": ids}), path, row_group_size=50)
    else:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) * keep // RECORDS])


@pytest.mark.parametrize("damage", [truncate, same_size_other_content], ids=["truncated", "same size"])
@pytest.mark.parametrize("make", [token_shards, text_shards, parquet_shards], ids=["token", "text", "parquet"])
def test_a_changed_shard_is_refused_naming_it_with_cursors(
    tmp_path: Path, make: Callable[[Path], tuple[list[Path], Any]], damage: Callable[[Path], None]
) -> None:
    paths, reader = make(tmp_path)
    stream = ShardedIterable(paths, read_shard=reader, shuffle=False, sizes="unknown")
    items = iter(stream)
    for _ in range(RECORDS // 2):  # half of shard 0: both damages leave it longer than the cursor
        next(items)
    state = json_roundtrip(stream.state_dict())
    damage(paths[0])
    restored = ShardedIterable(paths, read_shard=reader, shuffle=False, sizes="unknown")
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=rf"shard 0 '.*{paths[0].name}' \(cursor at offset \d+\) changed since"):
        next(iter(restored))
    assert restored.state_dict() == state  # nothing consumed
    allowed = ShardedIterable(paths, read_shard=reader, shuffle=False, sizes="unknown", allow_changed_shards=True)
    allowed.load_state_dict(state)
    assert len(list(itertools.islice(iter(allowed), 3))) == 3  # read as the shard is now


def test_with_cursors_an_unchanged_shard_resumes_and_a_shard_read_from_its_start_is_not_checked(tmp_path: Path) -> None:
    paths, reader = token_shards(tmp_path)
    stream = ShardedIterable(paths, read_shard=reader, shuffle=False, sizes="unknown")
    items = iter(stream)
    for _ in range(10):
        next(items)
    state = json_roundtrip(stream.state_dict())
    assert list(state["identities"]) == ["0"]  # only the shard being read
    truncate(paths[1])  # not read yet: read as it is when the stream gets there
    restored = ShardedIterable(paths, read_shard=reader, shuffle=False, sizes="unknown")
    restored.load_state_dict(state)
    resumed, expected = itertools.islice(iter(restored), 5), itertools.islice(items, 5)
    assert [w.tolist() for w in resumed] == [w.tolist() for w in expected]


# -- the default: a reader that counts gives the sizes, so the state is a position ------------------
def _half_read_state(paths: list[Path], reader: Any) -> dict[str, Any]:
    """The JSON state of a default-built (counted sizes) unshuffled stream halfway through its records."""
    stream = ShardedIterable(paths, read_shard=reader, shuffle=False)
    items = iter(stream)
    for _ in range(RECORDS // 2):
        next(items)
    return json_roundtrip(stream.state_dict())


@pytest.mark.parametrize("make", [token_shards, parquet_shards], ids=["token", "parquet"])
def test_by_default_a_shard_whose_count_changed_is_refused_at_load_naming_it(
    tmp_path: Path, make: Callable[[Path], tuple[list[Path], Any]]
) -> None:
    paths, reader = make(tmp_path)
    state = _half_read_state(paths, reader)
    assert "position" in state  # the reader counted the sizes
    truncate(paths[0])
    for allow in (False, True):  # a position over other counts would mean other records: never read on
        restored = ShardedIterable(paths, read_shard=reader, shuffle=False, allow_changed_shards=allow)
        before = restored.state_dict()
        with pytest.raises(ResumeError, match=rf"shard sizes changed.*shard 0 '.*{paths[0].name}' changed, it was"):
            restored.load_state_dict(state)
        assert restored.state_dict() == before  # a failed load changes nothing


@pytest.mark.parametrize("make", [token_shards, parquet_shards], ids=["token", "parquet"])
def test_by_default_a_shard_rewritten_with_as_many_records_is_refused_when_read_naming_it(
    tmp_path: Path, make: Callable[[Path], tuple[list[Path], Any]]
) -> None:
    paths, reader = make(tmp_path)
    state = _half_read_state(paths, reader)
    same_size_other_content(paths[0])
    restored = ShardedIterable(paths, read_shard=reader, shuffle=False)
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=rf"shard 0 '.*{paths[0].name}' \(cursor at offset \d+\) changed since"):
        next(iter(restored))
    assert restored.state_dict() == state  # nothing consumed
    allowed = ShardedIterable(paths, read_shard=reader, shuffle=False, allow_changed_shards=True)
    allowed.load_state_dict(state)
    assert len(list(itertools.islice(iter(allowed), 3))) == 3  # read as the shard is now


def test_by_default_a_shard_not_read_yet_whose_count_changed_is_refused_at_load(tmp_path: Path) -> None:
    paths, reader = token_shards(tmp_path)
    stream = ShardedIterable(paths, read_shard=reader, shuffle=False)
    items = iter(stream)
    for _ in range(10):
        next(items)
    state = json_roundtrip(stream.state_dict())
    truncate(paths[1])  # with cursors it would be read as it is; a position would mean other records
    restored = ShardedIterable(paths, read_shard=reader, shuffle=False)
    with pytest.raises(ResumeError, match=r"shard sizes changed.*a shard that is not being read changed"):
        restored.load_state_dict(state)


def test_by_default_a_missing_shard_fails_at_construction_naming_it(tmp_path: Path) -> None:
    paths, reader = token_shards(tmp_path)
    paths[1].unlink()
    with pytest.raises(ResumeError, match=rf"cannot count the records of shard 1 '.*{paths[1].name}'.*is missing"):
        ShardedIterable(paths, read_shard=reader)
    stream = ShardedIterable(paths, read_shard=reader, sizes="unknown", shuffle=False)  # opens a shard to read it
    assert len(list(itertools.islice(iter(stream), 3))) == 3
