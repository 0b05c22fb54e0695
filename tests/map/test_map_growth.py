"""Growing datasets: a checkpoint loads into a loader over a longer dataset as ``growth=`` says.

The specification (see ``resumable_data.core.growth``):

* ``"next_epoch"``: the rest of the restored epoch is exactly the uninterrupted run's rest of that
  epoch over the old dataset; the next epoch is a permutation of the whole new dataset.
* ``"append"``: the rest of the restored epoch holds every unconsumed old index once, then every
  new index once; the next epoch is a permutation of the whole new dataset.
* either way, a checkpoint taken after the growth resumes bitwise (into the same data, or into
  data that has grown again), at any world size; a shorter dataset is refused and the loader is
  left as it was.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_resumes_identically, checkpoint_roundtrip, json_roundtrip
from resumable_data import ResumableDataLoader, ResumableSampler, ResumeError
from resumable_data.testing import assert_same


def _loaders(length: int, world: int, batch_size: int, **kwargs: Any) -> list[ResumableDataLoader]:
    return [
        ResumableDataLoader(torch.arange(length), batch_size=batch_size, seed=7, rank=r, world_size=world, **kwargs)
        for r in range(world)
    ]


def _checkpoint(length: int, world: int, batch_size: int, batches: int) -> tuple[dict[str, Any], list[int]]:
    """Every rank of a world takes ``batches`` batches: the (common) state and the indices consumed."""
    consumed: list[int] = []
    states = []
    for loader in _loaders(length, world, batch_size):
        consumed += [i for batch in itertools.islice(loader, batches) for i in batch.tolist()]
        states.append(loader.state_dict())
    assert all(state == states[0] for state in states)
    return json_roundtrip(states[0]), consumed


def _global_pass(loaders: list[ResumableDataLoader]) -> list[int]:
    """One pass of every rank (the rest of the current epoch), put back in global position order:
    rank ``r``'s ``j``-th sample sits at ``start + r + j * world``."""
    start, world = loaders[0].sampler.cursor.next_segment()[1], len(loaders)
    flat = [[i for batch in loader for i in batch.tolist()] for loader in loaders]
    order: dict[int, int] = {}
    for r, samples in enumerate(flat):
        for j, index in enumerate(samples):
            order[start + r + j * world] = index
    assert sorted(order) == list(range(start, start + len(order)))
    return [order[q] for q in sorted(order)]


_SIZES = {
    "length": st.integers(1, 40),
    "grown_by": st.integers(1, 30),
    "world": st.integers(1, 4),
    "new_world": st.integers(1, 4),
    "batch_size": st.integers(1, 5),
    "fraction": st.floats(0, 1),
}


@settings(max_examples=40, deadline=None)
@given(**_SIZES)
def test_append_takes_every_unconsumed_and_every_new_index_once_in_the_restored_epoch(
    length: int, grown_by: int, world: int, new_world: int, batch_size: int, fraction: float
) -> None:
    full = _loaders(length, world, batch_size)[0].__len__()
    batches = min(full, int(fraction * (full + 1)))
    state, consumed = _checkpoint(length, world, batch_size, batches)
    grown = length + grown_by
    loaders = _loaders(grown, new_world, batch_size, growth="append")
    for loader in loaders:
        loader.load_state_dict(state)
    following = rest = _global_pass(loaders)
    if batches < full:  # (an epoch that was over stays over: the new samples join at the next one)
        unconsumed = sorted(set(range(length)) - set(consumed))
        assert len(consumed) == len(set(consumed)) == length - len(unconsumed)
        exact = rest[: len(unconsumed) + grown_by]
        assert sorted(exact[: len(unconsumed)]) == unconsumed  # the old order's rest first
        assert sorted(exact[len(unconsumed) :]) == list(range(length, grown))  # then the new samples
        assert len(rest) - len(exact) < new_world  # only the padded tail beyond that
        following = _global_pass(loaders)
    # The next epoch: a permutation of the whole grown dataset.
    assert sorted(following[:grown]) == list(range(grown))
    assert all(loader.epoch == state["epoch"] + 1 for loader in loaders)


@settings(max_examples=40, deadline=None)
@given(**_SIZES)
def test_next_epoch_finishes_the_checkpoints_order_then_covers_the_grown_dataset(
    length: int, grown_by: int, world: int, new_world: int, batch_size: int, fraction: float
) -> None:
    full = _loaders(length, world, batch_size)[0].__len__()
    batches = min(full, int(fraction * (full + 1)))
    state, _ = _checkpoint(length, world, batch_size, batches)
    # The uninterrupted run over the old dataset, restored at the same world size as the new run.
    reference = _loaders(length, new_world, batch_size)
    for loader in reference:
        loader.load_state_dict(state)
    grown = length + grown_by
    loaders = _loaders(grown, new_world, batch_size, growth="next_epoch")
    for loader in loaders:
        loader.load_state_dict(state)
        assert len(loader) == len(reference[0])  # the restored epoch keeps the checkpoint's length
    if batches < full:  # (an epoch that was over stays over)
        assert _global_pass(loaders) == _global_pass(reference)
    following = _global_pass(loaders)
    assert sorted(following[:grown]) == list(range(grown))
    assert len(loaders[0]) == len(_loaders(grown, new_world, batch_size)[0])
    # ... and the next epoch is that of a loader that always had the grown dataset.
    fresh = _loaders(grown, new_world, batch_size)
    for loader in fresh:
        loader.set_epoch(state["epoch"] + 1)
    assert following == _global_pass(fresh)


@settings(max_examples=25, deadline=None)
@given(
    length=st.integers(1, 30),
    grown_by=st.integers(1, 20),
    batch_size=st.integers(1, 4),
    fraction=st.floats(0, 1),
    cuts=st.lists(st.integers(0, 25), min_size=1, max_size=3),
    growth=st.sampled_from(["append", "next_epoch"]),
)
def test_a_checkpoint_taken_after_a_growth_resumes_bitwise(
    length: int, grown_by: int, batch_size: int, fraction: float, cuts: list[int], growth: str
) -> None:
    full = -(-length // batch_size)
    state, _ = _checkpoint(length, 1, batch_size, min(full - 1, int(fraction * full)))
    grown = length + grown_by

    def restored() -> ResumableDataLoader:
        loader = ResumableDataLoader(torch.arange(grown), batch_size=batch_size, seed=7, growth=growth)
        loader.load_state_dict(state)
        return loader

    total = 2 * -(-grown // batch_size) + 2  # the rest of the grown epoch and the next one
    assert_resumes_identically(
        restored,
        sorted(min(c, total) for c in cuts),
        total,
        make_resumed=lambda: ResumableDataLoader(torch.arange(grown), batch_size=batch_size, seed=7),
    )


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.tuples(st.integers(1, 30), st.integers(1, 20), st.integers(1, 20)),
    fractions=st.tuples(st.floats(0, 0.99), st.floats(0, 0.99)),
    worlds=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
)
def test_append_twice_in_one_epoch_still_takes_every_index_once(
    lengths: tuple[int, int, int], fractions: tuple[float, float], worlds: tuple[int, int, int]
) -> None:
    """Grown, checkpointed again mid-epoch, and loaded into a dataset grown once more."""
    sizes = list(itertools.accumulate(lengths))
    samplers = [ResumableSampler(sizes[0], seed=3, rank=r, world_size=worlds[0]) for r in range(worlds[0])]
    consumed: list[int] = []
    for leg in range(2):
        take = int(fractions[leg] * samplers[0].rank_samples(samplers[0].epoch, samplers[0].position))
        for sampler in samplers:
            consumed += list(itertools.islice(iter(sampler), take))
        state = checkpoint_roundtrip(samplers[0].state_dict())
        world = worlds[leg + 1]
        samplers = [
            ResumableSampler(sizes[leg + 1], seed=3, rank=r, world_size=world, growth="append") for r in range(world)
        ]
        for sampler in samplers:
            sampler.load_state_dict(state)
    assert samplers[0].state_dict()["epoch_lengths"] == sizes
    start, world = samplers[0].position, len(samplers)
    rest = {start + r + j * world: i for r, s in enumerate(samplers) for j, i in enumerate(s)}
    exact = [rest[q] for q in range(start, sizes[-1])]
    assert sorted(consumed + exact) == list(range(sizes[-1]))


@pytest.mark.parametrize("growth", ["append", "next_epoch"])
def test_growth_with_two_workers_yields_the_same_batches_as_without(growth: str) -> None:
    state, _ = _checkpoint(23, 1, 4, 2)

    def restored(workers: int) -> list[list[int]]:
        loader = ResumableDataLoader(torch.arange(31), batch_size=4, seed=7, growth=growth, num_workers=workers)
        loader.load_state_dict(state)
        batches = [b.tolist() for b in loader]
        return batches + [b.tolist() for b in loader]  # and the next epoch

    assert_same(restored(0), restored(2), "batches with 2 workers")


def test_len_follows_the_restored_epoch_then_the_grown_dataset() -> None:
    state, _ = _checkpoint(10, 1, 3, 1)
    appended = ResumableDataLoader(torch.arange(16), batch_size=3, seed=7, growth="append")
    appended.load_state_dict(state)
    assert len(appended) == 6 and len(iter(appended)) == 5  # 16 samples in this epoch; 3 were consumed
    later = ResumableDataLoader(torch.arange(16), batch_size=3, seed=7, growth="next_epoch")
    later.load_state_dict(state)
    assert len(later) == 4 and len(iter(later)) == 3  # the checkpoint's 10 samples
    later.set_epoch(1)
    assert len(later) == 6 and later.state_dict()["version"] == 2  # the whole dataset, the plain state


def test_without_a_growth_policy_a_longer_dataset_is_refused_with_the_remedy() -> None:
    state, _ = _checkpoint(10, 1, 3, 1)
    loader = ResumableDataLoader(torch.arange(12), batch_size=3, seed=7)
    before = loader.state_dict()
    with pytest.raises(ResumeError, match=r"checkpoint has 10, ResumableDataLoader has 12.*growth='next_epoch'"):
        loader.load_state_dict(state)
    assert loader.state_dict() == before


@pytest.mark.parametrize("growth", ["error", "append", "next_epoch"])
def test_a_shrunk_dataset_is_refused_and_leaves_the_loader_unchanged(growth: str) -> None:
    state, _ = _checkpoint(10, 1, 3, 1)
    grown = ResumableDataLoader(torch.arange(14), batch_size=3, seed=7, growth="append")
    grown.load_state_dict(state)
    next(iter(grown))
    after_growth = grown.state_dict()
    for shorter in (9, 13):  # shorter than the first checkpoint, and than the grown one
        loader = ResumableDataLoader(torch.arange(shorter), batch_size=3, seed=7, growth=growth)
        take = list(itertools.islice(iter(loader), 1))
        before = loader.state_dict()
        with pytest.raises(ResumeError, match=r"dataset length changed: checkpoint has 1[04].*may grow.*not shrink"):
            loader.load_state_dict(state if shorter == 9 else after_growth)
        assert loader.state_dict() == before
        assert [b.tolist() for b in itertools.islice(iter(loader), 1)] != [b.tolist() for b in take]  # it goes on


def test_a_damaged_epoch_lengths_field_is_refused() -> None:
    state, _ = _checkpoint(10, 1, 3, 1)
    grown = ResumableSampler(14, seed=7, growth="append")
    grown.load_state_dict(state)
    saved = grown.state_dict()
    for bad in ([], [10, 10], [14, 10], [10, 15], [0, 14], "10", [True]):
        twin = ResumableSampler(14, seed=7)
        with pytest.raises(ResumeError, match="epoch_lengths"):
            twin.load_state_dict({**saved, "epoch_lengths": bad})
        assert twin.state_dict() == ResumableSampler(14, seed=7).state_dict()


def test_an_unknown_growth_policy_is_refused() -> None:
    with pytest.raises(ResumeError, match="growth should be one of 'error', 'next_epoch', 'append'"):
        ResumableDataLoader(torch.arange(4), growth="sooner")
