"""The global RNGs around a fetch: seeded to pinned streams through public APIs, put back exactly.

What a batch key stands for is written out below through the public seeding calls
(``public_seeding``); ``GLOBAL_RNGS.seeded`` must give exactly those draws, and with
``restore=True`` leave every RNG of the main process as it found it.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import resumable_data
from harness import GlobalRandomAugment
from resumable_data import ResumableDataLoader
from resumable_data.core.hash import hash_ints
from resumable_data.map.fetch import BatchIndices, SeededCollate, batch_keys, fetch_here
from resumable_data.rng.global_rngs import GLOBAL_RNGS

BATCH_SALT = 0x6261746368  # the batch key's last input: changing it changes every user's augmentations
LIBRARY = Path(resumable_data.__file__).parent  # the package under test, wherever it is imported from
BIT_GENERATORS = [np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.SFC64]


def public_seeding(key: int) -> None:
    """What a key stands for with numpy's default MT19937, through the public seeding calls."""
    torch.default_generator.manual_seed(key >> 1)
    np.random.seed(key & 0xFFFFFFFF)
    random.seed(key)


def draws() -> tuple[list[float], list[float], list[float]]:
    """Draws that also go through each RNG's Gaussian cache."""
    return (
        [*torch.rand(3).tolist(), *torch.randn(1).tolist(), float(torch.randint(0, 2**62, ()))],
        [*np.random.random_sample(3).tolist(), float(np.random.standard_normal()), float(np.random.standard_normal())],
        [random.random(), random.gauss(0.0, 1.0), random.gauss(0.0, 1.0), float(random.getrandbits(64))],
    )


def scramble(key: int) -> None:
    """Put every RNG somewhere unusual, with torch's and python's Gaussian caches filled."""
    torch.manual_seed(key), np.random.seed(key % 2**32), random.seed(key)
    torch.randn(1), random.gauss(0.0, 1.0)
    random.random(), np.random.random_sample(key % 5)


def states() -> tuple[Any, ...]:
    """Everything the three RNGs hold, comparable with ==."""
    numpy = np.random.get_state(legacy=False)
    return (
        torch.default_generator.get_state().tolist(),
        random.getstate(),
        np.random.get_bit_generator(),
        repr(numpy),
    )


@pytest.fixture
def bit_generator(request: pytest.FixtureRequest) -> Any:
    """numpy's global bit generator replaced by the parameter's type for the test."""
    original = np.random.get_bit_generator()
    replacement = request.param(12345)
    np.random.set_bit_generator(replacement)
    yield replacement
    np.random.set_bit_generator(original)


def test_the_library_reads_and_writes_no_raw_memory() -> None:
    # The RNGs are reached through the libraries' public APIs only: no ctypes, no memoryviews of
    # other objects' memory.
    offenders = [
        f"{path.relative_to(LIBRARY)}: {word}"
        for path in LIBRARY.rglob("*.py")
        for word in ("ctypes", "memoryview", "string_at", "from_address")
        if word in path.read_text()
    ]
    assert offenders == []


@given(key=st.integers(0, 2**64 - 1))
def test_seeded_gives_the_streams_of_the_public_seeding_calls(key: int) -> None:
    scramble(key ^ 1)
    public_seeding(key)
    expected = draws()
    for restore in (False, True):
        scramble(key ^ 2)
        with GLOBAL_RNGS.seeded(key, restore=restore):
            assert draws() == expected


@given(key=st.integers(0, 2**32 - 1), interfering=st.integers(0, 2**64 - 1))
def test_a_restoring_fork_puts_every_rng_back_with_its_gaussian_caches(key: int, interfering: int) -> None:
    scramble(key)
    before = states()
    expected = draws()
    scramble(key)
    with GLOBAL_RNGS.seeded(interfering, restore=True) as rngs:
        draws()
        rngs.seed(interfering ^ 1)
        draws()
    assert states() == before
    assert draws() == expected


def test_numpys_legacy_gaussian_cache_is_the_one_thing_a_fork_clears() -> None:
    # Documented: numpy.random.set_bit_generator clears the RandomState's cached second normal
    # and no cheap public call reads it, so a fork drops it (deterministically: a resume agrees).
    np.random.seed(3)
    np.random.standard_normal()
    bit_generator = np.random.get_bit_generator()
    words = bit_generator.state["state"]["key"].copy()
    with GLOBAL_RNGS.seeded(5, restore=True):
        np.random.standard_normal(3)
    assert np.random.get_bit_generator() is bit_generator
    assert np.array_equal(bit_generator.state["state"]["key"], words)
    assert np.random.get_state()[3] == 0  # has_gauss


def test_a_worker_fetch_seeds_in_place_and_draws_the_same() -> None:
    # Without restore (a worker) numpy's own generator is seeded in place: the same draws as the
    # main process's scratch generator, with no swap to pay for.
    bit_generator = np.random.get_bit_generator()
    with GLOBAL_RNGS.seeded(7, restore=True):
        expected = draws()
    with GLOBAL_RNGS.seeded(7, restore=False):
        assert np.random.get_bit_generator() is bit_generator
        assert draws() == expected


@pytest.mark.parametrize("bit_generator", BIT_GENERATORS, indirect=True, ids=lambda t: t.__name__)
def test_any_numpy_bit_generator_is_seeded_from_the_key_and_handed_back(bit_generator: Any) -> None:
    # The draws inside depend on the key alone (not on the user's generator's state); outside,
    # the user's generator is the same object in the same state.
    before = states()
    inside = {}
    for key in (3, 4, 3):
        np.random.random_sample(7)  # the user's generator moves between fetches
        outside = states()
        with GLOBAL_RNGS.seeded(key, restore=True):
            assert type(np.random.get_bit_generator()) is type(bit_generator)
            got = [*np.random.random_sample(5).tolist(), float(np.random.standard_normal())]
        inside.setdefault(key, got)
        assert got == inside[key]
        assert states() == outside
    assert inside[3] != inside[4]
    assert states() != before  # the draws between fetches did move it: the check above has teeth


def test_a_bit_generator_type_without_a_fast_state_is_seeded_through_a_seed_sequence() -> None:
    class Custom(np.random.PCG64):
        """A user's own bit generator type."""

    original = np.random.get_bit_generator()
    np.random.set_bit_generator(Custom(1))
    try:
        with GLOBAL_RNGS.seeded(9, restore=True):
            got = np.random.random_sample(4)
    finally:
        np.random.set_bit_generator(original)
    expected = np.random.RandomState(Custom(np.random.SeedSequence(9))).random_sample(4)
    assert np.array_equal(got, expected)


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


class Draws(torch.utils.data.Dataset):
    """Draws from the three global RNGs."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[float, float, float]:
        return torch.rand(()).item(), float(np.random.random_sample()), random.random()


def collate_saying_where(samples: list[Any]) -> tuple[list[Any], bool]:
    """The samples, and whether they were fetched in a worker (a spawned worker needs it picklable)."""
    return samples, torch.utils.data.get_worker_info() is not None


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_worker_seeds_the_same_as_the_main_process(context: str) -> None:
    # A spawned worker imports the library anew; its batches must be those of the main process
    # (0 workers) and of a forked worker.
    def batches(num_workers: int) -> list[Any]:
        loader = ResumableDataLoader(
            Draws(),
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
    # one must not overwrite what the outer one saved, nor the outer one's numpy stream.
    public_seeding(2)
    draws()
    inside_outer = draws()
    scramble(7)
    before = states()
    after_outer = draws()
    scramble(7)
    with GLOBAL_RNGS.seeded(2, restore=True):
        draws()
        with GLOBAL_RNGS.seeded(3, restore=True):
            draws()
        assert draws() == inside_outer
    assert states() == before
    assert draws() == after_outer


class YieldingAugment(GlobalRandomAugment):
    """Draws from the global RNGs with a thread switch between draws, as a real transform's I/O would."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = super().__getitem__(index)
        time.sleep(0.0005)  # releases the GIL: the other thread runs mid-fetch
        return image + torch.rand(()) + float(np.random.random_sample()) + random.random(), label


def test_two_threads_each_iterating_a_zero_worker_loader_are_each_exact() -> None:
    # Each fetch holds the process-wide lock from seeding to restoring, so the two loaders'
    # fetches never interleave their draws, and each restore puts back its own fork's states.
    def run(seed: int) -> list[Any]:
        loader = ResumableDataLoader(YieldingAugment(24), batch_size=3, seed=seed)
        return [batch[0] for _ in range(2) for batch in loader]

    reference = {seed: run(seed) for seed in (1, 2)}
    results: dict[int, list[Any]] = {}
    barrier = threading.Barrier(2)

    def worker(seed: int) -> None:
        barrier.wait()
        results[seed] = run(seed)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    for seed in (1, 2):
        assert len(results[seed]) == len(reference[seed])
        assert all(torch.equal(a, b) for a, b in zip(results[seed], reference[seed], strict=True))


# Run in a fresh interpreter: the libraries resumable_data builds on are imported first, the three
# RNGs seeded, and every atexit/at-fork registration recorded; then resumable_data is imported.
IMPORT_CHECK = """
import atexit, os, random, sys
registered = []
real_atexit, real_at_fork = atexit.register, os.register_at_fork
def record_atexit(function, *args, **kwargs):
    registered.append(str(getattr(function, "__module__", "?")))
    return real_atexit(function, *args, **kwargs)
def record_at_fork(**hooks):
    registered.extend(str(getattr(hook, "__module__", "?")) for hook in hooks.values())
    real_at_fork(**hooks)
atexit.register, os.register_at_fork = record_atexit, record_at_fork
import numpy as np, torch, torch.utils.data, torchdata.stateful_dataloader
random.seed(1); np.random.seed(2); torch.manual_seed(3)
def states():
    return (random.getstate(), repr(np.random.get_state(legacy=False)), id(np.random.get_bit_generator()),
            torch.get_rng_state().tolist())
before = states()
import resumable_data
print(states() == before, sorted(m for m in registered if m.startswith("resumable_data")))
"""


def test_importing_the_library_touches_no_rng_and_registers_no_handler() -> None:
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_CHECK],
        env={**os.environ, "PYTHONPATH": str(LIBRARY.parent)},  # the package under test
        cwd=LIBRARY.anchor,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    assert out == ["True", "[]"]


def test_a_worker_forked_while_another_thread_holds_the_lock_does_not_inherit_it() -> None:
    # A DataLoader worker forked while another thread's 0-worker fetch holds the lock gets a
    # fresh lock (os.register_at_fork), so a fork inside that worker does not wait forever.
    import multiprocessing

    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with GLOBAL_RNGS.seeded(1, restore=True):
            holding.set()
            release.wait(60)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert holding.wait(60)
        context = multiprocessing.get_context("fork")
        child = context.Process(target=_fork_once)
        child.start()
        child.join(60)
        assert child.exitcode == 0
    finally:
        release.set()
        thread.join(60)


def _fork_once() -> None:
    with GLOBAL_RNGS.seeded(2, restore=True):
        pass
