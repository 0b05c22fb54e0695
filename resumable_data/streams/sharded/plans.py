"""The shards a slot reads next, for a reader that caches remote shards (one with a ``planner()``).

The order is keyed, so a slot knows every shard it will read, in order: the rest of its epoch
from the shard it is reading, then its shards of the next epoch (a pure function of the seed, the
epoch and the slot). :class:`Plans` hands that schedule to the reader's planner each time the slot
moves to another shard, so that a node-local cache prefetches exactly what comes next, across the
epoch boundary, and evicts the shard whose next use is furthest away.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from ..base import Slot
from .layout import Dealt, EpochOrder
from .shards import Shards

__all__ = ["PLAN_AHEAD", "Plans"]

PLAN_AHEAD = 1024  # shards of the schedule given: a cache treats a shard beyond them as not needed soon
_LOOK_BACK = 64  # shards behind the position searched for one still read by key (a shuffle's window)


class Plans:
    """Sends a slot's schedule to a reader's planner when its first shard changes (per process)."""

    def __init__(self) -> None:
        self._sent: tuple[Any, ...] | None = None

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
        plan: Callable[[Sequence[Any]], None] | None = planner() if planner is not None else None
        if plan is None:
            return
        order, slot, dealt, position, remaining = where
        following = (order[0] + 1, (shards.count,))  # the next epoch's order covers every shard
        if position is None:
            this = np.asarray([entry[0] for entry in remaining], dtype=np.int64)
            head: tuple[Any, ...] = (len(this),)
            upcoming = shards.order(following)[slot[0] :: slot[1]]
        else:
            layout = shards.layout(order, slot, dealt)
            first = layout.locate(position)
            if reading:
                low = max(0, first - _LOOK_BACK)
                behind = np.flatnonzero(np.isin(layout.shards[low : first + 1], list(reading)))
                first = low + int(behind[0]) if len(behind) else first
            this, head = layout.shards[first:], (first,)
            upcoming = shards.layout(following, slot, ()).shards
        marker = (os.getpid(), order, slot, dealt, *head)
        if marker == self._sent:
            return
        indices = np.concatenate([this[:PLAN_AHEAD], upcoming[:PLAN_AHEAD]])[:PLAN_AHEAD]
        plan([shards.items[i] for i in indices.tolist()])
        self._sent = marker
