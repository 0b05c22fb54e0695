"""Every stream stage resumes exactly: the resumed stream equals the uninterrupted one.

Shards live in memory here (tests/streams/test_readers.py covers files), 3 shards of 4 records,
2 epochs: a cut at every item count covers mid-shard, shard boundaries, the epoch end and the next
epoch; one more case resumes several times in a row.
"""

from __future__ import annotations

import itertools
import json
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness import assert_resumes_identically, consume
from resumable_data import ResumeError
from resumable_data.core.permutation import Permutation
from resumable_data.streams import IterableSource, ReplayWarning, ShardedIterable, Stream, mix
from resumable_data.streams.base import STREAM_STATE_VERSION
from streams_harness import MemoryShards

SIZES = [4, 4, 4]


def source(sizes=SIZES, *, seed: int = 0, shuffle: bool = True) -> ShardedIterable:
    shards = MemoryShards(sizes)
    return ShardedIterable(shards.names, read_shard=shards, shuffle=shuffle, seed=seed)


def noisy(x: int, g: torch.Generator) -> tuple[int, torch.Tensor]:
    return x, torch.rand(2, generator=g)


PIPELINES = {
    "source": lambda: source(),
    "map": lambda: source().map(lambda x: x * 2),
    "map_rng": lambda: source().map(noisy, seed=5),
    "filter": lambda: source().filter(lambda x: x % 3 != 0),
    "batch": lambda: source().batch(5),
    "shuffle_buffer": lambda: source().shuffle_buffer(3, seed=1),
    "mix": lambda: mix([source(), source([2, 5], seed=1)], weights=[1, 2], seed=3),
    "mix_shuffled": lambda: mix([source(), source([2, 5], seed=1)], seed=3).shuffle_buffer(3).map(noisy, seed=1),
    "take": lambda: source().take(7),
    "repeat": lambda: source().repeat(2),
    "foreign": lambda: IterableSource(list(range(10))),
    "composed": lambda: source().filter(lambda x: x % 5 != 0).shuffle_buffer(4, seed=2).map(noisy, seed=1).batch(3),
}


def stream_length(make) -> int:
    return len(consume(make(), epochs=2))


@pytest.mark.filterwarnings("ignore::resumable_data.streams.ReplayWarning")
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_resumes_identically_at_every_cut(name: str) -> None:
    make = PIPELINES[name]
    for cut in range(stream_length(make) + 1):
        assert_resumes_identically(make, [cut], epochs=2)


@pytest.mark.filterwarnings("ignore::resumable_data.streams.ReplayWarning")
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_resumes_identically_several_times_in_a_row(name: str) -> None:
    make = PIPELINES[name]
    n = stream_length(make)
    assert_resumes_identically(make, [1, 1, n // 3, n // 2, n // 2 + 1, n - 1, n], epochs=2)


@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    buffer=st.integers(1, 6),
    batch=st.integers(1, 4),
    seed=st.integers(0, 2**32),
    cuts=st.lists(st.integers(0, 60), max_size=4),
)
def test_composed_pipeline_resumes_for_any_configuration(sizes, buffer, batch, seed, cuts) -> None:
    def make() -> Stream:
        return (
            source(sizes, seed=seed)
            .filter(lambda x: x % 4 != 1)
            .shuffle_buffer(buffer, seed=seed)
            .map(noisy, seed=seed)
            .batch(batch)
        )

    n = stream_length(make)
    assert_resumes_identically(make, sorted(min(c, n) for c in cuts), epochs=2)


def test_each_epoch_reads_every_record_once_in_the_permutations_shard_order() -> None:
    stream = source([3, 1, 2, 2], seed=7)
    for epoch in range(3):
        stream.set_epoch(epoch)
        order = Permutation(4, 7, epoch)(torch.arange(4).numpy()).tolist()
        assert stream.shard_order(epoch) == order
        expected = [s * 1000 + i for s in order for i in range([3, 1, 2, 2][s])]
        assert list(stream) == expected


def test_unshuffled_golden_order() -> None:
    assert list(source([2, 1, 3], shuffle=False)) == [0, 1, 1000, 2000, 2001, 2002]


def test_map_randomness_depends_only_on_the_record() -> None:
    # The same record gets the same draw whatever came before it (here: a filter drops others).
    plain = dict(source().map(noisy, seed=9))
    filtered = dict(source().filter(lambda x: x % 2 == 0).map(noisy, seed=9))
    assert all(torch.equal(plain[k], v) for k, v in filtered.items())
    assert not torch.equal(plain[0], plain[1])


def test_filter_state_is_the_source_position_not_a_count() -> None:
    stream = source(shuffle=False).filter(lambda x: x == 2)
    assert next(iter(stream)) == 2
    assert stream.state_dict()["source"]["remaining"][0] == [0, "m0", 3]


def test_state_stays_small_however_many_records_are_consumed() -> None:
    stream = source([5000] * 20).shuffle_buffer(100, seed=0).map(noisy, seed=0)
    sizes = []
    iterator = iter(stream)
    for consumed in (200, 50_000):
        for _ in range(consumed - (200 if sizes else 0)):
            next(iterator)
        sizes.append(len(json.dumps(stream.state_dict())))
    assert sizes[1] - sizes[0] < 100  # only the digits of the cursors grow
    assert sizes[1] < 20 * 40 + 100 * 20 + 600  # ~40 B per shard + ~20 B per buffered key


def test_foreign_iterable_warns_that_it_replays() -> None:
    stream = IterableSource(list(range(10)), name="legacy")
    iterator = iter(stream)
    [next(iterator) for _ in range(4)]
    restored = IterableSource(list(range(10)), name="legacy")
    restored.load_state_dict(stream.state_dict())
    with pytest.warns(ReplayWarning, match=r"legacy cannot seek: resuming replays 4 records.*ShardedIterable"):
        assert list(restored) == list(range(4, 10))


def test_foreign_iterable_that_got_shorter_is_refused() -> None:
    restored = IterableSource([1, 2])
    restored.load_state_dict({"version": STREAM_STATE_VERSION, "epoch": 0, "consumed": 5})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplayWarning)
        with pytest.raises(ResumeError, match="ended after 2 records but the checkpoint had consumed 5"):
            list(restored)


def test_shuffle_buffer_refuses_a_source_that_cannot_reread_records() -> None:
    with pytest.raises(TypeError, match="re-read a record"):
        IterableSource([1, 2, 3]).shuffle_buffer(2)
    with pytest.raises(TypeError, match="re-read a record"):
        source().batch(2).shuffle_buffer(2)


# -- bad states: typed errors naming the field and both values; a failed load changes nothing ----
def consumed_pipeline() -> Stream:
    stream = source().shuffle_buffer(3, seed=1).map(noisy, seed=5)
    iterator = iter(stream)
    [next(iterator) for _ in range(5)]
    return stream


def renamed(state: dict) -> dict:
    state["source"]["source"]["remaining"][0][1] = "other"
    return state


def with_version(state: dict) -> dict:
    state["source"]["version"] = 99
    return state


def with_seed(state: dict) -> dict:
    state["source"]["seed"] = 2
    return state


def fewer_shards(state: dict) -> dict:
    state["source"]["source"]["num_shards"] = 2
    return state


def over_full_buffer(state: dict) -> dict:
    state["source"]["buffer"] *= 2
    return state


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (renamed, r"shard list differs.*checkpoint's shard \d+ 'other' \(cursor \d+\) is 'm\d'"),
        (with_version, "version 99"),
        (with_seed, "seed changed: checkpoint has 2, pipeline has 1"),
        (fewer_shards, "number of shards changed: checkpoint has 2, pipeline has 3"),
        (over_full_buffer, "holds 6 records but the buffer size is 3"),
    ],
)
def test_a_bad_state_is_refused_and_changes_nothing(corrupt, message: str) -> None:
    stream = consumed_pipeline()
    before = stream.state_dict()
    with pytest.raises(ResumeError, match=message):
        stream.load_state_dict(corrupt(json.loads(json.dumps(before))))
    assert stream.state_dict() == before


def test_a_different_shard_list_is_refused_naming_the_shard() -> None:
    state = consumed_pipeline().state_dict()
    other = MemoryShards([4, 4, 4, 4])
    stream = ShardedIterable(other.names, read_shard=other).shuffle_buffer(3, seed=1).map(noisy, seed=5)
    with pytest.raises(ResumeError, match="number of shards changed: checkpoint has 3, pipeline has 4"):
        stream.load_state_dict(state)


def test_set_epoch_keeps_a_restored_position_and_resets_otherwise() -> None:
    stream = consumed_pipeline()
    restored = source().shuffle_buffer(3, seed=1).map(noisy, seed=5)
    restored.load_state_dict(stream.state_dict())
    restored.set_epoch(0)
    assert restored.state_dict() == stream.state_dict()
    restored.set_epoch(1)
    assert restored.state_dict()["source"]["buffer"] == []


class _EndlessGuard:
    """``read_shard`` of an empty shard that fails the test instead of letting a spin go on forever."""

    def __init__(self, limit: int = 1000) -> None:
        self.limit, self.reads = limit, 0

    def __call__(self, shard: str, start: int):
        self.reads += 1
        if self.reads > self.limit:
            raise RuntimeError(f"read the empty shard {self.reads} times: repeat() spins without a record")
        return iter([])


def test_repeat_of_an_empty_source_ends_instead_of_spinning() -> None:
    guard = _EndlessGuard()
    assert list(ShardedIterable(["empty"], read_shard=guard).repeat()) == []
    assert guard.reads <= 3


def test_mix_with_an_empty_repeated_source_goes_on_with_the_others() -> None:
    guard = _EndlessGuard()
    empty = ShardedIterable(["empty"], read_shard=guard).repeat()
    mixed = mix([empty, source([2, 3])], seed=0)
    assert sorted(mixed) == sorted(source([2, 3]))
    assert guard.reads <= 3


def test_repeat_restored_at_the_end_of_a_round_goes_on_with_the_next_round() -> None:
    # A round that ends right after the checkpoint is not an empty round.
    stream = source([2]).repeat()
    first = [next(iter(stream)) for _ in range(2)]  # the whole first round (a new iter() continues)
    resumed = source([2]).repeat()
    resumed.load_state_dict(json.loads(json.dumps(stream.state_dict())))
    rest = list(itertools.islice(resumed, 4))
    assert sorted(first) == sorted(rest[:2]) == sorted(rest[2:])
