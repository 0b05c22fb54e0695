"""How a StreamLoader deals a rank's batches of an epoch from its slots, as arithmetic.

A rank with ``k`` (worker) slots takes their batches round-robin from slot 0 at the epoch's start,
skipping a slot for good once it is exhausted (a DataLoader's ``in_order`` round-robin). With each
slot's batch count ``c_s`` of the epoch known, the ``j``-th batch of the rank lies in round ``t``,
the largest with ``sum_s min(c_s, t) <= j``: it is the ``(j - sum_s min(c_s, t))``-th of the slots
still holding more than ``t`` batches, and that slot's batch ``t``. A binary search over ``t``:
O(k log c) per batch, wherever in the epoch it lies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["Dealing", "slot_batch_count"]


def slot_batch_count(records: int, batch_size: int, drop_last: bool) -> int:
    """Batches a slot of ``records`` records yields (its last short one dropped with ``drop_last``)."""
    return records // batch_size if drop_last else -(-records // batch_size)


class Dealing:
    """One rank's round-robin over its slots in one epoch, from each slot's batch count."""

    def __init__(self, counts: Sequence[int]) -> None:
        self.counts = np.asarray(counts, dtype=np.int64)
        self.total = int(self.counts.sum())

    def _before_round(self, t: int) -> int:
        """Batches dealt before round ``t``."""
        return int(np.minimum(self.counts, t).sum())

    def _round_of(self, j: int) -> int:
        """The round that the rank's ``j``-th batch (``j < total``) is dealt in."""
        low, high = 0, int(self.counts.max())  # before_round(low) <= j < before_round(high)
        while high - low > 1:
            middle = (low + high) // 2
            if self._before_round(middle) <= j:
                low = middle
            else:
                high = middle
        return low

    def slot_of(self, j: int) -> tuple[int, int]:
        """``(slot, its batch number)`` of the rank's ``j``-th batch of the epoch (``0 <= j < total``)."""
        t = self._round_of(j)
        active = np.flatnonzero(self.counts > t)
        return int(active[j - self._before_round(t)]), t

    def taken(self, done: int) -> list[int]:
        """Each slot's batches among the rank's first ``done`` (``0 <= done <= total``)."""
        if done == self.total:
            return self.counts.tolist()
        slot, t = self.slot_of(done)
        taken = np.minimum(self.counts, t)
        taken[:slot][self.counts[:slot] > t] += 1  # the slots before it have had round t's batch
        return taken.tolist()

    def next_worker(self, done: int) -> int:
        """The slot the loader names next after the rank's first ``done`` batches."""
        if done == 0:
            return 0
        return (self.slot_of(done - 1)[0] + 1) % len(self.counts)
