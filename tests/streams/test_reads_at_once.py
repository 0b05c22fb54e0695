"""How a shuffle window's re-reads use a reader that reads remote shards at once (``reads_concurrently``).

Specification: the records are those of a plain reader in the same order, whatever the reader
says about its shards. Reads that wait on the network run at once on other threads; reads of
shards the reader holds locally (``reads_locally``: a node-local cache) run in the calling thread,
where a few microseconds of work are not worth a thread hand-off. A fetch starts with the shard
read last, so a reader that holds one shard open moves to another once per fetch, not twice. A
reader that caches is told, with each plan, how many shards at its head the slot reads now by key
(``reading=``): every shard a re-read touches is among them, so prefetch counts the shards after.

The reader here computes its records and plays the network with shard names that are URLs.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_data.streams import ShardedIterable

SIZES = [37, 50, 23, 64, 41, 58, 30, 45]


def record(index: int, offset: int) -> int:
    return index * 1000 + offset


class Reader:
    """Records computed from (shard, offset); notes each ``read_records`` call's thread and each plan."""

    def __init__(self, urls: Sequence[str], *, concurrent: bool, local: set[str] | None = None) -> None:
        self.urls, self.local = list(urls), set(local or ())
        self.reads_concurrently = concurrent
        self.calls: list[tuple[int, bool]] = []  # (shard index, read in the calling thread)
        self.plans: list[tuple[list[int], int]] = []
        self.main = threading.current_thread()

    def __call__(self, shard: str, start: int) -> Iterator[int]:
        index = self.urls.index(shard)
        return (record(index, offset) for offset in range(start, SIZES[index]))

    def read_records(self, shard: str, offsets: Sequence[int]) -> list[int]:
        index = self.urls.index(shard)
        self.calls.append((index, threading.current_thread() is self.main))
        return [record(index, offset) for offset in offsets]

    def reads_locally(self, shard: str) -> bool:
        return shard in self.local

    def planner(self) -> Any:
        return self.plan

    def plan(self, upcoming: Sequence[str], *, reading: int = 0) -> None:
        self.plans.append(([self.urls.index(shard) for shard in upcoming], reading))


URLS = [f"s3://bucket/tokens/shard-{i:02d}.bin" for i in range(len(SIZES))]


def window_stream(reader: Reader, window: int, seed: int) -> Any:
    return ShardedIterable(URLS, read_shard=reader, sizes=SIZES, seed=seed).shuffle_window(window, seed=seed + 1)


def plain(window: int, seed: int) -> list[int]:
    return list(window_stream(Reader(URLS, concurrent=False), window, seed))


@settings(max_examples=40, deadline=None)
@given(
    window=st.integers(1, 200),
    seed=st.integers(0, 2**16),
    local=st.sets(st.sampled_from(range(len(URLS)))),
)
def test_reads_of_local_shards_stay_in_the_calling_thread_and_the_records_are_a_plain_readers(
    window: int, seed: int, local: set[int]
) -> None:
    reader = Reader(URLS, concurrent=True, local={URLS[i] for i in local})
    assert list(window_stream(reader, window, seed)) == plain(window, seed)
    off_thread = {index for index, here in reader.calls if not here}
    assert not off_thread & local, f"shards held locally were read on other threads: {sorted(off_thread & local)}"


def test_reads_that_wait_on_the_network_run_at_once_on_other_threads() -> None:
    reader = Reader(URLS, concurrent=True)
    assert list(window_stream(reader, 120, 5)) == plain(120, 5)
    assert any(not here for _, here in reader.calls), "no fetch spanning two remote shards read them at once"
    held = Reader(URLS, concurrent=True, local=set(URLS))
    assert list(window_stream(held, 120, 5)) == plain(120, 5)
    assert all(here for _, here in held.calls)


@pytest.mark.parametrize("window", [60, 150])
def test_a_fetch_starts_with_the_shard_read_last(window: int) -> None:
    reader = Reader(URLS, concurrent=True, local=set(URLS))
    stream = window_stream(reader, window, 9)
    fetches: list[list[int]] = []
    source = stream.source
    fetch_many = source.fetch_many

    def noted(keys: Sequence[Any]) -> list[Any]:
        start = len(reader.calls)
        records = fetch_many(keys)
        fetches.append([index for index, _ in reader.calls[start:]])
        return records

    source.fetch_many = noted  # what the window calls (its source is its positional view)
    assert list(stream) == plain(window, 9)
    tested = 0  # fetches from two shards or more, one of them the shard read last
    for before, now in itertools.pairwise(fetches):
        if before and before[-1] in now:
            assert now[0] == before[-1], f"a fetch of {now} began elsewhere than {before[-1]}, read last"
            tested += len(set(now)) > 1
    assert tested > 0, f"no fetch spanned two shards: {fetches}"


@pytest.mark.parametrize("window", [1, 60, 150, 400])
def test_every_shard_a_re_read_touches_is_among_those_the_plan_says_are_read_now(window: int) -> None:
    reader = Reader(URLS, concurrent=True, local=set(URLS))
    stream = window_stream(reader, window, 3)
    source = stream.source
    fetch_many = source.fetch_many
    checked = 0

    def checked_fetch(keys: Sequence[Any]) -> list[Any]:
        nonlocal checked
        records = fetch_many(keys)  # sends its plan first, then reads
        upcoming, reading = reader.plans[-1]
        assert {key[1] for key in keys} <= set(upcoming[:reading]), (keys[:5], upcoming, reading)
        checked += 1
        return records

    source.fetch_many = checked_fetch
    assert list(stream) == plain(window, 3)
    assert checked > 0
    # Read in order (no window), a slot uses the shard it enters: the plan says none is read by key.
    in_order = Reader(URLS, concurrent=True, local=set(URLS))
    expected = list(ShardedIterable(URLS, read_shard=Reader(URLS, concurrent=False), sizes=SIZES, seed=3))
    assert list(ShardedIterable(URLS, read_shard=in_order, sizes=SIZES, seed=3)) == expected
    assert in_order.plans and all(reading == 0 for _, reading in in_order.plans)
