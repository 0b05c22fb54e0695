"""resumable_data: stop a PyTorch training job anywhere and continue exactly where it was.

The public surface is re-exported here; each name lives in a small module with one job.
"""

from ._state import ResumeError, Stateful
from .rng import (
    RandomMap,
    SampleKey,
    capture_rng_state,
    restore_rng_state,
    sample_generator,
    sample_numpy_rng,
    sample_seed,
)

__version__ = "0.1.0"

__all__ = [
    "RandomMap",
    "ResumeError",
    "SampleKey",
    "Stateful",
    "__version__",
    "capture_rng_state",
    "restore_rng_state",
    "sample_generator",
    "sample_numpy_rng",
    "sample_seed",
]
