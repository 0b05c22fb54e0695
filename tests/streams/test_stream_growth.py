"""Growing shard lists: shards appended to a ShardedIterable join as ``growth=`` says.

The specification (see ``resumable_data.core.growth``):

* ``"next_epoch"``: the rest of the restored epoch is exactly the uninterrupted run's rest over the
  checkpoint's shards; the next epoch reads every record of every shard once.
* ``"append"``: the rest of the restored epoch reads every unread record of the old shards and
  every record of the new ones exactly once, at any new world size; the next epoch every record.
* the old shards' cursors are intact; with known sizes the state stays a position; a checkpoint
  taken after a growth resumes bitwise (and loads into a list grown once more).
* shards removed, renamed or reordered, or an old shard's size changed, are refused, naming the
  field, and the pipeline is left as it was.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_resumes_identically, consume, epoch_loop, json_roundtrip
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, Stream, StreamLoader
from resumable_data.testing import assert_same
from streams_harness import MemoryShards, consume_ranks, ids


def _pipeline(shards: MemoryShards, count: int, *, known: bool, shuffle: str = "none", growth: str = "error") -> Stream:
    """A pipeline over the first ``count`` shards of ``shards``."""
    sizes = [len(shards.records[name]) for name in shards.names[:count]] if known else None
    stream: Stream = ShardedIterable(shards.names[:count], read_shard=shards, seed=5, sizes=sizes, growth=growth)
    if shuffle == "window":
        stream = stream.shuffle_window(4, seed=6)
    elif shuffle == "buffer":
        stream = stream.shuffle_buffer(4, seed=6)
    return stream


def _records(shards: MemoryShards, count: int) -> Counter[int]:
    return Counter(r for name in shards.names[:count] for r in shards.records[name])


def _loaders(make: Callable[[], Stream], world: int, workers: int = 0) -> list[StreamLoader]:
    return [StreamLoader(make(), batch_size=3, rank=r, world_size=world, num_workers=workers) for r in range(world)]


def _merged(loaders: list[StreamLoader]) -> dict[str, Any]:
    return json.loads(json.dumps(StreamLoader.merge_states([loader.state_dict() for loader in loaders])))


_GROWTH_CASES = {
    "old": st.lists(st.integers(0, 10), min_size=1, max_size=5),
    "new": st.lists(st.integers(0, 10), min_size=1, max_size=4),
    "known": st.booleans(),
    "shuffle": st.sampled_from(["none", "window", "buffer"]),
    "worlds": st.tuples(st.integers(1, 3), st.integers(1, 3)),
    "cut": st.integers(0, 6),
}


@settings(max_examples=30, deadline=None)
@given(**_GROWTH_CASES)
def test_append_reads_every_unread_old_record_and_every_new_record_once_in_the_restored_epoch(
    old: list[int], new: list[int], known: bool, shuffle: str, worlds: tuple[int, int], cut: int
) -> None:
    shards = MemoryShards(old + new)
    before = _loaders(lambda: _pipeline(shards, len(old), known=known, shuffle=shuffle), worlds[0])
    seen = consume_ranks(before, [cut] * worlds[0])
    after = _loaders(
        lambda: _pipeline(shards, len(shards.names), known=known, shuffle=shuffle, growth="append"), worlds[1]
    )
    for loader in after:
        loader.load_state_dict(_merged(before))
    seen += consume_ranks(after, [None] * worlds[1])
    assert Counter(seen) == _records(shards, len(shards.names))
    for loader in after:  # the next epoch reads every record of every shard
        loader.set_epoch(loader.epoch + 1)
    assert Counter(consume_ranks(after, [None] * worlds[1])) == _records(shards, len(shards.names))


@settings(max_examples=30, deadline=None)
@given(**_GROWTH_CASES)
def test_next_epoch_finishes_the_checkpoints_epoch_as_the_uninterrupted_run_then_reads_every_shard(
    old: list[int], new: list[int], known: bool, shuffle: str, worlds: tuple[int, int], cut: int
) -> None:
    shards = MemoryShards(old + new)
    before = _loaders(lambda: _pipeline(shards, len(old), known=known, shuffle=shuffle), worlds[0])
    seen = consume_ranks(before, [cut] * worlds[0])
    state = _merged(before)
    # The run over the old shards, restored into the same layout as the grown one.
    reference = _loaders(lambda: _pipeline(shards, len(old), known=known, shuffle=shuffle), worlds[1])
    after = _loaders(
        lambda: _pipeline(shards, len(shards.names), known=known, shuffle=shuffle, growth="next_epoch"), worlds[1]
    )
    for loader in reference + after:
        loader.load_state_dict(state)
    rest = [consume_ranks([loader], [None]) for loader in after]
    assert rest == [consume_ranks([loader], [None]) for loader in reference]
    assert Counter(seen + [i for r in rest for i in r]) == _records(shards, len(old))
    for loader in after:
        loader.set_epoch(loader.epoch + 1)
    assert Counter(consume_ranks(after, [None] * worlds[1])) == _records(shards, len(shards.names))


@settings(max_examples=25, deadline=None)
@given(
    old=st.lists(st.integers(1, 8), min_size=1, max_size=4),
    new=st.lists(st.integers(1, 8), min_size=1, max_size=3),
    known=st.booleans(),
    growth=st.sampled_from(["append", "next_epoch"]),
    first=st.integers(0, 20),
    cuts=st.lists(st.integers(0, 60), min_size=1, max_size=3),
)
def test_a_checkpoint_taken_after_a_growth_resumes_bitwise(
    old: list[int], new: list[int], known: bool, growth: str, first: int, cuts: list[int]
) -> None:
    shards = MemoryShards(old + new)
    stream = _pipeline(shards, len(old), known=known, shuffle="buffer")
    items = epoch_loop(stream, 1)
    for _ in zip(range(first), items, strict=False):
        pass
    state = json_roundtrip(stream.state_dict())

    def restored() -> Stream:
        grown = _pipeline(shards, len(shards.names), known=known, shuffle="buffer", growth=growth)
        grown.load_state_dict(state)
        return grown

    total = len(consume(restored(), 2))
    assert_resumes_identically(
        restored,
        sorted(min(c, total) for c in cuts),
        epochs=2,
        make_resumed=lambda: _pipeline(shards, len(shards.names), known=known, shuffle="buffer"),
    )


@pytest.mark.parametrize("known", [False, True])
def test_append_twice_in_one_epoch_still_reads_every_record_once(known: bool) -> None:
    shards = MemoryShards([5, 7, 3, 6, 4, 8, 2])
    seen: list[int] = []
    loaders = _loaders(lambda: _pipeline(shards, 3, known=known, shuffle="buffer"), 2)
    for count, world in ((5, 3), (7, 1)):
        seen += consume_ranks(loaders, [2] * len(loaders))
        state = _merged(loaders)
        loaders = _loaders(lambda c=count: _pipeline(shards, c, known=known, growth="append", shuffle="buffer"), world)
        for loader in loaders:
            loader.load_state_dict(state)
    seen += consume_ranks(loaders, [None])
    assert Counter(seen) == _records(shards, 7)
    assert loaders[0].state_dict()["slots"]["0"]["source"]["source"]["epoch_shards"] == [3, 5, 7]


def test_with_known_sizes_the_grown_state_stays_a_position_and_the_old_cursor_is_intact() -> None:
    shards = MemoryShards([6, 6, 6])
    stream = _pipeline(shards, 2, known=True)
    records = iter(stream)
    first = [next(records) for _ in range(4)]
    state = stream.state_dict()
    grown = _pipeline(shards, 3, known=True, growth="append")
    grown.load_state_dict(state)
    saved = grown.state_dict()
    assert saved["position"] == state["position"] == 4 and "remaining" not in saved
    assert (saved["version"], saved["epoch_shards"], saved["num_shards"]) == (3, [2, 3], 3)
    rest = list(grown)
    old = [r for name in shards.names[:2] for r in shards.records[name]]
    assert rest[: len(old) - 4] == list(stream)  # the old shards' rest first, from the same cursor
    assert sorted(first + rest) == sorted(old + shards.records["m2"])


def test_growth_with_two_workers_resumes_bitwise() -> None:
    shards = MemoryShards([9, 7, 8, 6, 10])
    before = _loaders(lambda: _pipeline(shards, 3, known=True, shuffle="window"), 1, workers=2)
    consumed = consume_ranks(before, [3])
    state = _merged(before)

    def restored() -> StreamLoader:
        loader = _loaders(lambda: _pipeline(shards, 5, known=True, shuffle="window", growth="append"), 1, workers=2)[0]
        loader.load_state_dict(state)
        return loader

    reference = ids(restored())
    loader = restored()
    taken = ids(batch for _, batch in zip(range(2), loader, strict=False))
    resumed = StreamLoader(_pipeline(shards, 5, known=True, shuffle="window"), batch_size=3, num_workers=2)
    resumed.load_state_dict(json_roundtrip(loader.state_dict()))
    assert_same(reference, taken + ids(resumed), "resumed after a growth, 2 workers")
    assert Counter(consumed + reference) == _records(shards, 5)


def _refused(make: Callable[[], Stream], state: dict[str, Any], match: str) -> None:
    stream = make()
    next(iter(stream))
    before = stream.state_dict()
    with pytest.raises(ResumeError, match=match):
        stream.load_state_dict(state)
    assert stream.state_dict() == before


@pytest.mark.parametrize("known", [False, True])
@pytest.mark.parametrize("growth", ["error", "append", "next_epoch"])
def test_shards_removed_renamed_reordered_or_resized_are_refused_and_change_nothing(known: bool, growth: str) -> None:
    shards = MemoryShards([4, 5, 6, 7])
    stream = _pipeline(shards, 3, known=known)
    records = iter(stream)
    next(records)
    state = stream.state_dict()
    names, read = shards.names, shards

    def make(order: list[str], sizes: list[int] | None = None) -> Callable[[], Stream]:
        known_sizes = sizes or [len(shards.records.get(n, [0] * 5)) for n in order]
        return lambda: ShardedIterable(
            order, read_shard=read, seed=5, sizes=known_sizes if known else None, growth=growth
        )

    _refused(make(names[:2]), state, "number of shards changed: checkpoint has 3, pipeline has 2.*not removed")
    _refused(make([names[1], names[0], names[2]]), state, "shard list")  # reordered, same count
    _refused(make([names[1], names[0], names[2], names[3]]), state, "shard list|number of shards changed")
    _refused(make([names[0], "other", names[2], names[3]]), state, "shard list|number of shards changed")
    if known:
        _refused(make(names, [4, 5, 5, 7]), state, "shard sizes|number of shards changed")
    if growth == "error":
        _refused(make(names), state, "number of shards changed: checkpoint has 3, pipeline has 4.*growth='next_epoch'")


def test_a_damaged_epoch_shards_field_is_refused() -> None:
    shards = MemoryShards([4, 5, 6])
    stream = _pipeline(shards, 2, known=True)
    next(iter(stream))
    grown = _pipeline(shards, 3, known=True, growth="append")
    grown.load_state_dict(stream.state_dict())
    saved = grown.state_dict()
    for bad in ([], [2, 2], [3, 2], [2, 4], [0, 3], "3", None):
        _refused(lambda: _pipeline(shards, 3, known=True), {**saved, "epoch_shards": bad}, "epoch_shards")


def test_an_unknown_growth_policy_is_refused() -> None:
    with pytest.raises(ResumeError, match="growth should be one of"):
        ShardedIterable(["a"], read_shard=lambda shard, start: iter(()), growth="sooner")
