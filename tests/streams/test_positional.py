"""The Positional capability: a source whose records are addressed by position gets the shuffles' fast paths.

Specification: a stage asks its source for ``positional()`` instead of testing its type, so

* a user's own source that implements the protocol (written here on the public API only) passes the
  same exactness tests as ``ShardedIterable`` with sizes, for ``shuffle_window`` and ``shuffle_buffer``:
  interrupted anywhere and restored, bitwise the uninterrupted run, with 0 and 2 workers;
* and takes the fast paths: a window's state says it is read by position and a restore reads only
  the records it hands out; a buffer fills with keys and reads about what its first draws need;
  the same source without the capability reads whole windows and buffers;
* ``map`` passes the capability through: ``ShardedIterable(...).map(f).shuffle_window(n)`` reads by
  position (it read whole windows before), yielding the records that reading yields, ``f``'s
  global-RNG draws included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_resumes_identically, consume
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, Stream, StreamLoader
from resumable_data.streams.base import Key, Slot
from streams_harness import CountingReader, MemoryShards

SIZES = [7, 3, 9, 4, 6, 5, 8]


class Records(Stream):
    """A user's own source of ``n`` records (record ``i`` is ``10 * i``): slot ``(s, S)`` reads records
    ``s, s + S, ...``; a key is ``(epoch, i)``, the state a position. It implements the Positional
    protocol (streams.positional) by returning itself from ``positional()``, and counts the records
    it reads, in order or by key."""

    POSITION_KEYS = frozenset({"epoch", "slot", "position"})

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.reads = 0
        self._slot: Slot = (0, 1)
        self._position = 0

    # -- the stage protocol ---------------------------------------------------------------------
    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        while self._position < self._length(self._slot):
            key = self.keys_at(np.array([self._position]))[0]
            self._position += 1
            self.reads += 1
            yield key, 10 * key[1]

    def reset(self, epoch: int, slot: Slot | None) -> None:
        self._epoch, self._slot, self._position = epoch, slot or self._slot, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "slot": self._slot[0], "num_slots": self._slot[1], "position": self._position}

    def check(self, state: Any) -> Callable[[], None]:
        fields = ("epoch", "slot", "num_slots", "position")
        if not isinstance(state, Mapping) or not all(isinstance(state.get(f), int) for f in fields):
            raise ResumeError(f"Records state needs the int fields {fields}, got {state!r}")
        slot = (state["slot"], state["num_slots"])
        if not 0 <= state["position"] <= self._length(slot):
            raise ResumeError(f"Records state is at position {state['position']}, past its slot's records")

        def apply() -> None:
            self._epoch, self._slot, self._position = state["epoch"], slot, state["position"]

        return apply

    def fetch(self, key: Key) -> Any:
        return self.fetch_many([key])[0]

    def fetch_many(self, keys: Any) -> list[Any]:
        self.reads += len(keys)
        return [10 * key[1] for key in keys]

    def saved_slots(self, state: Mapping[str, Any]) -> list[Slot]:
        return [(state["slot"], state["num_slots"])]

    def positional(self) -> Records:
        return self

    # -- the Positional protocol ----------------------------------------------------------------
    def _length(self, slot: Slot) -> int:
        return len(range(slot[0], self.n, slot[1]))

    @property
    def position(self) -> int:
        return self._position

    @property
    def pending_count(self) -> int:
        return 0  # this source cannot change layout: nothing is handed back to it

    def slot_length(self) -> int:
        return self._length(self._slot)

    def keys_at(self, positions: np.ndarray, state: Mapping[str, Any] | None = None) -> list[Key]:
        epoch, (s, num_slots) = self._epoch, self._slot
        if state is not None:
            epoch, s, num_slots = state["epoch"], state["slot"], state["num_slots"]
        return [(epoch, s + p * num_slots) for p in positions.tolist()]

    def seek(self, position: int) -> None:
        self._position = position

    def take_keys(self, count: int) -> list[Key]:
        stop = min(self._position + count, self.slot_length())
        keys = self.keys_at(np.arange(self._position, stop))
        self._position = stop
        return keys

    def take_pending(self, count: int) -> list[Key]:
        return []

    def saved_position(self, state: Mapping[str, Any]) -> int:
        position: int = state["position"]
        return position

    def split_pending(self, state: Mapping[str, Any], count: int) -> tuple[list[Key], dict[str, Any]] | None:
        return ([], dict(state)) if count == 0 else None


class RecordsWithoutTheCapability(Records):
    """The same source, not offering the capability: the shuffles read it in order."""

    def positional(self) -> None:  # type: ignore[override]
        return None


def source(kind: str) -> Stream:
    if kind == "user's own":
        return Records(sum(SIZES))
    shards = MemoryShards(SIZES)
    return ShardedIterable(shards.names, read_shard=shards, seed=3, sizes=SIZES)


def shuffled(kind: str, shuffle: str, size: int = 5) -> Stream:
    stream = source(kind)
    return stream.shuffle_window(size, seed=1) if shuffle == "window" else stream.shuffle_buffer(size, seed=1)


SOURCES = ["ShardedIterable", "user's own"]


@pytest.mark.parametrize("shuffle", ["window", "buffer"])
@pytest.mark.parametrize("kind", SOURCES)
@settings(max_examples=15, deadline=None)
@given(size=st.integers(1, 12), cuts=st.lists(st.integers(0, 100), min_size=1, max_size=3))
def test_resumes_identically_anywhere_over_either_source(kind: str, shuffle: str, size: int, cuts: list[int]) -> None:
    def make() -> Stream:
        return shuffled(kind, shuffle, size)

    total = len(consume(make(), epochs=2))
    assert_resumes_identically(make, sorted(min(c, total) for c in cuts), epochs=2)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle", ["window", "buffer"])
@pytest.mark.parametrize("kind", SOURCES)
def test_loader_resumes_identically_over_either_source(kind: str, shuffle: str, num_workers: int) -> None:
    timeout = {"timeout": 60} if num_workers else {}  # a stuck worker fails the test

    def make() -> StreamLoader:
        return StreamLoader(shuffled(kind, shuffle), batch_size=2, num_workers=num_workers, **timeout)

    n = len(list(make()))
    assert_resumes_identically(make, [1, 4, n, n + 2], total=n + 4)


@pytest.mark.parametrize("offers", [True, False], ids=["positional", "without the capability"])
def test_a_user_sources_window_is_read_by_position_and_restored_reading_only_what_it_hands_out(offers: bool) -> None:
    kind = Records if offers else RecordsWithoutTheCapability

    def make(user_source: Records) -> Stream:
        return user_source.shuffle_window(500, seed=1)

    stream = make(kind(1200))
    records = iter(stream)
    for _ in range(700):  # inside the second window
        next(records)
    state = stream.state_dict()
    assert state["positional"] is offers
    restored_source = kind(1200)
    restored = make(restored_source)
    restored.load_state_dict(state)
    resumed = iter(restored)
    assert [next(resumed) for _ in range(10)] == [next(records) for _ in range(10)]
    if offers:
        assert restored_source.reads <= 64  # one grouped fetch, not the 500-record window
    else:
        assert restored_source.reads == 500  # the window read again from its start


@pytest.mark.parametrize("offers", [True, False], ids=["positional", "without the capability"])
def test_a_user_sources_buffer_fills_with_keys(offers: bool) -> None:
    user_source = Records(2000) if offers else RecordsWithoutTheCapability(2000)
    first = next(iter(user_source.shuffle_buffer(1000, seed=1)))
    assert first == next(iter(Records(2000).shuffle_buffer(1000, seed=1)))
    if offers:
        assert user_source.reads <= 128  # the records of the first draws, read by key
    else:
        assert user_source.reads == 1001  # the whole buffer, then the record that replaces the first


def noisy(record: int) -> int:
    """A map drawing from the global RNG: below a window it is seeded per record, so a record read
    by position (fetched by key) gets the draw it gets when read in order."""
    return record * 1000 + int(torch.randint(0, 1000, ()))


def mapped_window(reader: Any, *, known: bool = True) -> Stream:
    shards = MemoryShards([400, 400, 400])
    source = ShardedIterable(shards.names, read_shard=reader, seed=0, sizes=[400] * 3 if known else None)
    return source.map(noisy).shuffle_window(500, seed=1)


def test_a_map_below_shuffle_window_keeps_the_positional_fast_path() -> None:
    shards = MemoryShards([400, 400, 400])
    stream = mapped_window(shards)
    records = iter(stream)
    for _ in range(700):  # inside the second window
        next(records)
    state = stream.state_dict()
    assert state["positional"] is True, "the window over map(f) was read whole, not by position"
    counting = CountingReader(shards)
    restored = mapped_window(counting)
    restored.load_state_dict(state)
    resumed = iter(restored)
    assert [next(resumed) for _ in range(10)] == [next(records) for _ in range(10)]
    assert len(counting.offsets_read) <= 64  # one grouped fetch, not the 500-record window


def test_a_map_below_shuffle_window_yields_by_position_what_reading_yields() -> None:
    shards = MemoryShards([400, 400, 400])
    assert list(mapped_window(shards)) == list(mapped_window(shards, known=False))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_map_below_shuffle_window_resumes_identically_through_the_loader(num_workers: int) -> None:
    shards = MemoryShards([40, 30, 50])
    timeout = {"timeout": 60} if num_workers else {}

    def make() -> StreamLoader:
        source = ShardedIterable(shards.names, read_shard=shards, seed=0, sizes=[40, 30, 50])
        return StreamLoader(
            source.map(noisy).shuffle_window(16, seed=1), batch_size=4, num_workers=num_workers, **timeout
        )

    n = len(list(make()))
    assert_resumes_identically(make, [1, 5, n, n + 2], total=n + 4)
