"""shuffle_window: windows of records, each in a keyed permutation; the state is a few integers.

Specification: every record of the epoch exactly once, each window a permutation of its records;
a resume anywhere is bitwise the uninterrupted stream, windows read by position (known sizes) and
by reading (unknown sizes) alike, through StreamLoader with and without workers; the state stays a
few hundred bytes at 16 and at 10^4 shards; a restore by position reads only the records it hands
out; a layout change consumes every record exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_resumes_identically, consume
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, Stream, StreamLoader, TextLineReader
from streams_harness import CountingReader, MemoryShards, assert_exactly_once_across_layout_change


def windowed(sizes: list[int], size: int, *, known: bool, seed: int = 0) -> Stream:
    shards = MemoryShards(sizes)
    source = ShardedIterable(shards.names, read_shard=shards, seed=seed, sizes=sizes if known else None)
    return source.shuffle_window(size, seed=seed + 1)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    size=st.integers(1, 12),
    known=st.booleans(),
    seed=st.integers(0, 3),
)
def test_each_window_is_a_permutation_of_the_next_records(sizes, size, known, seed) -> None:
    stream = windowed(sizes, size, known=known, seed=seed)
    unshuffled = list(ShardedIterable(MemoryShards(sizes).names, read_shard=MemoryShards(sizes), seed=seed))
    got = list(stream)
    assert len(got) == len(unshuffled)
    for start in range(0, len(got), size):
        assert sorted(got[start : start + size]) == sorted(unshuffled[start : start + size])


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    size=st.integers(1, 8),
    known=st.booleans(),
    cuts=st.lists(st.integers(0, 40), min_size=1, max_size=3),
)
def test_resumes_identically_anywhere(sizes, size, known, cuts) -> None:
    def make() -> Stream:
        return windowed(sizes, size, known=known).map(lambda x: x * 10)

    total = len(consume(make(), epochs=2))
    assert_resumes_identically(make, sorted(min(c, total) for c in cuts), epochs=2)


@pytest.mark.parametrize(
    ("num_workers", "known"),
    [(0, True), (2, True), (0, False), pytest.param(2, False, marks=pytest.mark.slow)],
    ids=["by position-0", "by position-2", "by reading-0", "by reading-2"],
)
def test_loader_resumes_identically(num_workers: int, known: bool) -> None:
    sizes = [7, 3, 9, 4, 6, 5, 8]

    def make() -> StreamLoader:
        return StreamLoader(windowed(sizes, 5, known=known), batch_size=2, num_workers=num_workers)

    n = len(list(make()))
    assert_resumes_identically(make, [1, 4, 4, n, n + 2], total=n + 4)


@pytest.mark.parametrize("num_shards", [16, 10_000])
def test_state_is_a_few_hundred_bytes_at_any_number_of_shards(num_shards: int) -> None:
    sizes = [20] * num_shards
    loader = StreamLoader(windowed(sizes, 1000, known=True), batch_size=32, num_workers=0)
    batches = iter(loader)
    for _ in range(5):  # inside the first window, in the middle of a shard
        next(batches)
    state = loader.state_dict()
    assert state["slots"]["0"]["source"]["taken"] == 160
    assert len(json.dumps(state)) <= 1024


def test_a_restore_by_position_reads_only_the_records_it_hands_out() -> None:
    shards = MemoryShards([400, 400, 400])
    sizes = [400, 400, 400]

    def make(reader) -> Stream:
        return ShardedIterable(shards.names, read_shard=reader, seed=0, sizes=sizes).shuffle_window(500, seed=1)

    stream = make(shards)
    records = iter(stream)
    for _ in range(700):  # inside the second window
        next(records)
    counting = CountingReader(shards)
    restored = make(counting)
    restored.load_state_dict(stream.state_dict())
    resumed = iter(restored)
    assert [next(resumed) for _ in range(10)] == [next(records) for _ in range(10)]
    assert len(counting.offsets_read) <= 64  # one grouped fetch, not the 500-record window


def test_a_window_of_unknown_sizes_is_reread_from_its_start(tmp_path: Path) -> None:
    paths = []
    for s in range(3):
        path = tmp_path / f"part{s}.txt"
        path.write_text("".join(f"{s}-{i}\n" for i in range(30)))
        paths.append(path)

    def make() -> Stream:
        return ShardedIterable(paths, read_shard=TextLineReader(), seed=0).shuffle_window(20, seed=1)

    stream = make()
    records = iter(stream)
    for _ in range(25):
        next(records)
    state = json.loads(json.dumps(stream.state_dict()))
    assert state["count"] == 20 and state["taken"] == 5  # the second window, 5 records in
    restored = make()
    restored.load_state_dict(state)
    assert list(restored) == list(records)


@pytest.mark.parametrize(("old", "new"), [((2, 0), (3, 0)), ((1, 2), (1, 0)), ((3, 0), (1, 2))])
def test_layout_change_consumes_every_record_exactly_once(old, new) -> None:
    sizes = [10, 4, 13, 7, 9, 12]
    shards = MemoryShards(sizes)

    def make() -> Stream:
        return ShardedIterable(shards.names, read_shard=shards, seed=5, sizes=sizes).shuffle_window(6, seed=6)

    assert_exactly_once_across_layout_change(make, shards.all_records(), old, new, [3, 2, 4][: old[0]])


def test_a_window_read_from_unknown_sizes_refuses_a_layout_change() -> None:
    shards = MemoryShards([10, 10])
    loader = StreamLoader(
        ShardedIterable(shards.names, read_shard=shards, seed=0).shuffle_window(6), batch_size=2, world_size=1
    )
    next(iter(loader))
    other = StreamLoader(
        ShardedIterable(shards.names, read_shard=shards, seed=0).shuffle_window(6),
        batch_size=2,
        world_size=1,
        num_workers=2,
    )
    with pytest.raises(ResumeError, match="cannot be split over another number of workers or ranks"):
        other.load_state_dict(loader.state_dict())


def test_sizes_that_do_not_match_a_shard_are_refused_when_it_ends_early() -> None:
    shards = MemoryShards([5, 5])
    stream = ShardedIterable(shards.names, read_shard=shards, shuffle=False, sizes=[6, 5])
    with pytest.raises(ResumeError, match=r"shard 0 'm0' ended after 5 records, but sizes gives it 6"):
        list(stream)


def test_a_state_taken_right_after_a_shards_last_record_restores() -> None:
    # With known sizes the position then points into the next shard: the finished shard's
    # identity must not be left in the state (a restore would refuse it).
    shards = MemoryShards([4, 4])

    class Identified:
        def __call__(self, shard: str, start: int):
            return shards(shard, start)

        def identity(self, shard: str) -> str:
            return f"4:{shard}"

    def make() -> Stream:
        return ShardedIterable(shards.names, read_shard=Identified(), shuffle=False, sizes=[4, 4]).shuffle_buffer(2)

    stream = make()
    records = iter(stream)
    for _ in range(2):  # the buffer read 4 records: the first shard's last one
        next(records)
    restored = make()
    restored.load_state_dict(json.loads(json.dumps(stream.state_dict())))
    assert list(restored) == list(records)


@pytest.mark.parametrize("known", [True, False])
def test_each_windows_order_is_built_once(known: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A window of up to 2**14 records is an exact keyed shuffle whose table costs O(window) to
    # build: built per chunk of handed-out records it made an epoch O(records x window / chunk).
    import resumable_data.streams.window as window_module

    built: list[int] = []
    real = window_module.Permutation

    def counting(length: int, seed: int, epoch: int) -> object:
        built.append(length)
        return real(length, seed, epoch)

    monkeypatch.setattr(window_module, "Permutation", counting)
    records = list(windowed([900, 700, 400], 1000, known=known))
    assert len(records) == 2000
    assert built == [1000, 1000]
