"""A whole list of saved record keys is checked in bulk exactly as key by key.

A shuffle buffer's restore checks every buffered key against the source's state (thousands of
them), so ``ShardedIterable.keys_checker`` compares them as one array. The property: for any list
of keys, the bulk check refuses exactly when some key is refused on its own, with the same message
(the first bad key's), and accepts otherwise.
"""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable
from resumable_data.streams.shuffle import ShuffleBuffer
from streams_harness import MemoryShards

SHARDS = MemoryShards([5, 7, 0, 6])


def midway(consumed: int, pending: list[list[int]]) -> tuple[ShardedIterable, dict[str, Any]]:
    """A stream and its state after ``consumed`` records (plus the given pending records)."""
    stream = ShardedIterable(SHARDS.names, read_shard=SHARDS, seed=3)
    list(itertools.islice(iter(stream), consumed))
    state = stream.state_dict()
    state["pending"] = pending
    return stream, state


def one_by_one(stream: ShardedIterable, state: dict[str, Any], keys: list[tuple[Any, ...]]) -> str | None:
    check = stream.key_checker(state)
    try:
        for key in keys:
            check(key)
    except ResumeError as e:
        return str(e)
    return None


def in_bulk(stream: ShardedIterable, state: dict[str, Any], keys: list[tuple[Any, ...]]) -> str | None:
    try:
        stream.keys_checker(state)(keys)
    except ResumeError as e:
        return str(e)
    return None


field = st.one_of(st.integers(-2, 8), st.just(2**63 - 1), st.just(2**64), st.just(1.0))
key = st.one_of(
    st.tuples(st.integers(0, 1), st.integers(-1, 4), st.integers(-1, 8)),  # mostly plausible
    st.tuples(field, field, field),
    st.tuples(st.integers(0, 1), st.integers(0, 3)),  # wrong length
)


@settings(max_examples=300, deadline=None)
@given(
    consumed=st.integers(0, 18),
    pending=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6)).map(list), max_size=2, unique_by=tuple),
    keys=st.lists(key, max_size=12),
    with_state=st.booleans(),
)
def test_bulk_key_check_agrees_with_the_key_by_key_one(
    consumed: int, pending: list[list[int]], keys: list[tuple[Any, ...]], with_state: bool
) -> None:
    stream, state = midway(consumed, [])
    checked: dict[str, Any] | None = None
    if with_state:
        try:
            stream.check({**state, "pending": pending})
            checked = {**state, "pending": pending}
        except ResumeError:
            checked = state  # an impossible pending record: use the state without it
    assert in_bulk(stream, checked, keys) == one_by_one(stream, checked, keys)
    # As a shuffle buffer's restore passes them: parsed from a state's lists, types checked there.
    try:
        parsed = ShuffleBuffer._buffered_keys({"buffer": [list(key) for key in keys]})
    except ResumeError:
        return  # not a list of int keys: the buffer refuses it before the source sees it
    assert in_bulk(stream, checked, parsed) == one_by_one(stream, checked, parsed)


def test_the_bulk_check_accepts_every_record_read_so_far() -> None:
    stream, state = midway(11, [])
    read = [(state["epoch"], index, offset) for index, offset in records_read(11)]
    assert len(read) == 11
    stream.keys_checker(state)(read)  # no error
    epoch, index, offset = read[0]
    bad = [*read, (epoch + 1, index, offset)]
    assert in_bulk(stream, state, bad) == one_by_one(stream, state, bad) is not None


def records_read(consumed: int) -> list[tuple[int, int]]:
    """(shard index, offset) of the first ``consumed`` records of an uninterrupted run."""
    stream = ShardedIterable(SHARDS.names, read_shard=SHARDS, seed=3)
    return [(key[1], key[2]) for key, _ in itertools.islice(stream.iter_keyed(), consumed)]
