"""EpochCursor's rules where a loader, its sampler and a caller with its own epoch numbering meet.

Each property was found broken in review of the rules' rewrite and is checked here on the public
objects a user holds (a ResumableDataLoader, its sampler), or on the cursor where only a wrapper
(accelerate) reaches it.
"""

from __future__ import annotations

import warnings

import torch

from resumable_data import ResumableDataLoader, ResumableSampler, ResumeWarning
from resumable_data.core.cursor import EpochCursor


def test_the_librarys_own_epoch_loop_is_not_shifted_by_a_callers_restarted_counter() -> None:
    # accelerate numbers its passes from 0 after a resume and set_epoch(0)s before torchdata restores
    # epoch 3 through the pass's iterator: later set_epoch(j) mean epoch j + 3. pass_epochs() selects
    # epochs in the cursor's own numbering and must not add that offset again.
    cursor = EpochCursor("sampler")
    cursor.set_epoch(0)
    cursor.restore(3, 5, False, through_iterator=True)
    segment = cursor.begin_pass()
    cursor.advance_pass(segment, 10, True)
    assert list(cursor.pass_epochs(6)) == [4, 5]
    assert cursor.epoch == 5


def test_inspecting_a_restored_loaders_sampler_keeps_the_restored_position() -> None:
    loader = ResumableDataLoader(torch.arange(20), batch_size=4, seed=0)
    batches = iter(loader)
    next(batches), next(batches)
    state = loader.state_dict()
    restored = ResumableDataLoader(torch.arange(20), batch_size=4, seed=0)
    restored.load_state_dict(state)
    list(restored.sampler)  # a look at the order
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeWarning)
        restored.set_epoch(0)
    assert restored.position == state["position"] == 8
    assert [b.tolist() for b in restored] == [b.tolist() for b in batches]


def test_two_loaders_over_one_sampler_keep_their_own_positions() -> None:
    sampler = ResumableSampler(20, seed=0)
    first = ResumableDataLoader(torch.arange(20), batch_size=4, sampler=sampler)
    second = ResumableDataLoader(torch.arange(20), batch_size=4, sampler=sampler)
    list(first)
    batches = iter(second)
    taken = [next(batches).tolist(), next(batches).tolist()]
    del batches
    state = second.state_dict()
    list(first)  # the first loader moves on to epoch 1 by itself
    assert second.state_dict() == state
    reference = ResumableDataLoader(torch.arange(20), batch_size=4, seed=0)
    assert taken + [b.tolist() for b in second] == [b.tolist() for b in reference]
