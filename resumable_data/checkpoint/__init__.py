"""Checkpoints on disk: the manager, its manifest, durable writes, the run lock, weights-only loads,
``DcpStore`` (durable folders for DCP's files), which checkpoint to resume from, ``inspect``, and
``GracefulStop`` (save at the next step boundary on SIGTERM). Imports neither loader."""

from .dcp import DcpStore
from .lock import CheckpointLockedError
from .manager import CheckpointManager
from .resume import choose_checkpoint
from .signals import GracefulStop

__all__ = ["CheckpointLockedError", "CheckpointManager", "DcpStore", "GracefulStop", "choose_checkpoint"]
