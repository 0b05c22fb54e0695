"""Checkpoints on disk: the manager, its manifest, durable writes, the run lock, weights-only loads,
``DcpStore`` (durable folders for DCP's files), which checkpoint to resume from, and ``inspect``. Imports neither loader."""

from .dcp import DcpStore
from .lock import CheckpointLockedError
from .manager import CheckpointManager
from .resume import choose_checkpoint

__all__ = ["CheckpointLockedError", "CheckpointManager", "DcpStore", "choose_checkpoint"]
