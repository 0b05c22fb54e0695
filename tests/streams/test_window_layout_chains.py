"""shuffle_window with known sizes: chains of layout changes consume every record exactly once.

Specification: a ``shuffle_window`` over a ``ShardedIterable`` with ``sizes=`` may be resumed on
another number of ranks or workers, again and again within one epoch (2 -> 1 -> 2 ranks, ...),
wherever each checkpoint falls (inside a window of records held back at the previous change
too): every record of the epoch is handed out exactly once, behind a ``map`` too (it keeps the
positional reading). Over a source whose windows cannot be split (a ``filter``) the refusal names
what to do, not sizes= when sizes are given.
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

SIZES = [10, 4, 13, 7, 9, 12, 5]
Layout = tuple[int, int]  # (world size, workers per rank)


def windowed(shards: MemoryShards) -> Stream:
    return ShardedIterable(shards.names, read_shard=shards, seed=5, sizes=SIZES).shuffle_window(6, seed=6)


def plus_one(record: int) -> int:
    return record + 1


def mapped_windowed(shards: MemoryShards) -> Stream:
    return ShardedIterable(shards.names, read_shard=shards, seed=5, sizes=SIZES).map(plus_one).shuffle_window(6, seed=6)


def run_through(
    layouts: list[Layout], cuts: list[int], build: Callable[[MemoryShards], Stream] = windowed
) -> list[int]:
    """Records handed out by an epoch that changes layout at each checkpoint: the ranks of
    ``layouts[i]`` take ``cuts[i]`` batches each (the last layout: to the end)."""
    shards = MemoryShards(SIZES)
    seen: list[int] = []
    merged: dict[str, Any] | None = None
    for i, (world, workers) in enumerate(layouts):
        timeout = {"timeout": 60} if workers else {}  # a stuck worker fails the test
        ranks = [
            StreamLoader(build(shards), batch_size=2, rank=r, world_size=world, num_workers=workers, **timeout)
            for r in range(world)
        ]
        if merged is not None:
            for loader in ranks:
                loader.load_state_dict(merged)
        last = i == len(layouts) - 1
        seen += consume_ranks(ranks, [None if last else cuts[i]] * world)
        merged = json.loads(json.dumps(StreamLoader.merge_states([loader.state_dict() for loader in ranks])))
    return seen


@pytest.mark.parametrize("cuts", [[1, 1], [2, 3], [3, 1], [0, 2], [5, 4]])
def test_two_to_one_to_two_ranks_consumes_every_record_exactly_once(cuts: list[int]) -> None:
    seen = run_through([(2, 0), (1, 0), (2, 0)], cuts)
    assert Counter(seen) == Counter(MemoryShards(SIZES).all_records())


@settings(max_examples=25, deadline=None)
@given(
    layouts=st.lists(st.tuples(st.integers(1, 3), st.just(0)), min_size=3, max_size=4),
    cuts=st.lists(st.integers(0, 4), min_size=3, max_size=3),
)
def test_chains_of_layout_changes_consume_every_record_exactly_once(layouts, cuts) -> None:
    seen = run_through(layouts, cuts)
    assert Counter(seen) == Counter(MemoryShards(SIZES).all_records())


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    layouts=st.lists(st.tuples(st.integers(1, 2), st.integers(0, 2)), min_size=3, max_size=4),
    cuts=st.lists(st.integers(0, 4), min_size=3, max_size=3),
)
def test_chains_of_layout_changes_with_workers_consume_every_record_exactly_once(layouts, cuts) -> None:
    seen = run_through(layouts, cuts)
    assert Counter(seen) == Counter(MemoryShards(SIZES).all_records())


@pytest.mark.parametrize("cuts", [[1, 1], [3, 1], [5, 4]])
def test_a_window_read_through_a_map_is_split_over_layout_changes_exactly_once(cuts: list[int]) -> None:
    seen = run_through([(2, 0), (1, 0), (2, 0)], cuts, mapped_windowed)
    assert Counter(seen) == Counter(plus_one(r) for r in MemoryShards(SIZES).all_records())


def test_a_window_read_through_a_filter_refuses_a_layout_change_naming_the_stage() -> None:
    shards = MemoryShards(SIZES)

    def make(world: int) -> list[StreamLoader]:
        source = ShardedIterable(shards.names, read_shard=shards, seed=5, sizes=SIZES)
        return [
            StreamLoader(source.filter(lambda x: True).shuffle_window(6), batch_size=2, rank=r, world_size=world)
            for r in range(world)
        ]

    before = make(1)
    next(iter(before[0]))
    state = before[0].state_dict()
    with pytest.raises(ResumeError, match="only shuffle_window over a positional source") as raised:
        make(2)[0].load_state_dict(state)
    assert "unknown sizes" not in str(raised.value)
