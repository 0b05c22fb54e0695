"""EpochPositions: a slot's whole epoch as positions, what ``where`` and ``skip`` compute with.

A pipeline whose order follows from positions (a :class:`ShardedIterable` with known sizes, behind
``map`` and ``shuffle_window``) yields, in each (rank, worker) slot's epoch, a fixed sequence of
records: the slot's *output positions* ``0 .. length-1``. :meth:`Stream.epoch_positions
<resumable_data.streams.base.Stream.epoch_positions>` gives that sequence's length, where the
stage stands in it, the key of the record at any position (computed, nothing read), and a way to
stand at any position as reading up to there would have left the stage (nothing read either).
``where`` answers any batch of an epoch with it (``--previous``, ``--step``), not only the next
ones; ``skip`` moves a stream's checkpoint past a bad stretch with it.

Only an epoch read under one layout from its start is such a sequence: after a layout change
(another ``num_workers`` or world size) the slot's positions before the change were other slots',
and its pending records come from shuffles that held them, so a stage then gives None. So does a
stage whose records follow from the records it reads (``filter``, ``shuffle_buffer``, ``mix``,
``pack``, ``take``, the batchers): the default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .base import Key

__all__ = ["EpochPositions"]


@dataclass(frozen=True)
class EpochPositions:
    """A slot's epoch as positions, taken from a stage (see the module docstring).

    Attributes:
        length: Records the stage yields in the slot's epoch.
        position: Records it has yielded so far (where its state stands).
        keys: ``keys(positions)``: the keys of the records at these positions (each below
            ``length``), computed; valid after the stage has moved on.
        start_at: ``start_at(position)``: make the stage stand at ``position`` of this epoch as
            reading up to there leaves it, reading no record (its state then is the state an
            uninterrupted run has there). Call it while the stage still holds this slot's epoch.
    """

    length: int
    position: int
    keys: Callable[[np.ndarray], list[Key]]
    start_at: Callable[[int], None]
