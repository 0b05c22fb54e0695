"""A layout change over shards of known sizes: computed from the old slots' positions, never listed.

Specification: across one or more changes of world size or num_workers in an epoch, every record is
consumed exactly once; each new slot's state is a position plus the old slots' positions (a few
bytes per old slot, not a cursor per shard), so it stays small at 10^4 shards; a ``dealt`` field
that does not fit the shards is refused, naming it, and changes nothing.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, Stream, StreamLoader
from streams_harness import MemoryShards, consume_ranks


def sized(shards: MemoryShards, sizes: list[int], shuffle: str, size: int) -> Callable[[], Stream]:
    def make() -> Stream:
        stream: Stream = ShardedIterable(shards.names, read_shard=shards, seed=5, sizes=sizes)
        if shuffle == "window":
            stream = stream.shuffle_window(size, seed=6)
        elif shuffle == "buffer":
            stream = stream.shuffle_buffer(size, seed=6)
        return stream

    return make


def through_layouts(make: Callable[[], Stream], layouts: list[tuple[int, int]], cuts: list[int]) -> list[int]:
    """Records consumed by each layout in turn (``cuts[i]`` batches per rank of layout ``i``, the last
    to the end of the epoch), each layout loading the merged state of the one before."""
    seen: list[int] = []
    merged: dict[str, Any] | None = None
    for i, (world, workers) in enumerate(layouts):
        loaders = [
            StreamLoader(make(), batch_size=3, rank=r, world_size=world, num_workers=workers) for r in range(world)
        ]
        for loader in loaders:
            if merged is not None:
                loader.load_state_dict(merged)
        last = i == len(layouts) - 1
        seen += consume_ranks(loaders, [None] * world if last else [cuts[i]] * world)
        merged = json.loads(json.dumps(StreamLoader.merge_states([loader.state_dict() for loader in loaders])))
    return seen


@settings(max_examples=20, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 15), min_size=1, max_size=8),
    worlds=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    shuffle=st.sampled_from(["none", "window", "buffer"]),
    size=st.integers(1, 8),
    cuts=st.lists(st.integers(0, 5), min_size=3, max_size=3),
)
def test_every_record_once_across_several_layout_changes(sizes, worlds, shuffle, size, cuts) -> None:
    shards = MemoryShards(sizes)
    seen = through_layouts(sized(shards, sizes, shuffle, size), [(w, 0) for w in worlds], cuts)
    assert Counter(seen) == Counter(shards.all_records())


def test_every_record_once_when_num_workers_changes_twice() -> None:
    sizes = [10, 4, 13, 7, 9, 12]
    shards = MemoryShards(sizes)
    seen = through_layouts(sized(shards, sizes, "window", 5), [(1, 2), (2, 0), (1, 2)], [3, 2])
    assert Counter(seen) == Counter(shards.all_records())


def test_a_new_slots_state_is_a_position_at_any_number_of_shards() -> None:
    sizes = [10] * 10_000
    shards = MemoryShards(sizes)
    make = sized(shards, sizes, "none", 1)
    old = [StreamLoader(make(), batch_size=32, rank=r, world_size=2) for r in range(2)]
    consume_ranks(old, [300, 300])  # 960 shards read by each rank, one of them partly
    merged = StreamLoader.merge_states([loader.state_dict() for loader in old])
    new = StreamLoader(make(), batch_size=32, rank=0, world_size=3)
    new.load_state_dict(merged)
    state = new.state_dict()["slots"]["0"]["source"]  # the ShardedIterable under batching
    assert "remaining" not in state and state["position"] == 0
    assert state["dealt"] == [[2, [9600, 9600]]]
    assert len(json.dumps(new.state_dict())) <= 1024
    next(iter(new))
    assert len(json.dumps(new.state_dict())) <= 1024


def test_a_dealt_position_beyond_the_old_slots_records_is_refused_and_changes_nothing() -> None:
    sizes = [5, 5, 5, 5]
    shards = MemoryShards(sizes)
    make = sized(shards, sizes, "none", 1)
    old = [StreamLoader(make(), batch_size=2, rank=r, world_size=2) for r in range(2)]
    consume_ranks(old, [1, 1])
    new = StreamLoader(make(), batch_size=2, rank=0, world_size=3)
    new.load_state_dict(StreamLoader.merge_states([loader.state_dict() for loader in old]))
    state = new.state_dict()
    state["slots"]["0"]["source"]["dealt"] = [[2, [2, 11]]]  # old slot 1 read 2 shards of 5 records: at most 10
    fresh = StreamLoader(make(), batch_size=2, rank=0, world_size=3)
    before = fresh.state_dict()
    with pytest.raises(ResumeError, match=r"'dealt': old slot 1 of 2 is at position 11, but its shards hold 10"):
        fresh.load_state_dict(state)
    assert fresh.state_dict() == before
