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

from . import distributed as distributed  # a namespace, reachable as resumable_data.distributed as before
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

# Names that were top-level in 0.1.0 and moved to a namespace, by namespace: each still resolves
# here, with a DeprecationWarning naming its new home, for one release. Imported only when asked for.
_MOVED_TO = {
    "resumable_data.checkpoint": "CheckpointLockedError DcpStore GracefulStop choose_checkpoint",
    "resumable_data.core": "Permutation",
    "resumable_data.distributed": "DataLoaderState check_world_size dcp_errors decide_on_rank_zero fail_together "
    "global_state require_agreement",
    "resumable_data.rng": "RandomMap SampleKey rank_seed restore_rank_rng_state sample_generator sample_numpy_rng "
    "sample_seed",
    "resumable_data.streams": "IterableSource ParquetReader ReplayWarning TextLineReader TokenShardReader",
}
_MOVED = {name: home for home, names in _MOVED_TO.items() for name in names.split()}


def __getattr__(name: str) -> Any:
    """A moved name from its new home, with a ``DeprecationWarning`` that says where it is now."""
    if name == "signals":  # GracefulStop's old module, imported here until 0.1.0: importing it warns
        return importlib.import_module(f"{__name__}.signals")
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"resumable_data.{name} moved and the old name goes in the next release; use `from {home} import {name}`",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(home), name)
