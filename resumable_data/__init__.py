"""resumable_data: stop a PyTorch training job anywhere and continue exactly where it was.

The top level holds what a training loop needs; the rest lives in its namespace:
``resumable_data.streams`` (sources, readers, stages), ``resumable_data.rng`` (per-sample and
per-rank randomness), ``resumable_data.checkpoint`` (stores, lock, resume choice, ``GracefulStop``),
``resumable_data.distributed`` (a job's state across ranks, agreement between ranks),
``resumable_data.core`` (``Permutation``), ``resumable_data.integrations`` (one module per trainer),
and ``testing`` and ``errors`` beside them.
"""

import importlib
import warnings
from typing import Any

from .checkpoint import CheckpointManager
from .core.version import __version__
from .errors import ResumeError, ResumeWarning, Stateful
from .map import ResumableDataLoader, ResumableSampler, wrap
from .rng import capture_rng_state, restore_rng_state, seed_everything
from .streams import ShardedIterable, Stream, StreamLoader, mix

__all__ = [
    "CheckpointManager",
    "ResumableDataLoader",
    "ResumableSampler",
    "ResumeError",
    "ResumeWarning",
    "ShardedIterable",
    "Stateful",
    "Stream",
    "StreamLoader",
    "__version__",
    "capture_rng_state",
    "mix",
    "restore_rng_state",
    "seed_everything",
    "wrap",
]

# Names that were top-level in 0.1.0 and moved to a namespace: each still resolves here, with a
# DeprecationWarning naming its new home, for one release. Imported only when asked for.
_MOVED = {
    "CheckpointLockedError": "resumable_data.checkpoint",
    "DataLoaderState": "resumable_data.distributed",
    "DcpStore": "resumable_data.checkpoint",
    "GracefulStop": "resumable_data.checkpoint",
    "IterableSource": "resumable_data.streams",
    "ParquetReader": "resumable_data.streams",
    "Permutation": "resumable_data.core",
    "RandomMap": "resumable_data.rng",
    "ReplayWarning": "resumable_data.streams",
    "SampleKey": "resumable_data.rng",
    "TextLineReader": "resumable_data.streams",
    "TokenShardReader": "resumable_data.streams",
    "check_world_size": "resumable_data.distributed",
    "choose_checkpoint": "resumable_data.checkpoint",
    "dcp_errors": "resumable_data.distributed",
    "decide_on_rank_zero": "resumable_data.distributed",
    "fail_together": "resumable_data.distributed",
    "global_state": "resumable_data.distributed",
    "rank_seed": "resumable_data.rng",
    "require_agreement": "resumable_data.distributed",
    "restore_rank_rng_state": "resumable_data.rng",
    "sample_generator": "resumable_data.rng",
    "sample_numpy_rng": "resumable_data.rng",
    "sample_seed": "resumable_data.rng",
}


def __getattr__(name: str) -> Any:
    """A moved name from its new home, with a ``DeprecationWarning`` that says where it is now."""
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"resumable_data.{name} moved and the old name goes in the next release; use `from {home} import {name}`",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(home), name)
