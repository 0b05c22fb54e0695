"""Checkpoints on disk: the manager, its manifest, durable writes, the run lock, weights-only loads,
and ``inspect``. Imports neither loader."""

from .lock import CheckpointLockedError
from .manager import CheckpointManager

__all__ = ["CheckpointLockedError", "CheckpointManager"]
