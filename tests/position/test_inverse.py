"""The permutations are invertible per position: ``perm.inverse(perm(p)) == p`` for every position.

That is what lets ``where --sample`` say where a sample is read at the cost of one position: the
exact shuffle (up to EXACT_MAX), the Feistel network (above it; here also at small sizes, where cycle
walking does the most work) and the piecewise order of a grown epoch.
"""

from __future__ import annotations

import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_data.core.permutation import EXACT_MAX, FeistelPermutation, Permutation, PiecewisePermutation

seeds = st.integers(-(2**63), 2**64 - 1)


@settings(max_examples=60)
@given(length=st.integers(1, 300), seed=seeds, epoch=st.integers(0, 1000))
def test_every_position_of_a_small_order_comes_back(length: int, seed: int, epoch: int) -> None:
    positions = np.arange(length)
    for perm in (Permutation(length, seed, epoch), FeistelPermutation(length, seed, epoch)):
        indices = perm(positions)
        assert perm.inverse(indices).tolist() == positions.tolist()
        assert perm(perm.inverse(positions)).tolist() == positions.tolist()


@settings(max_examples=30)
@given(
    ends=st.lists(st.integers(1, 60), min_size=1, max_size=4).map(lambda steps: tuple(np.cumsum(steps).tolist())),
    seed=seeds,
    epoch=st.integers(0, 50),
)
def test_a_grown_epochs_piecewise_order_is_inverted_piece_by_piece(
    ends: tuple[int, ...], seed: int, epoch: int
) -> None:
    perm = PiecewisePermutation(ends, seed, epoch)
    positions = np.arange(ends[-1])
    assert perm.inverse(perm(positions)).tolist() == positions.tolist()


def test_the_largest_exact_order_and_the_smallest_feistel_one_are_inverted() -> None:
    for length in (EXACT_MAX, EXACT_MAX + 1):
        perm = Permutation(length, 5, 2)
        positions = np.arange(length)
        assert perm.inverse(perm(positions)).tolist() == positions.tolist()


def test_inverting_a_billion_sample_order_costs_one_position() -> None:
    perm = Permutation(10**9, 0, 3)
    positions = np.array([0, 1, 123_456_789, 10**9 - 1])
    started = time.perf_counter()
    back = perm.inverse(perm(positions))
    assert time.perf_counter() - started < 0.5
    assert back.tolist() == positions.tolist()
