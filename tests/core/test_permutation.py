"""Permutation: a true permutation for every length, indistinguishable from uniform at every size, pure."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_data import ResumableSampler, ResumeError, ShardedIterable
from resumable_data.core import Permutation
from resumable_data.core.permutation import EXACT_MAX, FeistelPermutation, PiecewisePermutation

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


def chi2_sf(statistic: float, df: int) -> float:
    """P(chi-square with ``df`` degrees of freedom >= ``statistic``), exactly (closed forms of the
    regularized upper gamma function for integer and half-integer shape)."""
    half = statistic / 2.0
    if df % 2 == 0:
        terms = range(df // 2)
        return min(1.0, sum(math.exp(-half + k * math.log(half) - math.lgamma(k + 1)) for k in terms)) if half else 1.0
    tail = math.erfc(math.sqrt(half))
    return min(
        1.0,
        tail + sum(math.exp(-half + (k + 0.5) * math.log(half) - math.lgamma(k + 1.5)) for k in range((df - 1) // 2)),
    )


def chi2_p(counts: np.ndarray) -> float:
    """p-value of ``counts`` (any shape) against equal expected counts in every cell."""
    counts = counts.ravel().astype(float)
    expected = counts.sum() / counts.size
    return chi2_sf(float(((counts - expected) ** 2 / expected).sum()), counts.size - 1)


def orders(make: Callable[[int], Any], length: int, seeds: int) -> np.ndarray:
    """The full order for each seed, one row per seed."""
    return np.array([make(seed)(np.arange(length)) for seed in range(seeds)])


def order_counts(rows: np.ndarray) -> np.ndarray:
    """How often each of the n! orders occurs (rows are permutations of 0..n-1)."""
    length = rows.shape[1]
    rank = {order: i for i, order in enumerate(itertools.permutations(range(length)))}
    return np.bincount([rank[tuple(row)] for row in rows.tolist()], minlength=len(rank))


def cycle_length_of_zero(row: list[int]) -> int:
    length, x = 1, row[0]
    while x != 0:
        x, length = row[x], length + 1
    return length


def uniformity_p_values(length: int, seeds: int) -> dict[str, float]:
    """What the tests below check of Permutation(length, seed, 0) over ``seeds`` seeds."""
    rows = orders(lambda seed: Permutation(length, seed, 0), length, seeds)
    p = {
        "first two positions": chi2_p(
            np.bincount(rows[:, 0] * length + rows[:, 1], minlength=length * length)[
                [a * length + b for a in range(length) for b in range(length) if a != b]
            ]
        ),
        "cycle length of 0": chi2_p(np.bincount([cycle_length_of_zero(r) for r in rows.tolist()])[1:]),
    }
    if length <= 7:
        p["all orders"] = chi2_p(order_counts(rows))
    return p


# Fast and seeded: what the default suite runs (the slow set repeats it at 10**5 seeds).
@pytest.mark.parametrize(("length", "seeds"), [(2, 2000), (3, 3000), (4, 6000), (5, 8000), (9, 6000), (24, 5000)])
def test_small_shuffles_are_indistinguishable_from_uniform(length: int, seeds: int) -> None:
    p = uniformity_p_values(length, seeds)
    assert min(p.values()) > 1e-3, p


@pytest.mark.slow
@pytest.mark.parametrize("length", [2, 3, 4, 5, 6, 7, 8, 10, 16, 33, 64])
def test_small_shuffles_are_indistinguishable_from_uniform_at_many_seeds(length: int) -> None:
    p = uniformity_p_values(length, 10**5)
    assert min(p.values()) > 1e-3, p


def test_the_check_has_teeth_the_feistel_network_alone_fails_it_at_ten_elements() -> None:
    # resumable_data 0.1.0 used the Feistel network at every size: at 10 elements the cycle
    # holding element 0 is far from uniform in length, which is why small sizes take the exact shuffle.
    rows = orders(lambda seed: FeistelPermutation(10, seed, 0), 10, 2000)
    assert chi2_p(np.bincount([cycle_length_of_zero(row) for row in rows.tolist()])[1:]) < 1e-6


def test_the_exact_shuffle_matches_torch_randperm_in_distribution() -> None:
    # The same statistic on torch.randperm (the reference) and on Permutation, side by side.
    seeds, length = 8000, 5
    generator = torch.Generator().manual_seed(0)
    reference = np.array([torch.randperm(length, generator=generator).numpy() for _ in range(seeds)])
    ours = orders(lambda seed: Permutation(length, seed, 0), length, seeds)
    assert chi2_p(order_counts(reference)) > 1e-3 and chi2_p(order_counts(ours)) > 1e-3


@pytest.mark.parametrize("length", [EXACT_MAX + 1, 10**6 + 3])
def test_above_the_threshold_the_first_positions_spread_evenly(length: int) -> None:
    # The Feistel network's side: where the first two positions land, in 8 x 8 bins, over seeds.
    seeds, bins = 4000, 8
    firsts = np.array([Permutation(length, seed, 0)(np.arange(2)) for seed in range(seeds)]) * bins // length
    assert chi2_p(np.bincount(firsts[:, 0] * bins + firsts[:, 1], minlength=bins * bins)) > 1e-3


@pytest.mark.parametrize("length", [600, 1000, 3000])
def test_first_positions_spread_evenly_over_a_mid_size_range(length: int) -> None:
    # Beyond tiny domains: where the first 10 positions land, in 10 equal bins, over 4000 seeds.
    seeds, k = 4000, 10
    bins = np.zeros((k, k))
    for seed in range(seeds):
        bins[np.arange(k), Permutation(length, seed, 0)(np.arange(k)) * k // length] += 1
    assert chi2_p(bins) > 1e-3


def test_order_is_a_pure_function_of_seed_epoch_length() -> None:
    for length in (1000, EXACT_MAX + 10):
        positions = np.arange(1000)
        a = Permutation(length, 1, 2)(positions)
        assert np.array_equal(a, Permutation(length, 1, 2)(positions))
        assert not np.array_equal(a, Permutation(length, 1, 3)(positions))
        assert not np.array_equal(a, Permutation(length, 2, 2)(positions))


def test_golden_orders() -> None:
    # Pinned so that an accidental change of the hash or the construction shows up as a test
    # failure: every checkpoint written before such a change would resume into a different order.
    assert Permutation(10, seed=1, epoch=0)(np.arange(10)).tolist() == [8, 1, 2, 7, 9, 5, 3, 6, 0, 4]
    # Above EXACT_MAX the order is resumable_data 0.1.0's (order version 1): its checkpoints keep it.
    assert Permutation(10**6 + 3, seed=5, epoch=2)(np.arange(4)).tolist() == [737670, 909190, 711601, 11683]
    assert Permutation(EXACT_MAX + 1, seed=5, epoch=2)(np.arange(4)).tolist() == [15959, 3288, 1043, 9149]


def test_evaluates_single_positions_of_a_billion_without_materializing() -> None:
    perm = Permutation(10**9, seed=0, epoch=0)
    chunk = perm(np.arange(900_000_000, 900_000_064))
    assert chunk.min() >= 0 and chunk.max() < 10**9 and len(set(chunk.tolist())) == 64
    assert perm[900_000_000] == chunk[0]


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ResumeError, match="length"):
        Permutation(0, 0, 0)
    for length in (5, EXACT_MAX + 1):
        with pytest.raises(IndexError, match="positions"):
            Permutation(length, 0, 0)(np.array([length]))


def sampler_state(length: int, *, shuffle: bool = True, version: int = 1) -> dict[str, Any]:
    return {**ResumableSampler(length, seed=3, shuffle=shuffle).state_dict(), "version": version, "position": 4}


def test_an_old_checkpoint_whose_small_shuffled_order_changed_is_refused_saying_what_to_do() -> None:
    sampler = ResumableSampler(100, seed=3)
    with pytest.raises(ResumeError, match=r"version 1.*changed.*resumable_data 0\.1\.0.*strict=False"):
        sampler.load_state_dict(sampler_state(100))
    assert sampler.position == 0  # nothing changed
    sampler.load_state_dict(sampler_state(100), strict=False)  # the position, in the new order
    assert sampler.position == 4


@pytest.mark.parametrize(("length", "shuffle"), [(EXACT_MAX + 1, True), (100, False)])
def test_an_old_checkpoint_whose_order_did_not_change_still_loads(length: int, shuffle: bool) -> None:
    sampler = ResumableSampler(length, seed=3, shuffle=shuffle)
    sampler.load_state_dict(sampler_state(length, shuffle=shuffle))
    assert sampler.position == 4


def test_a_stream_state_from_before_the_shard_order_changed_is_refused() -> None:
    stream = ShardedIterable(["a", "b", "c"], read_shard=lambda shard, start: iter(()), seed=0)
    with pytest.raises(ResumeError, match="version 1"):
        stream.load_state_dict({**stream.state_dict(), "version": 1})


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


@settings(max_examples=50, deadline=None)
@given(ends=st.lists(st.integers(1, 3000), min_size=1, max_size=4, unique=True), seed=st.integers(0, 2**64 - 1))
def test_a_piecewise_permutation_keeps_its_first_piece_and_permutes_each_appended_piece(
    ends: list[int], seed: int
) -> None:
    ends = sorted(ends)
    order = PiecewisePermutation(tuple(ends), seed, 3)(np.arange(ends[-1]))
    assert order[: ends[0]].tolist() == Permutation(ends[0], seed, 3)(np.arange(ends[0])).tolist()
    for start, end in itertools.pairwise([0, *ends]):
        assert sorted(order[start:end].tolist()) == list(range(start, end))
