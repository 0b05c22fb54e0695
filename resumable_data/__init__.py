"""resumable_data: stop a PyTorch training job anywhere and continue exactly where it was.

The public surface is re-exported here; each name lives in a small module with one job.
"""

from ._state import ResumeError, Stateful
from ._version import __version__
from .checkpoint import CheckpointLockedError, CheckpointManager
from .dataloader import ResumableDataLoader, wrap
from .permutation import Permutation
from .sampler import ResumableSampler
from .rng import (
    RandomMap,
    SampleKey,
    capture_rng_state,
    restore_rng_state,
    sample_generator,
    sample_numpy_rng,
    sample_seed,
)
from .streams import (
    IterableSource,
    ReplayWarning,
    ShardedIterable,
    Stream,
    StreamLoader,
    TextLineReader,
    TokenShardReader,
    mix,
)

__all__ = [
    "CheckpointLockedError",
    "CheckpointManager",
    "IterableSource",
    "Permutation",
    "RandomMap",
    "ResumableDataLoader",
    "ResumableSampler",
    "ReplayWarning",
    "ResumeError",
    "SampleKey",
    "ShardedIterable",
    "Stateful",
    "Stream",
    "StreamLoader",
    "TextLineReader",
    "TokenShardReader",
    "__version__",
    "capture_rng_state",
    "mix",
    "restore_rng_state",
    "sample_generator",
    "sample_numpy_rng",
    "sample_seed",
    "wrap",
]
