"""Permutation: a true permutation for every length, well mixed even for tiny lengths, pure."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from resumable_data import Permutation, ResumeError

EDGE_LENGTHS = [1, 2, 3] + [n for k in range(2, 21) for n in (2**k - 1, 2**k, 2**k + 1)]


@pytest.mark.parametrize("length", EDGE_LENGTHS)
def test_is_a_permutation_at_edge_lengths(length: int) -> None:
    # 2**16 + 1 and 2**20 + 1 are where a peer's index shuffle duplicates one index and loses one.
    values = Permutation(length, seed=7, epoch=3)(np.arange(length))
    assert np.array_equal(np.sort(values), np.arange(length))


@given(length=st.integers(1, 5000), seed=st.integers(-(2**63), 2**63 - 1), epoch=st.integers(0, 10**6))
def test_is_a_permutation_for_any_length_seed_epoch(length: int, seed: int, epoch: int) -> None:
    values = Permutation(length, seed, epoch)(np.arange(length))
    assert np.array_equal(np.sort(values), np.arange(length))


def _position_chi2(length: int, seeds: int, rounds: int | None = None) -> float:
    """Chi-square statistic of 'element i lands at position j' over many seeds (uniform = df)."""
    counts = np.zeros((length, length))
    kwargs = {} if rounds is None else {"rounds": rounds}
    for seed in range(seeds):
        counts[np.arange(length), Permutation(length, seed, 0, **kwargs)(np.arange(length))] += 1
    expected = seeds / length
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("length", [2, 3, 5, 8, 13])
def test_every_element_lands_everywhere_equally_often(length: int) -> None:
    # df = (length-1)^2; the 99.99th percentile of chi2 stays below df + 9*sqrt(2 df) + 15.
    df = (length - 1) ** 2
    assert _position_chi2(length, seeds=4000) < df + 9 * np.sqrt(2 * df) + 15


def test_four_round_feistel_fails_the_mixing_check() -> None:
    # The check above has teeth: the Luby-Rackoff minimum of 4 rounds is visibly biased.
    length = 5
    df = (length - 1) ** 2
    assert _position_chi2(length, seeds=4000, rounds=4) > df + 9 * np.sqrt(2 * df) + 15


def test_order_is_a_pure_function_of_seed_epoch_length() -> None:
    positions = np.arange(1000)
    a = Permutation(1000, 1, 2)(positions)
    assert np.array_equal(a, Permutation(1000, 1, 2)(positions))
    assert not np.array_equal(a, Permutation(1000, 1, 3)(positions))
    assert not np.array_equal(a, Permutation(1000, 2, 2)(positions))


def test_golden_order_for_a_tiny_case() -> None:
    # Pinned so that an accidental change of the hash or the network shows up as a test failure:
    # every checkpoint written before such a change would silently resume into a different order.
    assert Permutation(10, seed=1, epoch=0)(np.arange(10)).tolist() == [3, 5, 0, 7, 4, 6, 2, 8, 9, 1]


def test_evaluates_single_positions_of_a_billion_without_materializing() -> None:
    perm = Permutation(10**9, seed=0, epoch=0)
    chunk = perm(np.arange(900_000_000, 900_000_064))
    assert chunk.min() >= 0 and chunk.max() < 10**9 and len(set(chunk.tolist())) == 64
    assert perm[900_000_000] == chunk[0]


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ResumeError, match="length"):
        Permutation(0, 0, 0)
    with pytest.raises(IndexError, match="positions"):
        Permutation(5, 0, 0)(np.array([5]))


@pytest.mark.parametrize("length", [600, 1000, 3000])
def test_first_positions_spread_evenly_over_a_mid_size_range(length: int) -> None:
    # Beyond tiny domains: where the first 10 positions land, in 10 equal bins, over 4000 seeds.
    seeds, k = 4000, 10
    bins = np.zeros((k, k))
    for seed in range(seeds):
        bins[np.arange(k), Permutation(length, seed, 0)(np.arange(k)) * k // length] += 1
    expected = seeds / k
    chi2 = float(((bins - expected) ** 2 / expected).sum())
    df = k * (k - 1)
    assert chi2 < df + 9 * np.sqrt(2 * df) + 15


@given(
    length=st.integers(1, 3 * 10**9),
    seed=st.integers(-(2**63), 2**63 - 1),
    epoch=st.integers(0, 10**6),
    start=st.integers(0, 10**9),
)
def test_scalar_tail_of_the_cycle_walk_equals_the_vectorized_walk(
    length: int, seed: int, epoch: int, start: int
) -> None:
    # The last stragglers of a cycle walk, and chunks of at most SCALAR_MAX positions, are done in
    # Python ints: the order must not change.
    import resumable_data.core.permutation as module

    permutation = Permutation(length, seed, epoch)
    positions = (start + np.arange(min(length, 300))) % length
    default = permutation(positions)
    saved = module.SCALAR_TAIL, module.SCALAR_MAX
    try:
        module.SCALAR_TAIL, module.SCALAR_MAX = 0, 0
        vectorized = permutation(positions)
        small_chunks = [permutation(positions[:k]) for k in (1, 7, saved[1], saved[1] + 1)]
        module.SCALAR_TAIL = len(positions)
        scalar = permutation(positions)
    finally:
        module.SCALAR_TAIL, module.SCALAR_MAX = saved
    assert np.array_equal(default, vectorized) and np.array_equal(default, scalar)
    for chunk in small_chunks:
        assert np.array_equal(chunk, vectorized[: len(chunk)])
    for k in (1, 7, saved[1]):  # the scalar path, as a restore's first batch takes it
        assert np.array_equal(permutation(positions[:k]), vectorized[: min(k, len(positions))])
