"""A ``.map(fn)`` drawing from the global RNGs resumes exactly wherever it sits in the pipeline.

Specification: a map without ``seed=`` whose ``fn`` draws from torch's, numpy's and python's global
RNGs, placed before or after any stage that re-reads records (``pack``, ``shuffle_buffer``,
``batch_by_tokens`` with and without ``bucket``, ``shuffle_window`` by position and by reading),
gives bitwise the same records and the same augmentation values after any number of restores as an
uninterrupted run, with 0 and 2 workers. A re-read record is mapped again under its own
randomness, not under the batch that re-reads it: below a re-reading stage the map seeds the global
RNGs from the record's key (and puts them back), so the draws of a map above it are untouched.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_resumes_identically
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, Stream, StreamLoader, mix
from streams_harness import MemoryShards, TokenDocs

LENGTHS = [[5, 17, 3, 9, 1, 30], [12, 4, 8], [7, 7, 7, 2], [25, 3], [6, 11, 2]]

# Re-reading stages, each as it is appended to a pipeline of token records; those that end in
# batches (batch_by_tokens) are last, and the loader then takes batch_size=None.
STAGES: dict[str, Callable[[Stream], Stream]] = {
    "pack": lambda s: s.pack(6),
    "shuffle_buffer": lambda s: s.shuffle_buffer(4, seed=3),
    "shuffle_window": lambda s: s.shuffle_window(4, seed=4),
    "batch_by_tokens": lambda s: s.batch_by_tokens(30, collate_fn=list),
    "bucket": lambda s: s.batch_by_tokens(30, bucket=4, seed=5, collate_fn=list),
}
BATCHING = ("batch_by_tokens", "bucket")


def augment(doc: Any) -> torch.Tensor:
    """A random crop plus a token recording one draw of each global RNG: any other draw shows."""
    tokens = torch.as_tensor(doc, dtype=torch.int64)
    drawn = [int(torch.randint(0, 100, (1,))), int(np.random.randint(0, 100)), random.randrange(100)]
    keep = sum(drawn) % (len(tokens) + 1)
    return torch.cat([tokens[:keep], torch.tensor([10**9 + drawn[0] * 10**4 + drawn[1] * 100 + drawn[2]])])


def augment_batch(batch: list[Any]) -> list[Any]:
    """A global-RNG map after batching: the same draws on every record of the batch."""
    return [augment(doc) for doc in batch]


def build(stages: list[str], known: bool, num_workers: int) -> Callable[[], StreamLoader]:
    """A loader over ``stages`` in order, where ``"map"`` is the global-RNG map."""

    def make() -> StreamLoader:
        docs = TokenDocs(LENGTHS)
        stream: Stream = ShardedIterable(docs.names, read_shard=docs, seed=1, sizes=docs.sizes if known else None)
        batched = False
        for stage in stages:
            if stage == "map":
                stream = stream.map(augment_batch if batched else augment)
            else:
                stream = STAGES[stage](stream)
                batched = batched or stage in BATCHING
        options: dict[str, Any] = {"timeout": 60} if num_workers else {}  # a stuck worker fails the test
        if not batched:
            options.update(batch_size=2, collate_fn=list)  # records of any length
        return StreamLoader(stream, num_workers=num_workers, **options)

    return make


def epoch_length(make: Callable[[], StreamLoader]) -> int:
    return sum(1 for _ in make())


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_global_rng_map_before_a_rereading_stage_resumes_identically(stage: str) -> None:
    make = build(["map", stage], known=stage == "shuffle_window", num_workers=0)
    n = epoch_length(make)
    # Every batch boundary of the epoch, one restore after another, then into the next epoch.
    assert_resumes_identically(make, list(range(1, n + 1)), total=n + 3)


def test_a_global_rng_map_before_a_window_read_from_its_source_resumes_identically() -> None:
    make = build(["map", "shuffle_window"], known=False, num_workers=0)
    n = epoch_length(make)
    assert_resumes_identically(make, list(range(1, n + 1)), total=n + 3)


def keep_some(doc: Any) -> bool:
    return random.random() < 0.7


@pytest.mark.parametrize(("stage", "known"), [("shuffle_window", False), ("bucket", True)])
def test_a_global_rng_filter_below_a_stage_reading_a_window_again_resumes_identically(stage: str, known: bool) -> None:
    def make() -> StreamLoader:
        docs = TokenDocs(LENGTHS)
        source = ShardedIterable(docs.names, read_shard=docs, seed=1, sizes=docs.sizes if known else None)
        stream = STAGES[stage](source.filter(keep_some).map(augment))
        return StreamLoader(stream, **({} if stage in BATCHING else {"batch_size": 2, "collate_fn": list}))

    n = epoch_length(make)
    assert_resumes_identically(make, list(range(1, n + 1)), total=n + 3)


def test_a_global_rng_map_draws_per_record_randomness_below_a_rereading_stage() -> None:
    # The re-read record is mapped under its own key, so its values do not depend on which batch
    # (or worker, or number of restores) maps it; the global RNGs are put back after each record.
    docs = TokenDocs(LENGTHS)
    stream = ShardedIterable(docs.names, read_shard=docs, seed=1).map(augment).shuffle_buffer(4)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    mapped = {tuple(t.tolist()) for t in stream}
    assert torch.equal(torch.get_rng_state(), before)
    again = ShardedIterable(docs.names, read_shard=docs, seed=1).map(augment).shuffle_buffer(4, seed=9)
    assert {tuple(t.tolist()) for t in again} == mapped  # the same values for each record, in any order


@pytest.mark.parametrize("stages", [["map", "shuffle_buffer", "map", "pack"], ["map", "bucket"]], ids=str)
def test_a_global_rng_map_resumes_identically_with_workers(stages: list[str]) -> None:
    make = build(stages, known=False, num_workers=2)
    n = epoch_length(make)
    assert_resumes_identically(make, [1, n // 2, n // 2 + 1], total=n + 2)


def pipelines() -> st.SearchStrategy[list[str]]:
    """One or two re-reading stages (a shuffle below any one), with global-RNG maps between any."""
    fetchable = ["shuffle_buffer", "shuffle_window"]  # those that can have a re-reading stage above
    chains = st.tuples(st.lists(st.sampled_from(fetchable), max_size=1), st.sampled_from(list(STAGES))).map(
        lambda t: [*t[0], t[1]]
    )

    @st.composite
    def with_maps(draw: Any) -> list[str]:
        chain = draw(chains)
        gaps = draw(st.lists(st.booleans(), min_size=len(chain) + 1, max_size=len(chain) + 1))
        if not any(gaps[:-1]):  # at least one map below a re-reading stage
            gaps[draw(st.integers(0, len(chain) - 1))] = True
        out: list[str] = []
        for gap, stage in zip(gaps, [*chain, None], strict=True):
            out += ["map"] if gap else []
            out += [stage] if stage is not None else []
        return out

    return with_maps()


def matrix_case(stages: list[str], known: bool, num_workers: int, cuts: list[int]) -> None:
    make = build(stages, known, num_workers)
    n = epoch_length(make)
    assert_resumes_identically(make, sorted(min(c, n + 1) for c in cuts), total=n + 2)


@settings(max_examples=25, deadline=None)
@given(stages=pipelines(), known=st.booleans(), cuts=st.lists(st.integers(0, 20), min_size=1, max_size=3))
def test_every_stage_order_with_a_global_rng_map_resumes_identically(stages, known, cuts) -> None:
    matrix_case(stages, known, 0, cuts)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(stages=pipelines(), known=st.booleans(), cuts=st.lists(st.integers(0, 20), min_size=1, max_size=3))
def test_every_stage_order_with_a_global_rng_map_resumes_identically_wider(stages, known, cuts) -> None:
    matrix_case(stages, known, 0, cuts)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(stages=pipelines(), known=st.booleans(), cuts=st.lists(st.integers(0, 20), min_size=1, max_size=2))
def test_every_stage_order_with_a_global_rng_map_resumes_identically_with_workers(stages, known, cuts) -> None:
    matrix_case(stages, known, 2, cuts)


def seed_seen(doc: Any) -> int:
    """The seed torch's global RNG was last seeded with when ``fn`` runs: per record, or the batch's."""
    return torch.initial_seed()


def test_global_rng_none_skips_the_per_record_seeding_and_the_default_seeds_each_record() -> None:
    # Below a re-reading stage the default map runs each record under a seed of its own (the same
    # whatever the buffer's order); with global_rng=None (the caller's promise that fn draws
    # nothing) it runs under what the loader seeded for the batch.
    def seeds(global_rng: str | None, buffer_seed: int) -> list[list[int]]:
        docs = TokenDocs(LENGTHS)
        source = ShardedIterable(docs.names, read_shard=docs, seed=1)
        stream = source.map(seed_seen, global_rng=global_rng).shuffle_buffer(4, seed=buffer_seed)
        return [list(batch) for batch in StreamLoader(stream, batch_size=4, collate_fn=list)]

    per_record = seeds("record", 0)
    records = sum(map(len, per_record))
    assert len(set(itertools.chain.from_iterable(per_record))) == records
    assert sorted(itertools.chain.from_iterable(seeds("record", 9))) == sorted(
        itertools.chain.from_iterable(per_record)
    )
    per_batch = seeds(None, 0)
    # A batch maps the records it pulls into the buffer: all of them under that batch's seed.
    assert len(set(itertools.chain.from_iterable(per_batch))) <= len(per_batch)
    assert not set(itertools.chain.from_iterable(per_batch)) & set(itertools.chain.from_iterable(per_record))


def test_a_deterministic_map_with_global_rng_none_before_pack_resumes_identically() -> None:
    def make() -> StreamLoader:
        docs = TokenDocs(LENGTHS)
        stream = ShardedIterable(docs.names, read_shard=docs, seed=1).map(list, global_rng=None).pack(6)
        return StreamLoader(stream, batch_size=2, collate_fn=list)

    n = epoch_length(make)
    assert_resumes_identically(make, list(range(1, n + 1)), total=n + 3)


@pytest.mark.parametrize("stage", ["map", "filter"])
def test_global_rng_takes_record_or_none(stage: str) -> None:
    docs = TokenDocs(LENGTHS)
    source = ShardedIterable(docs.names, read_shard=docs, seed=1)
    with pytest.raises(
        ResumeError, match=rf"{stage}\(global_rng=...\) should be 'record' or None .*, but got global_rng='batch'"
    ):
        getattr(source, stage)(bool, global_rng="batch")


def test_two_mixed_sources_with_the_same_keys_get_their_own_draws() -> None:
    # Found in review: the per-record seed was the map's depth and the record's key, and two mixed
    # sources over shards of the same layout have the same keys: each record of one source got the
    # very draws of its twin in the other (correlated augmentations across the mixed datasets).
    def branch() -> Stream:
        shards = MemoryShards((6, 6))
        source = ShardedIterable(shards.names, read_shard=shards, shuffle=False)
        return source.map(lambda record: torch.rand(()).item())

    draws: dict[int, set[float]] = {0: set(), 1: set()}
    for key, draw in mix([branch(), branch()], [1, 1], seed=0).shuffle_buffer(4, seed=1).iter_keyed():
        assert key is not None
        draws[key[1]].add(draw)  # a mix's key: (epoch, source, ...the source's key)
    assert len(draws[0]) == len(draws[1]) == 12
    assert not draws[0] & draws[1]
