"""The global RNGs around a fetch: seeded to the public APIs' streams, saved and restored exactly.

``GlobalRngs`` copies the three Mersenne Twister states as raw bytes (the public APIs
cost too much per batch); these tests pin it to the public APIs: ``GlobalRngs(fast=False)`` uses
only those, and both must give the same draws, bit for bit.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness import GlobalRandomAugment
from resumable_data import ResumableDataLoader
from resumable_data.core.hash import hash_ints
from resumable_data.map.fetch import BatchIndices, SeededCollate, batch_keys, fetch_here
from resumable_data.rng import global_rngs as _global_rngs
from resumable_data.rng.global_rngs import GLOBAL_RNGS, GlobalRngs

FAST, PUBLIC = GlobalRngs(), GlobalRngs(fast=False)
BATCH_SALT = 0x6261746368  # the batch key's last input: changing it changes every user's augmentations


def public_seeding(key: int) -> None:
    """What a key stands for, through the public APIs: torch and numpy seeded as usual, python's
    Twister given the words numpy's seeding makes from the key's high half."""
    torch.manual_seed(key >> 1)
    np.random.seed(key & 0xFFFFFFFF)
    python_words = np.random.RandomState(key >> 32).get_state()[1]
    random.setstate((3, (*python_words.tolist(), 624), None))


def draws() -> tuple[list[float], list[float], list[float]]:
    """Draws that also go through each RNG's Gaussian cache."""
    return (
        [*torch.rand(3).tolist(), *torch.randn(1).tolist(), float(torch.randint(0, 2**62, ()))],
        [*np.random.random_sample(3).tolist(), float(np.random.standard_normal()), float(np.random.standard_normal())],
        [random.random(), random.gauss(0.0, 1.0), random.gauss(0.0, 1.0), float(random.getrandbits(64))],
    )


def scramble(key: int) -> None:
    """Put every RNG somewhere unusual, with Gaussian caches filled."""
    torch.manual_seed(key), np.random.seed(key % 2**32), random.seed(key)
    torch.randn(1), np.random.standard_normal(), random.gauss(0.0, 1.0)
    random.random(), np.random.random_sample(key % 5)


def test_both_paths_are_what_they_claim() -> None:
    # If the fast path silently fell back, the tests below would compare the public API with itself.
    assert FAST.raw
    assert not PUBLIC.raw


@pytest.mark.parametrize(
    ("name", "wrong"),
    [("_SEEDED_POSITION", struct.pack("i", 623)), ("_NO_GAUSS", b"\x01" + bytes(15)), ("_TORCH_SCAN_BYTES", 16)],
)
def test_a_fast_path_that_reads_differently_falls_back_to_the_public_one(
    monkeypatch: pytest.MonkeyPatch, name: str, wrong: object
) -> None:
    # Each layout and the fast seeding are checked against the public APIs once per process; a
    # mismatch (here planted: a wrong seeded index, a Gaussian cache left set, an engine not found)
    # must turn the fast path off, not give different streams.
    monkeypatch.setattr(_global_rngs, name, wrong)
    assert not GlobalRngs().raw


@given(key=st.integers(0, 2**64 - 1))
def test_seed_gives_the_streams_of_the_public_seeding_calls(key: int) -> None:
    scramble(key ^ 1)
    public_seeding(key)
    expected = draws()
    for rngs in (FAST, PUBLIC):
        scramble(key ^ 2)
        rngs.seed(key)
        assert draws() == expected


@given(key=st.integers(0, 2**32 - 1), interfering=st.integers(0, 2**32 - 1))
def test_save_then_restore_puts_every_rng_back_with_its_gaussian_cache(key: int, interfering: int) -> None:
    for rngs in (FAST, PUBLIC):
        scramble(key)
        expected = draws()
        scramble(key)
        forked = rngs.fork(interfering)
        draws()
        rngs.restore(forked)
        assert draws() == expected


def test_a_batch_is_seeded_from_seed_epoch_and_position() -> None:
    # The key is part of the product: a release that changed it would change a resumed run's
    # augmentations. Batch 2 of epoch 1 (batch size 4, one rank) draws from hash_ints(seed, 1, 8, salt).
    key = list(batch_keys(11, 1, 0, 4, 3))[2]
    assert key == hash_ints(11, 1, 8, BATCH_SALT)
    dataset = GlobalRandomAugment(16)
    public_seeding(key)
    expected = [dataset[i] for i in (3, 5, 7, 9)]
    indices = BatchIndices([3, 5, 7, 9], key, "batch", hash_ints(11, 1), main_fetch=True)
    got = fetch_here(dataset, indices, SeededCollate(list, "batch"))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(expected, got, strict=True))


@given(
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 10**4),
    first=st.integers(0, 2**40),
    stride=st.integers(1, 2**12),
    count=st.integers(0, 200),
)
def test_batch_keys_in_vectorized_blocks_are_the_scalar_hash(
    seed: int, epoch: int, first: int, stride: int, count: int
) -> None:
    # The plan computes keys 64 at a time in numpy's uint64 arithmetic; they must be hash_ints's,
    # across block boundaries and for positions far into a large epoch.
    expected = [hash_ints(seed, epoch, first + b * stride, BATCH_SALT) for b in range(count)]
    assert list(batch_keys(seed, epoch, first, stride, count)) == expected


class DrawsAndSaysHow(torch.utils.data.Dataset):
    """Draws from the three global RNGs, and says whether its process seeds them the fast way."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[float, float, float, bool]:
        return torch.rand(()).item(), float(np.random.random_sample()), random.random(), GLOBAL_RNGS.raw


def collate_saying_where(samples: list[Any]) -> tuple[list[Any], bool]:
    """The samples, and whether they were fetched in a worker (a spawned worker needs it picklable)."""
    return samples, torch.utils.data.get_worker_info() is not None


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_worker_started_fresh_checks_the_layouts_itself_and_seeds_the_same(context: str) -> None:
    # A spawned worker imports the library anew: its own layout checks must find the fast path,
    # and its batches must be those of the main process (0 workers) and of a forked worker.
    def batches(num_workers: int) -> list[Any]:
        loader = ResumableDataLoader(
            DrawsAndSaysHow(),
            batch_size=4,
            seed=5,
            num_workers=num_workers,
            collate_fn=collate_saying_where,
            warm_start=False,  # every batch from the worker, none from the main process
            **({"multiprocessing_context": context, "timeout": 60} if num_workers else {}),
        )
        return list(loader)

    from_worker = batches(1)
    assert all(fetched_in_worker for _, fetched_in_worker in from_worker)
    assert all(raw for samples, _ in from_worker for *_, raw in samples)
    assert [samples for samples, _ in from_worker] == [samples for samples, _ in batches(0)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_batches_equal_the_pinned_seeding(num_workers: int) -> None:
    loader = ResumableDataLoader(
        GlobalRandomAugment(12),
        batch_size=4,
        seed=11,
        shuffle=False,
        num_workers=num_workers,
        **({"timeout": 60} if num_workers else {}),
    )
    for b, (images, indices) in enumerate(loader):
        key = hash_ints(11, 0, 4 * b, BATCH_SALT)
        public_seeding(key)
        expected = torch.stack([loader.dataset[int(i)][0] for i in indices])
        assert torch.equal(images, expected)


def test_keys_are_pinned() -> None:
    # Every order and every seeded augmentation hangs on these values; a faster hash must give the
    # same keys or every resumed run across an upgrade would change (values from before the hash was inlined).
    assert hash_ints() == 7640891576956012809
    assert hash_ints(0) == 580542743492490023
    assert hash_ints(1234, 0, 96, BATCH_SALT) == 3787819898498466473
    assert hash_ints(-5, 2**64 - 1) == 8224632589368128548


def test_a_fork_inside_a_fork_puts_each_level_back() -> None:
    # A dataset that iterates another loader in the main process forks inside a fork: the inner
    # one must not overwrite what the outer one saved.
    for rngs in (FAST, PUBLIC):
        scramble(7)
        after_outer = draws()
        public_seeding(2)
        draws()
        inside_outer = draws()
        scramble(7)
        outer = rngs.fork(2)
        draws()
        inner = rngs.fork(3)
        draws()
        rngs.restore(inner)
        assert draws() == inside_outer
        rngs.restore(outer)
        assert draws() == after_outer


def test_a_new_numpy_bit_generator_is_followed() -> None:
    # numpy.random.set_bit_generator swaps the memory behind numpy.random: the raw copies must
    # follow it, or the training loop's numpy stream would be left seeded by the data.
    original = np.random.mtrand.get_bit_generator()
    try:
        np.random.set_bit_generator(np.random.MT19937(5))
        for _ in range(3):  # the first fork after the swap checks the new generator, the next ones use it
            scramble(3)
            expected = draws()
            scramble(3)
            FAST.restore(FAST.fork(11))
            assert draws() == expected
        assert FAST.raw
    finally:
        np.random.set_bit_generator(original)
