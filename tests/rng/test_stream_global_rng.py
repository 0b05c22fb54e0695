"""StreamLoader seeds the global RNGs per batch: a ``map`` drawing ``torch.rand`` (or numpy's or
python's global RNG) resumes exactly, with workers too."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from harness import assert_resumes_identically
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, StreamLoader
from streams_harness import MemoryShards

SHARDS = MemoryShards([30, 25, 20, 35])


def augment(record: int) -> torch.Tensor:
    """Augmentation drawn from the three global RNGs, as a user's map would."""
    return torch.tensor(float(record)) + torch.rand(()) + float(np.random.random_sample()) + random.random()


def loader(num_workers: int, global_rng: str | None = "batch") -> StreamLoader:
    stream = ShardedIterable(SHARDS.names, read_shard=SHARDS, seed=3).map(augment)
    return StreamLoader(
        stream,
        batch_size=5,
        num_workers=num_workers,
        global_rng=global_rng,
        **({"timeout": 60} if num_workers else {}),
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_map_drawing_from_the_global_rngs_resumes_exactly(num_workers: int) -> None:
    # On main: with 2 workers, 680 of 3,000 draws differed after a mid-epoch resume.
    assert_resumes_identically(lambda: loader(num_workers), [3, 9, 9], 30)


def test_the_batches_do_not_depend_on_the_number_of_workers_when_the_order_does_not() -> None:
    # One slot either way (world 1, 1 worker vs 0 workers): the same keys, so the same draws.
    assert all(torch.equal(a, b) for a, b in zip(loader(0), loader(1), strict=True))


def test_the_main_process_rngs_are_put_back_after_each_batch_with_0_workers() -> None:
    torch.manual_seed(0), random.seed(0)
    expected = torch.rand(2), random.random()
    torch.manual_seed(0), random.seed(0)
    for _ in loader(0):
        pass
    got = torch.rand(2), random.random()
    assert torch.equal(expected[0], got[0]) and expected[1] == got[1]


def test_global_rng_none_leaves_the_rngs_alone() -> None:
    torch.manual_seed(0)
    first = next(iter(loader(0, global_rng=None)))
    torch.manual_seed(0)
    torch.rand(())  # the map draws from the caller's stream now
    assert not torch.equal(first, next(iter(loader(0, global_rng=None))))
    with pytest.raises(ResumeError, match="global_rng should be 'batch' or None"):
        loader(0, global_rng="sample")


def test_a_malformed_batch_count_is_refused() -> None:
    state = loader(0).state_dict()
    state["batches"] = {"0": -1}
    with pytest.raises(ResumeError, match="'batches' has -1 for slot 0"):
        loader(0).load_state_dict(state)
