"""ResumableSampler: DistributedSampler's layout, exact partitions across ranks (also after a
world-size or batch-size change mid-epoch), and O(1) interop with torch and torchdata loaders."""

from __future__ import annotations

import collections
import itertools
import json
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import resumable_data.core.permutation as permutation_module
from harness import checkpoint_roundtrip
from resumable_data import ResumableDataLoader, ResumableSampler


@given(length=st.integers(1, 50), world_size=st.integers(1, 5), drop_last=st.booleans(), data=st.data())
def test_unshuffled_layout_matches_distributed_sampler(
    length: int, world_size: int, drop_last: bool, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, world_size - 1))
    ours = ResumableSampler(length, shuffle=False, rank=rank, world_size=world_size, drop_last=drop_last)
    theirs = DistributedSampler(range(length), num_replicas=world_size, rank=rank, shuffle=False, drop_last=drop_last)
    assert list(ours) == list(theirs)
    assert len(ours) == len(theirs)


def test_global_order_does_not_depend_on_world_size() -> None:
    one = list(ResumableSampler(24, seed=5))
    for world in (2, 3, 4):
        ranks = [list(ResumableSampler(24, seed=5, rank=r, world_size=world)) for r in range(world)]
        interleaved = [ranks[p % world][p // world] for p in range(24)]
        assert interleaved == one


def _consume(loaders: list[ResumableDataLoader], batches: int | None) -> list[int]:
    """Step all ranks in lockstep for `batches` steps (None: to the end of the epoch)."""
    iterators = [iter(loader) for loader in loaders]
    seen: list[int] = []
    for _ in itertools.count() if batches is None else range(batches):
        step = [next(it, None) for it in iterators]
        if all(b is None for b in step):
            break
        seen.extend(i for b in step if b is not None for i in b.tolist())
    return seen


def _ranks(length: int, world: int, batch: int, seed: int = 11) -> list[ResumableDataLoader]:
    dataset = torch.arange(length)
    return [ResumableDataLoader(dataset, batch, seed=seed, rank=r, world_size=world) for r in range(world)]


@pytest.mark.parametrize("length", [48, 50, 53])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_cover_each_index_exactly_once_per_epoch(length: int, world: int) -> None:
    for epoch in range(2):
        loaders = _ranks(length, world, batch=5)
        for loader in loaders:
            loader.set_epoch(epoch)
        counts = collections.Counter(_consume(loaders, None))
        assert set(counts) == set(range(length))
        # Only the padded tail (< world samples) repeats, as with DistributedSampler.
        assert sum(counts.values()) - length == (-length) % world


@pytest.mark.parametrize(
    ("world_before", "world_after", "batch_before", "batch_after"),
    [(2, 1, 4, 4), (2, 4, 4, 4), (3, 2, 4, 4), (2, 2, 4, 3), (3, 2, 2, 5), (1, 3, 7, 1)],
)
@pytest.mark.parametrize("steps_before", [0, 1, 3])
def test_world_and_batch_size_change_mid_epoch_consumes_the_rest_exactly_once(
    world_before: int, world_after: int, batch_before: int, batch_after: int, steps_before: int
) -> None:
    length = 60
    before = _ranks(length, world_before, batch_before)
    seen = _consume(before, steps_before)
    states = [loader.state_dict() for loader in before]
    assert all(s == states[0] for s in states), "ranks must agree on the state: any rank's can be loaded"
    after = _ranks(length, world_after, batch_after)
    for r, loader in enumerate(after):
        loader.load_state_dict(checkpoint_roundtrip(states[r % world_before]))
    seen += _consume(after, None)
    counts = collections.Counter(seen)
    assert set(counts) == set(range(length))
    # At most world_after - 1 padded repeats at the very end, nothing else twice.
    assert sum(counts.values()) - length <= world_after - 1
    assert max(counts.values()) <= 2


def test_drop_last_trims_only_the_tail_after_a_world_size_change() -> None:
    dataset = torch.arange(50)
    before = [ResumableDataLoader(dataset, 4, seed=1, rank=r, world_size=2, drop_last=True) for r in range(2)]
    seen = _consume(before, 2)
    after = [ResumableDataLoader(dataset, 4, seed=1, rank=r, world_size=3, drop_last=True) for r in range(3)]
    for loader in after:
        loader.load_state_dict(before[0].state_dict())
    seen += _consume(after, None)
    assert len(seen) == len(set(seen)), "drop_last never repeats a sample"
    # 34 remain over 3 ranks: 11 each, cut to 2 full batches of 4 -> 24 of the 34 are taken.
    assert len(seen) == 16 + 24


@pytest.mark.parametrize("num_workers", [0, 2])
def test_works_in_torchdata_stateful_dataloader_and_restores_exactly(num_workers: int) -> None:
    dataset = torch.arange(40)

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(
            dataset, batch_size=3, sampler=ResumableSampler(dataset, seed=4), num_workers=num_workers
        )

    def stream(loader: StatefulDataLoader, n: int) -> list[list[int]]:
        return [b.tolist() for b in itertools.islice((b for _ in range(10) for b in loader), n)]

    reference = stream(make(), 40)  # 14 batches per epoch: crosses two epoch boundaries
    for cut in (0, 5, 13, 14, 20):
        loader = make()
        head = stream(loader, cut)
        resumed = make()
        resumed.load_state_dict(loader.state_dict())
        assert head + stream(resumed, 40 - cut) == reference, cut


def test_restore_in_stateful_dataloader_computes_only_the_next_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # O(1) restore: at 90% of a billion-sample epoch, only the first chunk of indices is computed
    # (no replay of the 9e8 consumed positions, no permutation of size N).
    class Virtual(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 10**9

        def __getitem__(self, index: int) -> int:
            return index

    dataset = Virtual()
    loader = StatefulDataLoader(dataset, batch_size=4, sampler=ResumableSampler(dataset, seed=0))
    state = loader.state_dict()
    # Move the position as a resumed run would find it: 90% into the epoch.
    state["_index_sampler_state"] = None
    state["_sampler_iter_state"]["sampler_state"]["position"] = 900_000_000
    state["_sampler_iter_state"]["sampler_iter_state"]["position"] = 900_000_000
    computed = []
    original = permutation_module.Permutation.__call__

    def counting(self: permutation_module.Permutation, positions: np.ndarray) -> np.ndarray:
        computed.append(len(positions))
        return original(self, positions)

    monkeypatch.setattr(permutation_module.Permutation, "__call__", counting)
    restored = StatefulDataLoader(dataset, batch_size=4, sampler=ResumableSampler(dataset, seed=0))
    restored.load_state_dict(state)
    batch = next(iter(restored))
    expected = permutation_module.Permutation(10**9, 0, 0)(np.arange(900_000_000, 900_000_004))
    assert batch.tolist() == expected.tolist()
    assert sum(computed) <= 1024


def test_plain_dataloader_with_the_sampler_is_resumable_at_num_workers_0() -> None:
    dataset = torch.arange(30)
    sampler = ResumableSampler(dataset, seed=2)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    reference = [b.tolist() for b in DataLoader(dataset, batch_size=4, sampler=ResumableSampler(dataset, seed=2))]
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(3)]
    state = sampler.state_dict()
    assert state["position"] == 12
    fresh = ResumableSampler(dataset, seed=2)
    fresh.load_state_dict(state)
    assert head + [b.tolist() for b in DataLoader(dataset, batch_size=4, sampler=fresh)] == reference


# -- whose position: a pass over the sampler owns its progress (torchdata's test_sampler.py, adapted) ----
def _indices(loader: Any) -> list[int]:
    return [int(i) for batch in loader for i in batch.reshape(-1).tolist()]


_LOADERS: dict[str, Callable[[ResumableSampler, int], Any]] = {
    "DataLoader": lambda sampler, batch: DataLoader(torch.arange(sampler.dataset_length), batch, sampler=sampler),
    "StatefulDataLoader": lambda sampler, batch: StatefulDataLoader(
        torch.arange(sampler.dataset_length), batch, sampler=sampler
    ),
    "ResumableDataLoader": lambda sampler, batch: ResumableDataLoader(
        torch.arange(sampler.dataset_length), batch, sampler=sampler
    ),
}


@pytest.mark.parametrize("kind", list(_LOADERS))
@pytest.mark.parametrize("shuffle", [True, False])
def test_listing_the_sampler_changes_nothing_a_loader_over_it_yields(kind: str, shuffle: bool) -> None:
    # torchdata's test_data_order_with(out)_shuffle. Found on main: the loader yielded epoch 1's order.
    sampler = ResumableSampler(100, shuffle=shuffle, seed=0)
    listed = list(iter(sampler))
    assert (listed != list(range(100))) == shuffle
    assert _indices(_LOADERS[kind](sampler, 32)) == listed
    assert list(sampler) == listed, "without set_epoch every pass is the same epoch, as with DistributedSampler"


@pytest.mark.parametrize("kind", list(_LOADERS))
def test_a_loader_over_a_sampler_an_earlier_loop_broke_out_of_starts_the_epoch(kind: str) -> None:
    # torchdata's test_dataloader_state_dict: break after 5 batches, resume from the state into a new
    # sampler, then a new loader over the first sampler. Found on main: it continued at sample 50.
    sampler = ResumableSampler(100, shuffle=False)
    loader = _LOADERS[kind](sampler, 10)
    for i, _ in enumerate(loader):
        if i == 4:
            break
    state = (loader if kind != "DataLoader" else sampler).state_dict()
    resumed_sampler = ResumableSampler(100, shuffle=False)
    resumed = _LOADERS[kind](resumed_sampler, 10)
    if kind == "DataLoader":
        resumed_sampler.load_state_dict(state)
    else:
        resumed.load_state_dict(state)
    assert _indices(resumed) == list(range(50, 100))
    assert _indices(_LOADERS[kind](sampler, 10)) == list(range(100))


def test_set_epoch_selects_the_epoch_and_a_restore_is_consumed_by_the_first_pass_that_draws() -> None:
    sampler = ResumableSampler(6, seed=0)
    epoch0 = list(sampler)
    assert (sampler.epoch, sampler.position) == (0, 6), "state_dict reports the newest pass"
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert sorted(epoch1) == list(range(6)) and epoch1 != epoch0
    assert list(sampler) == epoch1, "a finished epoch given no set_epoch is passed over again"
    sampler.set_epoch(1)
    assert list(sampler) == epoch1, "set_epoch with a finished epoch: a full pass again"
    resumed = ResumableSampler(6, seed=0)
    resumed.load_state_dict({**sampler.state_dict(), "epoch": 0, "position": 2})
    unused = iter(resumed)  # created and dropped before it draws: the restore is still pending
    del unused
    assert list(resumed) == epoch0[2:]
    assert list(resumed) == epoch0, "the restore was consumed by the pass that drew"
    assert [list(resumed) for _ in resumed.epochs(3)] == [epoch1, _epoch_order(6, 2)], "the epochs after the newest"


def _epoch_order(length: int, epoch: int) -> list[int]:
    sampler = ResumableSampler(length, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


@settings(max_examples=50)
@given(
    length=st.integers(1, 10**9),
    position_fraction=st.floats(0, 1),
    world=st.integers(1, 4096),
    epoch=st.integers(0, 10**6),
)
def test_state_is_small_plain_and_round_trips(length: int, position_fraction: float, world: int, epoch: int) -> None:
    loader_like = ResumableSampler(length, seed=2**62, world_size=world)
    loader_like.load_state_dict(
        {**loader_like.state_dict(), "epoch": epoch, "position": int(position_fraction * length)}
    )
    state = {**loader_like.state_dict(), "batch_size": 4096}
    encoded = json.dumps(state)
    assert len(encoded) < 512
    assert json.loads(encoded) == state
    assert checkpoint_roundtrip(state) == state
    assert len(pickle.dumps(state)) < 512  # what torch.save stores for it, before zip framing
