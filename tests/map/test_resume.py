"""ResumableDataLoader resumes exactly: the resumed stream equals the uninterrupted one, bitwise,
into the following epoch, for any configuration and interruption point."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harness import NoisyIndexDataset, assert_resumes_identically, checkpoint_roundtrip, take
from resumable_data import ResumableDataLoader


def _loader(
    length: int,
    batch_size: int,
    *,
    shuffle: bool,
    drop_last: bool,
    rank: int,
    world_size: int,
    num_workers: int,
    seed: int = 3,
    **kwargs,
) -> ResumableDataLoader:
    return ResumableDataLoader(
        NoisyIndexDataset(length),
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        rank=rank,
        world_size=world_size,
        drop_last=drop_last,
        num_workers=num_workers,
        **kwargs,
    )


@st.composite
def configurations(draw: st.DrawFn, workers: tuple[int, ...]) -> dict:
    world_size = draw(st.integers(1, 4))
    config = dict(
        length=draw(st.integers(1, 40)),
        batch_size=draw(st.integers(1, 6)),
        shuffle=draw(st.booleans()),
        drop_last=draw(st.booleans()),
        world_size=world_size,
        rank=draw(st.integers(0, world_size - 1)),
        num_workers=draw(st.sampled_from(workers)),
    )
    return config


def _epoch_batches(config: dict) -> int:
    return len(_loader(**config))


@st.composite
def interruption_plans(draw: st.DrawFn, epoch_batches: int) -> list[int]:
    """Cuts that include the special points: 0, mid-epoch, last batch, epoch end, second epoch."""
    special = [0, epoch_batches // 2, max(epoch_batches - 1, 0), epoch_batches, epoch_batches + 1]
    point = st.one_of(st.sampled_from(special), st.integers(0, 2 * epoch_batches))
    return sorted(draw(st.lists(point, min_size=1, max_size=3)))


@settings(max_examples=200)
@given(data=st.data())
def test_resumed_stream_equals_uninterrupted_single_process(data: st.DataObject) -> None:
    config = data.draw(configurations(workers=(0,)))
    n = _epoch_batches(config)
    assume(n > 0)
    cuts = data.draw(interruption_plans(n))
    # Compare into the epoch after the last cut's epoch: where peers diverge.
    total = (cuts[-1] // n + 2) * n
    assert_resumes_identically(lambda: _loader(**config), cuts, total)


@settings(max_examples=10)
@given(data=st.data())
def test_resumed_stream_equals_uninterrupted_with_workers(data: st.DataObject) -> None:
    _check_resume_with_workers(data)


@pytest.mark.slow
@settings(max_examples=60)
@given(data=st.data())
def test_resumed_stream_equals_uninterrupted_with_workers_more_examples(data: st.DataObject) -> None:
    _check_resume_with_workers(data)


def _check_resume_with_workers(data: st.DataObject) -> None:
    config = data.draw(configurations(workers=(2,)))
    n = _epoch_batches(config)
    assume(n > 0)
    cuts = data.draw(interruption_plans(n))
    resumed_workers = data.draw(st.sampled_from([0, 2]))
    persistent = data.draw(st.booleans())
    total = (cuts[-1] // n + 2) * n
    resumed = {**config, "num_workers": resumed_workers}
    extra = dict(persistent_workers=True) if persistent else {}
    extra_resumed = dict(persistent_workers=True) if persistent and resumed_workers else {}
    assert_resumes_identically(
        lambda: _loader(**config, prefetch_factor=3, **extra),
        cuts,
        total,
        make_resumed=lambda: _loader(**resumed, **extra_resumed),
    )


@pytest.mark.parametrize("cuts", [[0], [5], [9], [10], [10, 10], [3, 12, 17], [10, 20, 25]])
def test_named_interruption_points(cuts: list[int]) -> None:
    # 20 samples / batch 2 = 10 batches: 0, mid-epoch, last batch, epoch end, three resumes in a row.
    make = lambda: _loader(20, 2, shuffle=True, drop_last=False, rank=0, world_size=1, num_workers=0)
    assert_resumes_identically(make, cuts, 30)


def test_prefetched_batches_do_not_count_in_the_state() -> None:
    # Workers prefetch up to num_workers * prefetch_factor batches ahead; only yielded ones count.
    loader = _loader(64, 4, shuffle=True, drop_last=False, rank=0, world_size=1, num_workers=2, prefetch_factor=4)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    assert loader.state_dict()["position"] == 12


def test_state_after_last_batch_starts_the_next_epoch_not_an_extra_one() -> None:
    make = lambda: _loader(12, 4, shuffle=True, drop_last=False, rank=0, world_size=1, num_workers=0)
    loader = make()
    epoch0 = take(loader, 3)
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (0, 12)
    resumed = make()
    resumed.load_state_dict(checkpoint_roundtrip(state))
    first = next(iter(resumed))
    assert resumed.epoch == 1
    assert torch.equal(first[0], take(make(), 4)[3][0])
    assert not torch.equal(first[0], epoch0[0][0])


def test_set_epoch_loops_resume_mid_epoch_and_at_epoch_end() -> None:
    # A DistributedSampler-style loop: set_epoch(epoch) at the top of every epoch.
    def run(loader: ResumableDataLoader, epochs: range, stop_after: int | None = None) -> list:
        out = []
        for epoch in epochs:
            loader.set_epoch(epoch)
            for batch in loader:
                out.append(batch[0])
                if stop_after is not None and len(out) == stop_after:
                    return out
        return out

    make = lambda: _loader(10, 3, shuffle=True, drop_last=False, rank=0, world_size=1, num_workers=0)
    reference = run(make(), range(3))
    for stop in (2, 4, 5):  # mid-epoch, last batch of epoch 0 (4 batches/epoch), first of epoch 1
        loader = make()
        first_leg = run(loader, range(3), stop_after=stop)
        state = checkpoint_roundtrip(loader.state_dict())
        resumed = make()
        resumed.load_state_dict(state)
        second_leg = run(resumed, range(state["epoch"], 3))
        assert [t.tolist() for t in first_leg + second_leg] == [t.tolist() for t in reference], stop


def test_reiterating_after_a_break_continues_the_epoch() -> None:
    make = lambda: _loader(16, 2, shuffle=True, drop_last=False, rank=0, world_size=1, num_workers=2)
    reference = take(make(), 8)
    loader = make()
    got = []
    for batch in loader:
        got.append(batch)
        if len(got) == 3:
            break
    got.extend(loader)  # a new iter(): continues after the last batch handed out
    assert [b[0].tolist() for b in got] == [b[0].tolist() for b in reference]


def test_augmentations_are_identical_for_any_num_workers() -> None:
    make = lambda w: _loader(30, 4, shuffle=True, drop_last=False, rank=0, world_size=1, num_workers=w)
    single, multi = take(make(0), 16), take(make(2), 16)
    for a, b in zip(single, multi, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_iterating_does_not_touch_the_global_rng() -> None:
    # Model randomness (dropout) must not depend on how many times the loader was iterated.
    torch.manual_seed(0)
    before = torch.get_rng_state()
    take(_loader(10, 3, shuffle=True, drop_last=False, rank=0, world_size=1, num_workers=2), 8)
    assert torch.equal(torch.get_rng_state(), before)


def test_restore_fetches_no_consumed_sample() -> None:
    class Counting(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.fetched: list[int] = []

        def __len__(self) -> int:
            return 10_000

        def __getitem__(self, index: int) -> int:
            self.fetched.append(index)
            return index

    dataset = Counting()
    loader = ResumableDataLoader(dataset, batch_size=8, seed=1)
    state = {**loader.state_dict(), "position": 9_000}
    loader.load_state_dict(state)
    batch = next(iter(loader))
    # Only the 8 samples of the first resumed batch were read, none of the 9,000 consumed ones.
    assert dataset.fetched == batch.tolist()
    assert len(dataset.fetched) == 8


# -- set_epoch means "the next pass is that epoch from its start" -----------------------------------------
@pytest.mark.parametrize("limit", [None, 2], ids=["full", "limit_val_batches"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_repeated_validation_passes_with_set_epoch_of_the_same_epoch_are_full_and_equal(
    limit: int | None, num_workers: int
) -> None:
    # Lightning calls set_epoch(current_epoch) on a validation loader before each pass, several times
    # per epoch with val_check_interval, and stops early with limit_val_batches. Found on main: every
    # second pass was empty (set_epoch on a finished epoch kept its end).
    loader = _loader(10, 3, shuffle=True, drop_last=False, rank=0, world_size=1, num_workers=num_workers)
    passes = []
    for _ in range(3):
        loader.set_epoch(0)
        batches = []
        for batch in loader:
            batches.append(batch[0].tolist())
            if len(batches) == limit:
                break
        passes.append(batches)
    assert len(passes[0]) == (limit or 4) and passes == [passes[0]] * 3
    loader.set_epoch(1)
    assert [batch[0].tolist() for batch in loader] != passes[0], "another epoch, another order"


def test_set_epoch_after_a_break_starts_the_epoch_and_a_plain_iter_continues_it() -> None:
    make = lambda: _loader(12, 2, shuffle=True, drop_last=False, rank=0, world_size=1, num_workers=0)
    epoch = [batch[0].tolist() for batch in make()]
    loader = make()
    head = [batch[0].tolist() for _, batch in zip(range(2), loader, strict=False)]
    assert head == epoch[:2] and loader.position == 4
    loader.set_epoch(0)
    assert loader.position == 0 and [batch[0].tolist() for batch in loader] == epoch
    for _ in zip(range(2), loader, strict=False):  # epoch 1, broken off after 2 batches
        pass
    assert (loader.epoch, loader.position) == (1, 4)
    assert len(list(loader)) == 4, "a new iter() without set_epoch goes on after the last batch handed out"


def test_a_loader_owns_its_position_inspecting_its_sampler_moves_nothing() -> None:
    loader = _loader(12, 2, shuffle=True, drop_last=False, rank=0, world_size=1, num_workers=0)
    listed = (
        list(loader.sampler),
        [[key.index for key in batch] for batch in loader.batch_sampler],
        loader.peek_indices(6),
    )
    assert (loader.epoch, loader.position) == (0, 0)
    assert [batch[0].tolist() for batch in loader] == listed[2] == listed[1]
    other = ResumableDataLoader(loader.dataset, 2, sampler=loader.sampler)
    assert [batch[0].tolist() for batch in other] == listed[2], "a second loader over the sampler starts it"
    assert loader.position == 12 and loader.state_dict()["position"] == 12
