"""Each rank's global RNGs: per-rank seeds (a pinned stream), a restore from the checkpoint's list by
rank, and a reproducible seeding for a rank the checkpoint never had; bad input changes nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from resumable_data import ResumeError, capture_rng_state, seed_everything
from resumable_data.rng import rank_seed, restore_rank_rng_state
from resumable_data.testing import assert_same


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.random()), torch.rand(3).tolist()


def test_rank_seeds_are_pinned_and_differ_by_rank_and_step() -> None:
    # The stream is part of the product (the trainer's seeds since 0.1.0): an elastic resume re-derives them.
    assert rank_seed(1337, 1) == 3358760170
    assert rank_seed(1337, 2, step=40) == 3754600782
    seeds = {rank_seed(1337, rank, step) for rank in range(4) for step in (None, 0, 40)}
    assert len(seeds) == 12 and all(0 <= s < 2**32 for s in seeds)


def test_seed_everything_seeds_python_numpy_and_torch() -> None:
    seed_everything(7)
    first = draws()
    seed_everything(7)
    assert draws() == first


def test_a_rank_the_checkpoint_had_continues_exactly() -> None:
    seed_everything(1)
    states = [capture_rng_state()]
    seed_everything(2)
    states.append(capture_rng_state())
    expected = draws()
    seed_everything(99)
    assert restore_rank_rng_state(states, 1, seed=0, step=5) is True
    assert_same(expected, draws())


def test_a_rank_the_checkpoint_lacked_is_seeded_from_seed_step_and_rank() -> None:
    seed_everything(rank_seed(1337, 2, 40))
    expected = draws()
    seed_everything(99)
    assert restore_rank_rng_state([capture_rng_state()] * 2, 2, seed=1337, step=40) is False
    assert_same(expected, draws())


@pytest.mark.parametrize(
    ("states", "match"),
    [
        ({"0": {}}, r"per-rank RNG states should be a list indexed by rank, but got a dict"),
        ([{"version": 1}], r"RNG"),
    ],
)
def test_bad_states_are_refused_and_change_no_rng(states: object, match: str) -> None:
    seed_everything(5)
    before = capture_rng_state()
    with pytest.raises(ResumeError, match=match):
        restore_rank_rng_state(states, 0, seed=0, step=0)  # type: ignore[arg-type]
    assert_same(before, capture_rng_state())
