"""resumable_data: stop a PyTorch training job anywhere and continue exactly where it was.

The public surface is re-exported here; each name lives in a small module with one job.
"""

from ._state import ResumeError, ResumeWarning, Stateful
from ._version import __version__
from .checkpoint import CheckpointLockedError, CheckpointManager
from .dataloader import ResumableDataLoader, wrap
from .distributed import DataLoaderState, check_world_size, dcp_errors, global_state, require_agreement
from .permutation import Permutation
from .rng import (
    RandomMap,
    SampleKey,
    capture_rng_state,
    restore_rng_state,
    sample_generator,
    sample_numpy_rng,
    sample_seed,
)
from .sampler import ResumableSampler
from .streams import (
    IterableSource,
    ParquetReader,
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
    "DataLoaderState",
    "IterableSource",
    "ParquetReader",
    "Permutation",
    "RandomMap",
    "ReplayWarning",
    "ResumableDataLoader",
    "ResumableSampler",
    "ResumeError",
    "ResumeWarning",
    "SampleKey",
    "ShardedIterable",
    "Stateful",
    "Stream",
    "StreamLoader",
    "TextLineReader",
    "TokenShardReader",
    "__version__",
    "capture_rng_state",
    "check_world_size",
    "dcp_errors",
    "global_state",
    "mix",
    "require_agreement",
    "restore_rng_state",
    "sample_generator",
    "sample_numpy_rng",
    "sample_seed",
    "wrap",
]
