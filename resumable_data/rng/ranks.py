"""Each rank's global RNGs in a data-parallel job: their seeds, and restoring them from a checkpoint
that may have been written by fewer ranks.

Every rank draws its own dropout masks (and other model randomness) from its process-global RNGs, so
a checkpoint keeps one :func:`~resumable_data.capture_rng_state` per rank, in a list indexed by rank.
A job resumed on more ranks has ranks the checkpoint never saw: they are seeded from
``(seed, step, rank)``, so such an elastic resume is still reproducible.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ResumeError
from .capture import restore_rng_state

__all__ = ["rank_seed", "restore_rank_rng_state", "seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy's global RNG and torch's (CPU and every CUDA device).

    Args:
        seed: a non-negative integer below ``2**32`` (numpy's limit).
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int, step: int | None = None) -> int:
    """A seed for rank ``rank``'s global RNGs, different per rank and per ``step``.

    Args:
        seed: the run's seed.
        rank: the rank.
        step: None at the start of a run; on a resume, the checkpoint's step, for a rank the
            checkpoint has no RNG state of.

    Returns:
        An integer in ``[0, 2**32)``: sha256 of ``"seed:rank"`` (or ``"seed:step:rank"``).

    Example::

        seed_everything(rank_seed(1337, rank))  # after building the model: dropout differs per rank
    """
    text = f"{seed}:{rank}" if step is None else f"{seed}:{step}:{rank}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def restore_rank_rng_state(states: Sequence[Mapping[str, Any]], rank: int, *, seed: int, step: int) -> bool:
    """Put back rank ``rank``'s global RNGs from a checkpoint's per-rank list.

    Args:
        states: one :func:`~resumable_data.capture_rng_state` per rank of the job that wrote the
            checkpoint, indexed by rank (for example gathered with ``all_gather_object``).
        rank: this process's rank.
        seed: the run's seed, for a rank beyond ``states``.
        step: the checkpoint's step, for a rank beyond ``states``.

    Returns:
        True if the rank's state was restored; False if the checkpoint had no such rank and the
        RNGs were seeded with ``seed_everything(rank_seed(seed, rank, step))``.

    Raises:
        ResumeError: ``states`` is not a list, or this rank's state is malformed (see
            :func:`~resumable_data.restore_rng_state`; no RNG is changed then).

    Example::

        states = [None] * world_size
        dist.all_gather_object(states, capture_rng_state())  # saved under "rng"
        ...
        restore_rank_rng_state(checkpoint["rng"], rank, seed=seed, step=checkpoint_step)
    """
    if not isinstance(states, (list, tuple)):
        raise ResumeError(
            f"the per-rank RNG states should be a list indexed by rank, but got a {type(states).__name__}; "
            "a single process's capture_rng_state() is restored with restore_rng_state()"
        )
    if rank < len(states):
        restore_rng_state(states[rank])
        return True
    seed_everything(rank_seed(seed, rank, step))
    return False
