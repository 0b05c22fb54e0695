"""A reader that counts its shards' records cheaply is asked for them, by default.

``TokenShardReader`` (a file size) and ``ParquetReader`` (a footer) are record counters: with
``sizes=None`` (the default) or ``sizes="count"`` a ShardedIterable knows its sizes without the caller
listing them, so its state is a position, ``shuffle_window`` reads by position, and a restore into
another ``num_workers`` is accepted. ``sizes="unknown"`` keeps per-shard cursors. A state saved by
cursors still loads with counted sizes and resumes exactly.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from resumable_data import ResumeError
from resumable_data.streams import (
    RecordCounter,
    ShardedIterable,
    Stream,
    StreamLoader,
    TextLineReader,
    TokenShardReader,
)
from streams_harness import ids, write_token_shards

WINDOW = 4
TOKEN_SIZES = [9 * WINDOW, 5 * WINDOW, 12 * WINDOW, 7 * WINDOW, 3 * WINDOW]


def token_stream(paths: list[Path], sizes: Any) -> Callable[[], Stream]:
    return lambda: ShardedIterable(paths, read_shard=TokenShardReader(WINDOW), seed=5, sizes=sizes).shuffle_window(
        10, seed=1
    )


def parquet_stream(tmp_path: Path, sizes: Any) -> Callable[[], Stream]:
    pytest.importorskip("pyarrow")
    from test_parquet import row_id, write_parquet_shards

    from resumable_data.streams import ParquetReader

    paths = sorted(tmp_path.glob("*.parquet")) or write_parquet_shards(tmp_path, [13, 6, 21, 9])
    return lambda: (
        ShardedIterable(paths, read_shard=ParquetReader(), seed=5, sizes=sizes).shuffle_window(10, seed=1).map(row_id)
    )


def window_state(state: dict[str, Any]) -> dict[str, Any]:
    """The shuffle_window's state inside a slot's pipeline state."""
    while "positional" not in state:
        state = state["source"]
    return state


def run(make: Callable[[], Stream], *, cut: int, workers_after: int) -> tuple[list[int], list[int], dict[str, Any]]:
    """``cut`` batches with 0 workers, then the rest of the epoch restored with ``workers_after``."""
    before = StreamLoader(make(), batch_size=3)
    head = ids(list(itertools.islice(iter(before), cut)))
    state = json.loads(json.dumps(before.state_dict()))
    after = StreamLoader(make(), batch_size=3, num_workers=workers_after, timeout=60)
    after.load_state_dict(state)
    return head, ids(list(after)), state


def test_the_ready_made_counting_readers_are_record_counters() -> None:
    assert isinstance(TokenShardReader(WINDOW), RecordCounter)
    assert not isinstance(TextLineReader(), RecordCounter)


def test_counted_sizes_are_the_readers_counts_and_make_the_state_a_position(tmp_path: Path) -> None:
    paths = write_token_shards(tmp_path, TOKEN_SIZES)
    reader = TokenShardReader(WINDOW)
    stream = ShardedIterable(paths, read_shard=reader, seed=5, sizes="count")
    assert stream.sizes == [reader.num_records(p) for p in paths]
    assert "position" in stream.state_dict() and "remaining" not in stream.state_dict()


@pytest.mark.parametrize("kind", ["token", "parquet"])
def test_shuffle_window_over_counted_sizes_reads_by_position_and_restores_into_other_workers(
    tmp_path: Path, kind: str
) -> None:
    if kind == "token":
        paths = write_token_shards(tmp_path, TOKEN_SIZES)
        reader = TokenShardReader(WINDOW)
        counted, listed = token_stream(paths, "count"), token_stream(paths, [reader.num_records(p) for p in paths])
    else:
        counted = parquet_stream(tmp_path, "count")
        listed = parquet_stream(tmp_path, [13, 6, 21, 9])
    # Uninterrupted, the counted run is the run with the sizes listed by hand, bitwise.
    reference = ids(list(StreamLoader(counted(), batch_size=3)))
    assert reference == ids(list(StreamLoader(listed(), batch_size=3)))
    head, rest, state = run(counted, cut=4, workers_after=2)
    assert window_state(state["slots"]["0"])["positional"] is True, "shuffle_window fell back to reading its windows"
    # Accepted with 2 workers: every record of the epoch exactly once, and the very records the
    # same restore gives with the sizes listed by hand.
    assert sorted(head + rest) == sorted(reference)
    assert head == reference[: len(head)]
    listed_head, listed_rest, _ = run(listed, cut=4, workers_after=2)
    assert (head, rest) == (listed_head, listed_rest)


@pytest.mark.parametrize("sizes", [None, "count"])
def test_a_state_saved_by_cursors_loads_with_counted_sizes_and_resumes_exactly(tmp_path: Path, sizes: Any) -> None:
    paths = write_token_shards(tmp_path, TOKEN_SIZES)

    def make(sizes: Any) -> StreamLoader:
        stream = ShardedIterable(paths, read_shard=TokenShardReader(WINDOW), seed=5, sizes=sizes)
        return StreamLoader(stream.shuffle_buffer(7, seed=2), batch_size=3)

    uninterrupted = make("unknown")
    reference = [ids(list(uninterrupted)) for _ in range(2)]  # this epoch and the next
    old = make("unknown")
    head = ids(list(itertools.islice(iter(old), 5)))
    state = json.loads(json.dumps(old.state_dict()))
    assert "sizes_digest" not in state["slots"]["0"]["source"]["source"]  # as main before 0.2 wrote it
    resumed = make(sizes)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # read back as saved: cursors, bound to no sizes
    assert [head + ids(list(resumed)), ids(list(resumed))] == reference
    assert make(sizes).state_dict()["slots"]["0"]["source"]["source"]["position"] == 0  # a fresh one counted


def test_counted_sizes_refuse_a_state_whose_shards_were_counted_differently(tmp_path: Path) -> None:
    paths = write_token_shards(tmp_path, TOKEN_SIZES)
    stream = ShardedIterable(paths, read_shard=TokenShardReader(WINDOW), seed=5, sizes="count")
    reading = iter(stream)
    next(reading)
    state = stream.state_dict()
    write_token_shards(tmp_path, [TOKEN_SIZES[0] + WINDOW, *TOKEN_SIZES[1:]])  # shard 0 grew by a record
    fresh = ShardedIterable(paths, read_shard=TokenShardReader(WINDOW), seed=5, sizes="count")
    before = fresh.state_dict()
    with pytest.raises(
        ResumeError, match=r"shard sizes changed: the reader counted other record counts than the checkpoint's"
    ):
        fresh.load_state_dict(state)
    assert fresh.state_dict() == before


def test_a_reader_that_cannot_count_is_refused_naming_what_to_pass(tmp_path: Path) -> None:
    text = tmp_path / "a.jsonl"
    text.write_text("1\n2\n")
    with pytest.raises(ResumeError, match=r"sizes='count' needs .* TextLineReader has its own offsets"):
        ShardedIterable([text], read_shard=TextLineReader(), sizes="count")
    with pytest.raises(ResumeError, match=r"function has no num_records"):
        ShardedIterable(["a"], read_shard=lambda shard, start: iter([]), sizes="count")
    with pytest.raises(ResumeError, match=r"sizes should be a list of record counts, None, 'count' or 'unknown'"):
        ShardedIterable(["a"], read_shard=lambda shard, start: iter([]), sizes="all")


def test_by_default_a_counting_reader_gives_the_sizes_and_any_other_reader_keeps_cursors(tmp_path: Path) -> None:
    paths = write_token_shards(tmp_path, TOKEN_SIZES)
    reader = TokenShardReader(WINDOW)
    default = ShardedIterable(paths, read_shard=reader, seed=5)
    assert default.sizes == [reader.num_records(p) for p in paths] == [size // WINDOW for size in TOKEN_SIZES]
    assert "position" in default.state_dict()
    cursors = ShardedIterable(paths, read_shard=reader, seed=5, sizes="unknown")
    assert cursors.sizes is None and "remaining" in cursors.state_dict()
    # The same records in the same order either way, over two epochs.
    assert ids(list(itertools.islice(iter(default), 60))) == ids(list(itertools.islice(iter(cursors), 60)))
    plain = ShardedIterable(paths, read_shard=lambda shard, start: reader(shard, start), seed=5)
    assert plain.sizes is None and "remaining" in plain.state_dict()  # a function cannot count


def test_a_position_state_is_refused_with_unknown_sizes_naming_what_to_pass(tmp_path: Path) -> None:
    paths = write_token_shards(tmp_path, TOKEN_SIZES)
    state = ShardedIterable(paths, read_shard=TokenShardReader(WINDOW), seed=5).state_dict()
    cursors = ShardedIterable(paths, read_shard=TokenShardReader(WINDOW), seed=5, sizes="unknown")
    with pytest.raises(
        ResumeError, match=r"saved with the shards' sizes \(its position needs them\).*not sizes='unknown'"
    ):
        cursors.load_state_dict(state)


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_a_token_shard_is_counted_from_its_size_as_mapping_it_would_count_it(tmp_path: Path, suffix: str) -> None:
    paths = write_token_shards(tmp_path, [0, 3, 4, 5, 11, 40], suffix=suffix)
    reader = TokenShardReader(4, stride=3)
    assert [reader.num_records(p) for p in paths] == [len(list(reader(p, 0))) for p in paths] == [0, 0, 1, 1, 3, 13]
    paths[-1].write_bytes(paths[-1].read_bytes()[:-1])  # cut inside a token (or inside the .npy data)
    with pytest.raises(ResumeError, match=r"is unreadable or truncated|not a multiple of 2"):
        reader.num_records(paths[-1])
    with pytest.raises(ResumeError, match=r"is unreadable or truncated|not a multiple of 2"):
        reader.tokens(paths[-1])
