"""Readers on real files: token windows (.bin / .npy memmaps) and text/JSONL lines.

Specifications: a restore seeks (it reads no record before the cursor), a shuffle-buffer restore
re-reads at most the buffer's size, and a missing or truncated shard is a ResumeError that names
the shard and the offset, with nothing consumed.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import assert_resumes_identically, json_roundtrip
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, Stream, TextLineReader, TokenShardReader
from streams_harness import CountingReader, write_token_shards


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_token_windows_golden(tmp_path: Path, suffix: str) -> None:
    (path,) = write_token_shards(tmp_path, [10], suffix=suffix)
    reader = TokenShardReader(4, stride=3)
    assert reader.num_records(path) == 3
    assert [w.tolist() for w in reader(path, 1)] == [[3, 4, 5, 6], [6, 7, 8, 9]]
    assert reader(path, 0).__next__().dtype == torch.int64


def test_token_windows_made_in_chunks_are_the_windows_each_with_its_own_storage(tmp_path: Path) -> None:
    # The reader makes windows a chunk at a time (warm caches when the consumer works between
    # records): across chunk boundaries, from any start, each window is the slice of the file, and
    # none shares storage with another (a buffered record pins nothing but itself).
    (path,) = write_token_shards(tmp_path, [3 * 100 + 1])
    tokens = np.fromfile(path, dtype=np.uint16).astype(np.int64)
    reader = TokenShardReader(3)
    for start in (0, 1, 31, 32, 33, 70, 99, 100):
        windows = list(reader(path, start))
        assert [w.tolist() for w in windows] == [tokens[3 * i : 3 * i + 3].tolist() for i in range(start, 100)]
        assert len({w.untyped_storage().data_ptr() for w in windows}) == len(windows)
        assert all(w.untyped_storage().nbytes() == 3 * 8 for w in windows)
    picked = [0, 31, 32, 33, 64, 99]
    assert [w.tolist() for w in reader.read_records(path, picked)] == [
        tokens[3 * i : 3 * i + 3].tolist() for i in picked
    ]


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_token_stream_resumes_identically(tmp_path: Path, suffix: str) -> None:
    paths = write_token_shards(tmp_path, [40, 25, 0, 33], suffix=suffix)

    def make() -> ShardedIterable:
        return ShardedIterable(paths, read_shard=TokenShardReader(8), seed=3)

    assert_resumes_identically(make, [0, 3, 5, 5, 9, 12, 14, 17, 20], epochs=2)


def test_restore_mid_shard_reads_no_record_before_the_cursor(tmp_path: Path) -> None:
    (path,) = write_token_shards(tmp_path, [1000])
    stream = ShardedIterable([path], read_shard=TokenShardReader(5), sizes="unknown")
    iterator = iter(stream)
    [next(iterator) for _ in range(150)]
    counting = CountingReader(TokenShardReader(5))
    restored = ShardedIterable([path], read_shard=counting, sizes="unknown")
    restored.load_state_dict(stream.state_dict())
    assert next(iter(restored))[0].item() == 150 * 5
    assert counting.calls == [(str(path), 150)]
    assert counting.offsets_read == [(str(path), 150)]


def test_shuffle_buffer_restore_rereads_at_most_the_buffer_size(tmp_path: Path) -> None:
    paths = write_token_shards(tmp_path, [800, 800])
    size = 16

    def make(reader) -> Stream:
        return ShardedIterable(paths, read_shard=reader, seed=1, sizes="unknown").shuffle_buffer(size, seed=2)

    stream = make(TokenShardReader(4))
    iterator = iter(stream)
    [next(iterator) for _ in range(250)]
    state = json_roundtrip(stream.state_dict())
    expected = next(iterator)
    counting = CountingReader(TokenShardReader(4))
    restored = make(counting)
    restored.load_state_dict(state)
    assert not counting.calls  # restore is lazy: nothing is read before the first next()
    assert torch.equal(next(iter(restored)), expected)
    # `size` single-record re-reads, then one record from the current shard's cursor.
    assert len(state["buffer"]) == size
    assert len(counting.offsets_read) == size + 1


def test_jsonl_cursor_is_a_byte_offset_and_resumes_by_seeking(tmp_path: Path) -> None:
    paths = []
    for s in range(3):
        path = tmp_path / f"part{s}.jsonl"
        path.write_text("".join(json.dumps({"id": s * 100 + i, "text": "é" * i}) + "\n" for i in range(5 + s)))
        paths.append(path)

    def make() -> ShardedIterable:
        return ShardedIterable(paths, read_shard=TextLineReader(json.loads), seed=4)

    assert_resumes_identically(make, [0, 2, 5, 7, 7, 13, 18, 20], epochs=2)
    stream = ShardedIterable(paths, read_shard=TextLineReader(json.loads), shuffle=False)
    iterator = iter(stream)
    [next(iterator) for _ in range(2)]
    lines = paths[0].read_bytes().splitlines(keepends=True)
    assert stream.state_dict()["remaining"][0] == [0, str(paths[0]), len(lines[0]) + len(lines[1])]


def test_text_offset_inside_a_line_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("alpha\nbeta\n")
    stream = ShardedIterable([path], read_shard=TextLineReader(), shuffle=False)
    state = stream.state_dict()
    state["remaining"][0][2] = 3
    stream.load_state_dict(state)
    with pytest.raises(ResumeError, match=r"a.txt'.*byte offset 3 is not at the start of a line"):
        next(iter(stream))


def after_three_records(tmp_path: Path, reader, make_files) -> tuple[ShardedIterable, list[Path]]:
    paths = make_files(tmp_path)
    stream = ShardedIterable(paths, read_shard=reader, shuffle=False, sizes="unknown")
    iterator = iter(stream)
    [next(iterator) for _ in range(3)]
    return stream, paths


def text_files(tmp_path: Path) -> list[Path]:
    paths = []
    for s in range(2):
        path = tmp_path / f"t{s}.txt"
        path.write_text("".join(f"line {i}\n" for i in range(6)))
        paths.append(path)
    return paths


@pytest.mark.parametrize(
    ("reader", "make_files", "damage", "message"),
    [
        (
            TokenShardReader(4),
            lambda d: write_token_shards(d, [40, 40]),
            lambda p: p.unlink(),
            r"token shard '.*tok_000.bin' is missing",
        ),
        (
            TokenShardReader(4),
            lambda d: write_token_shards(d, [40, 40]),
            lambda p: p.write_bytes(p.read_bytes()[:8]),
            r"shard 0 '.*tok_000.bin' \(cursor at offset 3\) changed since the checkpoint: it was 80:",
        ),
        (TextLineReader(), text_files, lambda p: p.unlink(), r"text shard '.*t0.txt' is missing"),
        (
            TextLineReader(),
            text_files,
            lambda p: p.write_text("line 0\n"),
            r"shard 0 '.*t0.txt' \(cursor at offset 21\) changed since the checkpoint: it was 42:.* it is 7:",
        ),
    ],
)
def test_missing_or_truncated_shard_names_shard_and_offset_and_consumes_nothing(
    tmp_path, reader, make_files, damage, message
) -> None:
    stream, paths = after_three_records(tmp_path, reader, make_files)
    state = stream.state_dict()
    backup = paths[0].read_bytes()
    damage(paths[0])
    restored = ShardedIterable(paths, read_shard=reader, shuffle=False, sizes="unknown")
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=message):
        next(iter(restored))
    assert restored.state_dict() == state
    paths[0].write_bytes(backup)  # once the shard is back, the stream continues where it was
    expected = list(itertools.islice(iter(stream), 2))
    got = list(itertools.islice(iter(restored), 2))
    assert [str(x) for x in got] == [str(x) for x in expected]


def test_raw_token_file_with_a_partial_token_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x00" * 7)
    with pytest.raises(ResumeError, match="holds 7 bytes, not a multiple of 2"):
        TokenShardReader(2)(path, 0)


def test_npy_shard_cut_short_is_refused(tmp_path: Path) -> None:
    (path,) = write_token_shards(tmp_path, [100], suffix=".npy")
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(ResumeError, match="unreadable or truncated"):
        TokenShardReader(4).num_records(path)


def test_generic_reader_oserror_names_shard_and_offset(tmp_path: Path) -> None:
    def read(shard: str, start: int):
        return iter(np.fromfile(tmp_path / shard)[start:])

    stream = ShardedIterable(["nope"], read_shard=read)
    with pytest.raises(ResumeError, match="cannot read shard 0 'nope' at offset 0"):
        next(iter(stream))


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_a_token_shard_rewritten_in_place_is_read_as_it_is_now(tmp_path: Path, suffix: str) -> None:
    # The reader keeps recent shards mapped; a file rewritten since (same size, other tokens) must
    # not be read through the old mapping.
    path = tmp_path / f"shard{suffix}"

    def write(tokens: np.ndarray, mtime_ns: int) -> None:
        np.save(path, tokens) if suffix == ".npy" else tokens.tofile(path)
        os.utime(path, ns=(mtime_ns, mtime_ns))

    reader = TokenShardReader(2, dtype=np.int32)
    write(np.arange(8, dtype=np.int32), 1_000_000_000)
    assert [w.tolist() for w in reader.read_records(path, [0, 3])] == [[0, 1], [6, 7]]
    assert reader.tokens(path) is reader.tokens(path)  # kept mapped while unchanged
    write(np.arange(100, 108, dtype=np.int32), 2_000_000_000)
    assert [w.tolist() for w in reader.read_records(path, [0, 3])] == [[100, 101], [106, 107]]
    assert [w.tolist() for w in reader(path, 2)] == [[104, 105], [106, 107]]
