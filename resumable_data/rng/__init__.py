"""Randomness: capture and restore the global RNGs (one process, or each rank of a job), per-sample RNGs, per-batch global-RNG seeding."""

from .capture import capture_rng_state, restore_rng_state
from .ranks import rank_seed, restore_rank_rng_state, seed_everything
from .sample import RandomMap, SampleKey, sample_generator, sample_numpy_rng, sample_seed

__all__ = [
    "RandomMap",
    "SampleKey",
    "capture_rng_state",
    "rank_seed",
    "restore_rank_rng_state",
    "restore_rng_state",
    "sample_generator",
    "sample_numpy_rng",
    "sample_seed",
    "seed_everything",
]
