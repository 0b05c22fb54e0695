"""The shards a slot reads next, for a reader that caches remote shards (one with a ``planner()``).

The order is keyed, so a slot knows every shard it will read, in order: the rest of its epoch
from the shard it is reading, then its shards of the next epoch (a pure function of the seed, the
epoch and the slot). :class:`Plans` hands that schedule to the reader's planner each time the slot
moves to another shard, so that a node-local cache prefetches exactly what comes next, across the
epoch boundary, and evicts the shard whose next use is furthest away. With it goes how many shards
at the schedule's head the slot reads now (``reading=``): a shuffle window reads by key from all the
shards it spans, and what comes next is the shards after them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from ..base import Slot
from ..plan_scope import note_sent
from .layout import Dealt, EpochOrder
from .shards import Shards

__all__ = ["PLAN_AHEAD", "Plans"]

PLAN_AHEAD = 1024  # shards of the schedule given: a cache treats a shard beyond them as not needed soon
_LOOK_AROUND = 64  # shards either side of the position searched for those read by key (a shuffle's window)


class Plans:
    """Sends a slot's schedule to a reader's planner when its first shard changes (per process)."""

    def __init__(self) -> None:
        self._sent: tuple[Any, ...] | None = None
        # Where the last send stood, by position: a shuffle's fetches from the same shards ask again
        # and again (a window's every chunk), and the answer is the same.
        self._asked: tuple[Any, ...] | None = None

    def send(
        self,
        reader: Any,
        shards: Shards,
        where: tuple[EpochOrder, Slot, Dealt, int | None, Sequence[Sequence[int]]],
        reading: Collection[int] = (),
    ) -> None:
        """Tell ``reader`` the shards its slot reads from now on.

        Args:
            reader: the slot's reader; nothing is done unless its ``planner()`` gives a callable.
            shards: the shard list.
            where: the slot's epoch order, slot, layout changes, position (None: by cursors) and
                ``[shard, cursor]`` entries still to read.
            reading: shard indices being read by key (a shuffle reads behind the position): the
                schedule starts at the earliest of them.
        """
        planner = getattr(reader, "planner", None)
        plan: Callable[..., None] | None = planner() if planner is not None else None
        if plan is None:
            return
        order, slot, dealt, position, remaining = where
        asked = None if position is None else (os.getpid(), order, slot, dealt, position, frozenset(reading))
        if asked is not None and asked == self._asked:
            return
        following = (order[0] + 1, (shards.count,))  # the next epoch's order covers every shard
        now = 0  # shards at the schedule's head that a slot reading by key reads now: prefetch counts past them
        if position is None:
            this = np.asarray([entry[0] for entry in remaining], dtype=np.int64)
            head: tuple[Any, ...] = (len(this),)
            upcoming = shards.order(following)[slot[0] :: slot[1]]
        else:
            layout = shards.layout(order, slot, dealt)
            first = at = layout.locate(position)
            if reading:  # (reading in order, the shard read now is used first: prefetch counts past it then)
                low, high = max(0, at - _LOOK_AROUND), min(len(layout.shards), at + _LOOK_AROUND)
                hits = low + np.flatnonzero(np.isin(layout.shards[low:high], list(reading)))
                last = min(at + 1, len(layout.shards))  # through the position's shard
                if len(hits):  # and every shard read by key (a window's read-ahead may reach past it)
                    first, last = min(int(hits[0]), at), max(int(hits[-1]) + 1, last)
                now = last - first
            this, head = layout.shards[first:], (first, now)
            upcoming = shards.layout(following, slot, ()).shards
        marker = (os.getpid(), order, slot, dealt, *head)
        if marker == self._sent:
            self._asked = asked
            return
        indices = np.concatenate([this[:PLAN_AHEAD], upcoming[:PLAN_AHEAD]])[:PLAN_AHEAD]
        plan([shards.items[i] for i in indices.tolist()], reading=now)
        self._sent, self._asked = marker, asked
        note_sent(self, functools.partial(self.withdraw, plan))

    def withdraw(self, plan: Callable[..., None]) -> None:
        """Tell ``plan`` (what :meth:`send` sent to) that this slot reads nothing more: an empty
        schedule. The next :meth:`send` sends the schedule again."""
        plan([])
        self._sent = self._asked = None
