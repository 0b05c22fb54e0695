"""Known-size layout arithmetic: a slot's position <-> (shard, cursor), as pure array functions.

With the shards' record counts known, a slot's state is one number, its position: the records it
has read in its shards' order. Everything else (the shard it is in, that shard's cursor, the keys
of the records at given positions, what a layout change left unread) is computed here from the
epoch's shard order and the sizes, with array operations whose cost does not grow with the
records read. Nothing here reads a shard or keeps state.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ...core.permutation import PiecewisePermutation
from ...errors import ResumeError
from ..base import Key, Slot
from .keys import DEALT, WHAT

__all__ = ["NO_CURSOR", "Dealt", "EpochOrder", "Layout", "shard_order", "slot_layout", "unfinished"]

Dealt = tuple[tuple[int, tuple[int, ...]], ...]
"""The epoch's layout changes so far: (old number of slots, their positions) each (see DEALT)."""
EpochOrder = tuple[int, tuple[int, ...]]
"""``(epoch, piece ends)``: what an epoch's shard order is built over (see EPOCH_SHARDS)."""
NO_CURSOR = -1  # in an array of cursors by shard index: the slot has no cursor in that shard


class Layout(NamedTuple):
    """A slot's shards in reading order, with known sizes (see :func:`slot_layout`)."""

    shards: np.ndarray  # shard indices in reading order
    starts: np.ndarray  # the position where each one starts, plus the slot's total
    firsts: np.ndarray  # the offset each one is read from (its cursor at a layout change, else 0)

    @property
    def total(self) -> int:
        """Records the slot reads from its shards."""
        return int(self.starts[-1])

    def locate(self, position: int) -> int:
        """The index (in reading order) of the shard that ``position`` lies in (its count at the end)."""
        return int(np.searchsorted(self.starts, position, side="right")) - 1

    def remaining_at(self, position: int) -> list[list[int]]:
        """``[[shard, cursor]]`` of the shard that ``position`` lies in (``[]`` at the slot's end)."""
        first = self.locate(position)
        if first >= len(self.shards):
            return []
        return [[int(self.shards[first]), int(self.firsts[first] + position - self.starts[first])]]

    def listed(self, position: int) -> list[list[int]]:
        """Every shard the slot has yet to finish at ``position``, with its cursor."""
        first = self.locate(position)
        listed = [[int(i), int(o)] for i, o in zip(self.shards[first:], self.firsts[first:], strict=True)]
        if listed:
            listed[0][1] += position - int(self.starts[first])
        return listed

    def fill_cursors(self, cursor_of: np.ndarray, position: int) -> None:
        """Set ``cursor_of[shard]`` for each shard the slot has yet to finish at ``position``."""
        first = self.locate(position)
        cursor_of[self.shards[first:]] = self.firsts[first:]
        if first < len(self.shards):
            cursor_of[self.shards[first]] += position - int(self.starts[first])

    def keys(self, epoch: int, positions: np.ndarray) -> list[Key]:
        """The keys ``(epoch, shard, offset)`` of the records at ``positions`` (below the total)."""
        which = np.searchsorted(self.starts, positions, side="right") - 1
        shards = self.shards[which]
        offsets = positions - self.starts[which] + self.firsts[which]
        # zip builds the tuples in C: a shuffle buffer's fill asks for a buffer's worth of keys.
        return list(zip(itertools.repeat(epoch, len(shards)), shards.tolist(), offsets.tolist(), strict=True))


def shard_order(order: EpochOrder, seed: int, shuffle: bool) -> np.ndarray:
    """The shard indices in the order epoch ``order[0]`` reads them, over the pieces ``order[1]``."""
    epoch, pieces = order
    shards = np.arange(pieces[-1], dtype=np.int64)
    if shuffle:
        shards = PiecewisePermutation(pieces, seed, epoch)(shards)
    shards.flags.writeable = False
    return shards


def unfinished(
    sizes: np.ndarray, shards: np.ndarray, offsets: np.ndarray, num_slots: int, positions: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """What ``num_slots`` slots dealing from ``(shards, offsets)`` left unread at ``positions``:
    array operations over the shards, whatever their number."""
    lengths = sizes[shards] - offsets
    heads = np.zeros(num_slots, dtype=np.int64)  # per old slot: its index of the shard it is in
    cursors = np.zeros(num_slots, dtype=np.int64)  # and the records of that shard it has read
    for s, position in enumerate(positions):
        starts = np.zeros(len(lengths[s::num_slots]) + 1, dtype=np.int64)
        np.cumsum(lengths[s::num_slots], out=starts[1:])
        if position > starts[-1]:
            raise ResumeError(
                f"{WHAT} state field {DEALT!r}: old slot {s} of {num_slots} is at position {position}, but its "
                f"shards hold {int(starts[-1])} records; pass a state_dict() of this pipeline unchanged"
            )
        heads[s] = int(np.searchsorted(starts, position, side="right")) - 1
        cursors[s] = position - starts[heads[s]]
    keep = np.zeros(len(shards), dtype=bool)
    offsets = offsets.copy()
    for s in range(num_slots):
        first = s + num_slots * int(heads[s])  # the old slot's shard being read, then the rest of its
        keep[first::num_slots] = True
        if first < len(shards):
            offsets[first] += cursors[s]
    return shards[keep], offsets[keep]


def dealing(sizes: np.ndarray, order: np.ndarray, dealt: Dealt) -> tuple[np.ndarray, np.ndarray]:
    """The shards every slot of the current layout deals from, with the offset each one starts at:
    the epoch order, or after layout changes what was unfinished at the last one (in epoch order).

    Shards appended to the epoch's order (growth="append") come after every shard it had, so they
    end up at the end of the sequence, after each layout change, dealt to the slots of the current
    layout after the shards those already had: a slot's position keeps its meaning."""
    shards, offsets = order, np.zeros(len(order), dtype=np.int64)
    for num_slots, positions in dealt:
        shards, offsets = unfinished(sizes, shards, offsets, num_slots, positions)
    return shards, offsets


def slot_layout(sizes: np.ndarray, shards: np.ndarray, offsets: np.ndarray, slot: Slot) -> Layout:
    """Slot ``slot``'s share of the dealt ``(shards, offsets)``: every ``slot[1]``-th from ``slot[0]``."""
    mine, firsts = shards[slot[0] :: slot[1]], offsets[slot[0] :: slot[1]]
    starts = np.zeros(len(mine) + 1, dtype=np.int64)
    np.cumsum(sizes[mine] - firsts, out=starts[1:])
    return Layout(mine, starts, firsts)
