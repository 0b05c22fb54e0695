"""mix with a weight schedule: weights as a function of the records drawn, at no cost to the state.

Specification: a piecewise schedule draws with each piece's weights from its count on (a weight of
0 never picks its source while another running source has weight > 0); a function of the count
and the same pieces written as a list give the same stream, and fixed weights are a one-piece
schedule; each source yields each of its records exactly once per epoch, whatever the schedule
(sources left only at weight 0 still run out); a resume anywhere (pack per source; StreamLoader
with 0 and 2 workers) is bitwise the uninterrupted run; a layout change consumes every record
exactly once and goes on at the old slots' mean count; a changed schedule or a bad one is refused.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_resumes_identically, consume
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, Stream, StreamLoader, mix
from streams_harness import MemoryShards, TokenDocs, consume_ranks

WEIGHT = st.sampled_from([0.0, 0.5, 1.0, 3.0])


def schedules(n: int) -> st.SearchStrategy[list[tuple[int, list[float]]]]:
    """Piecewise schedules over ``n`` sources: counts from 0 up, weights not all 0 in a piece."""
    piece = st.lists(WEIGHT, min_size=n, max_size=n).filter(lambda w: sum(w) > 0)
    return st.lists(st.tuples(st.integers(1, 12), piece), min_size=1, max_size=4).map(
        lambda pieces: [(sum(gap for gap, _ in pieces[:i]), w) for i, (_, w) in enumerate(pieces)]
    )


def sources(sizes: list[list[int]]) -> list[MemoryShards]:
    """One in-memory source per size list, records offset by 100_000 per source (so each names its source)."""
    shards = []
    for k, per_shard in enumerate(sizes):
        source = MemoryShards(per_shard)
        source.records = {name: [r + 100_000 * k for r in records] for name, records in source.records.items()}
        shards.append(source)
    return shards


def mixture(sizes: list[list[int]], weights: Any, *, known: bool = False) -> Callable[[], Stream]:
    def make() -> Stream:
        streams = [
            ShardedIterable(s.names, read_shard=s, seed=k, sizes=per if known else None)
            for k, (s, per) in enumerate(zip(sources(sizes), sizes, strict=True))
        ]
        return mix(streams, weights, seed=7)

    return make


def as_function(pieces: list[tuple[int, list[float]]]) -> Callable[[int], list[float]]:
    def weights(drawn: int) -> list[float]:
        return [w for start, w in pieces if start <= drawn][-1]

    return weights


def test_a_piecewise_schedule_draws_with_each_pieces_weights_from_its_count_on() -> None:
    make = mixture([[30, 20], [25]], [(0, [1, 0]), (10, [0, 1]), (20, [1, 1])])
    got = [r // 100_000 for r in make()]
    assert got[:10] == [0] * 10  # source 1 at weight 0
    assert got[10:20] == [1] * 10  # source 0 at weight 0
    assert sorted(Counter(got).items()) == [(0, 50), (1, 25)]
    # [3, 1] over 400 draws: about three quarters from source 0 (a check that the weights matter).
    long = [r // 100_000 for r in mixture([[400], [400]], [(0, [3, 1])])()][:400]
    assert 0.65 < long.count(0) / 400 < 0.85


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=3), min_size=1, max_size=3),
    data=st.data(),
)
def test_each_source_yields_each_record_once_per_epoch_whatever_the_schedule(sizes, data) -> None:
    pieces = data.draw(schedules(len(sizes)))
    make = mixture(sizes, pieces)
    expected = Counter(r for s in sources(sizes) for r in s.all_records())
    for epoch in range(2):
        stream = make()
        stream.set_epoch(epoch)
        assert Counter(stream) == expected
    # The same pieces as a function of the count: the same stream.
    assert list(make()) == list(mixture(sizes, as_function(pieces))())


def test_fixed_weights_are_a_one_piece_schedule() -> None:
    sizes = [[20, 5], [13]]
    assert list(mixture(sizes, [1, 2])()) == list(mixture(sizes, [(0, [1, 2])])())


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.lists(st.integers(0, 12), max_size=5), min_size=1, max_size=3),
    block=st.integers(1, 6),
    callable_=st.booleans(),
    data=st.data(),
)
def test_packed_sources_with_a_schedule_resume_identically_anywhere(lengths, block, callable_, data) -> None:
    pieces = data.draw(schedules(2))
    cuts = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=3))

    def make() -> Stream:
        docs = TokenDocs(lengths)
        packed = [ShardedIterable(docs.names, read_shard=docs, seed=k).pack(block, eos=0) for k in range(2)]
        return mix(packed, as_function(pieces) if callable_ else pieces, seed=3)

    total = len(consume(make(), epochs=2))
    assert_resumes_identically(make, sorted(min(c, total) for c in cuts), epochs=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_loader_with_a_schedule_resumes_identically(num_workers: int) -> None:
    make_mix = mixture([[30, 20, 11], [25, 9]], [(0, [1, 0]), (6, [1, 3]), (15, [2, 1])])

    def make() -> StreamLoader:
        return StreamLoader(make_mix().shuffle_buffer(5, seed=1), batch_size=3, num_workers=num_workers)

    assert_resumes_identically(make, [2, 5, 6], total=40)


def test_a_layout_change_consumes_every_record_once_and_goes_on_at_the_mean_count() -> None:
    sizes = [[30, 20, 11, 4], [25, 9, 16]]
    make_mix = mixture(sizes, [(0, [1, 0]), (8, [1, 3])], known=True)
    before = [StreamLoader(make_mix(), batch_size=3, rank=r, world_size=2) for r in range(2)]
    seen = consume_ranks(before, [2, 3])  # 6 and 9 records drawn
    merged = json.loads(json.dumps(StreamLoader.merge_states([b.state_dict() for b in before])))
    after = [StreamLoader(make_mix(), batch_size=3, rank=r, world_size=3) for r in range(3)]
    for loader in after:
        loader.load_state_dict(merged)
    assert [loader.state_dict()["slots"][str(r)]["source"]["draws"] for r, loader in enumerate(after)] == [7] * 3
    seen += consume_ranks(after, [None] * 3)
    assert Counter(seen) == Counter(r for s in sources(sizes) for r in s.all_records())


def test_a_changed_schedule_is_refused_naming_weights() -> None:
    sizes = [[10], [10]]
    stream = mixture(sizes, [(0, [1, 0]), (5, [1, 1])])()
    list(itertools.islice(stream, 3))
    for other in ([(0, [1, 0]), (6, [1, 1])], [1, 1], as_function([(0, [1, 0])])):
        with pytest.raises(ResumeError, match="weights changed"):
            mixture(sizes, other)().load_state_dict(stream.state_dict())


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([(1, [1, 1])], "start at 0"),
        ([(0, [1, 1]), (0, [1, 2])], "increase"),
        ([(0, [1, 1, 1])], "must be 2"),
        ([(0, [0, 0])], "not all 0"),
        ([(0, [1, -1])], ">= 0"),
        ([(0, [1, float("nan")])], "finite"),
        ([0, 1], "positive"),
        ([(0, [1, 1]), 3], "pairs"),
    ],
)
def test_a_bad_schedule_is_refused(weights: Any, message: str) -> None:
    with pytest.raises(ResumeError, match=message):
        mixture([[3], [3]], weights)()


def test_a_function_returning_bad_weights_is_refused_at_that_count() -> None:
    stream = mixture([[5], [5]], lambda drawn: [1, 1] if drawn < 3 else [0, 0])()
    with pytest.raises(ResumeError, match="at 3 records drawn"):
        list(stream)
