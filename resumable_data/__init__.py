"""resumable_data: stop a PyTorch training job anywhere and continue exactly where it was.

The public surface is re-exported here. Each part is a subpackage: ``core`` (state keys, hashing,
the keyed permutation), ``map`` (sampler and loader), ``rng``, ``checkpoint``, ``streams``; and
``distributed``, ``testing`` and ``errors`` beside them.
"""

from .checkpoint import CheckpointLockedError, CheckpointManager, DcpStore, choose_checkpoint
from .core.permutation import Permutation
from .core.version import __version__
from .distributed import (
    DataLoaderState,
    check_world_size,
    dcp_errors,
    decide_on_rank_zero,
    fail_together,
    global_state,
    require_agreement,
)
from .errors import ResumeError, ResumeWarning, Stateful
from .map import ResumableDataLoader, ResumableSampler, wrap
from .rng import (
    RandomMap,
    SampleKey,
    capture_rng_state,
    rank_seed,
    restore_rank_rng_state,
    restore_rng_state,
    sample_generator,
    sample_numpy_rng,
    sample_seed,
    seed_everything,
)
from .signals import GracefulStop
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
    "DcpStore",
    "GracefulStop",
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
    "choose_checkpoint",
    "dcp_errors",
    "decide_on_rank_zero",
    "fail_together",
    "global_state",
    "mix",
    "rank_seed",
    "require_agreement",
    "restore_rank_rng_state",
    "restore_rng_state",
    "sample_generator",
    "sample_numpy_rng",
    "sample_seed",
    "seed_everything",
    "wrap",
]
