"""Randomness: capture and restore the global RNGs, per-sample RNGs, per-batch global-RNG seeding."""

from .capture import capture_rng_state, restore_rng_state
from .sample import RandomMap, SampleKey, sample_generator, sample_numpy_rng, sample_seed

__all__ = [
    "RandomMap",
    "SampleKey",
    "capture_rng_state",
    "restore_rng_state",
    "sample_generator",
    "sample_numpy_rng",
    "sample_seed",
]
