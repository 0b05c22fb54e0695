"""Rank and world size: the one lookup both loaders and the distributed helpers share."""

from __future__ import annotations

import torch.distributed as dist

from ..errors import ResumeError


def distributed_defaults(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group`` when torch.distributed is initialized, else ``(0, 1)``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    if group is not None:
        raise ResumeError("group= was given but torch.distributed is not initialized; call init_process_group first")
    return 0, 1
