"""EpochCursor: where an epoch-structured order stands, and the epoch rules, in one place.

The sampler, the loader and the stream loader all follow the same rules, so they share this object
instead of each keeping ``epoch``/``position`` fields and re-implementing the rules:

* Iterating continues the current epoch; a new ``iter()`` after a ``break`` goes on after the last
  item handed out.
* An ``iter()`` after an exhausted epoch starts the next epoch, unless ``set_epoch`` chose one.
* ``set_epoch(e)`` with the current (e.g. just restored) epoch keeps the position, so loops that call
  ``set_epoch(epoch)`` at the top of every epoch resume mid-epoch; any other epoch starts at 0.
  After a restore, a ``set_epoch`` that would throw the restored position away warns
  (:class:`ResumeWarning`): that is the classic ``for epoch in range(num_epochs)`` loop that
  forgot to start from ``loader.epoch``.
* Only the newest iteration moves the position: each ``begin()`` (and each restore) starts a new
  *generation*, and an older iterator's progress reports are ignored. That keeps an abandoned or
  draw-ahead iterator (a DataLoader prefetching, a checkpoint library creating a throwaway
  iterator) from moving the state of the one that is really consumed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import NamedTuple

from ..errors import ResumeWarning
from .state import check_int_arg

__all__ = ["EpochCursor", "Segment"]


class Segment(NamedTuple):
    """A stretch of an epoch that one iteration covers: ``epoch`` from ``start``."""

    epoch: int
    start: int
    generation: int


class EpochCursor:
    """``(epoch, position, done)`` of an order, with the epoch rules (see the module docstring).

    ``position`` is whatever unit the owner counts (global samples for the sampler; unused by the
    stream loader, whose position is its slot states). ``done`` says the epoch has been exhausted.
    """

    def __init__(self, what: str, on_new_epoch: Callable[[], None] | None = None) -> None:
        self._what = what  # how the owner is named in messages ("loader", "sampler", ...)
        # Called whenever iteration or set_epoch leaves the current epoch for another one: an owner
        # that keeps something about one epoch only (the sampler's grown order) drops it then.
        self._on_new_epoch = on_new_epoch
        self._epoch = 0
        self._position = 0
        self._done = False
        self._pinned = False  # set_epoch() chose the epoch: the next begin() must not advance
        self._restored = False  # the position came from a checkpoint and nothing iterated since
        self._generation = 0

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    @property
    def position(self) -> int:
        """Progress in the current epoch, in the owner's unit."""
        return self._position

    @property
    def done(self) -> bool:
        """Whether the current epoch has been exhausted."""
        return self._done

    @property
    def pinned(self) -> bool:
        """Whether ``set_epoch`` chose the epoch the next ``begin()`` covers."""
        return self._pinned

    def next_segment(self) -> tuple[int, int]:
        """``(epoch, start)`` the next ``begin()`` covers, without changing anything."""
        if self._done and not self._pinned:
            return self._epoch + 1, 0
        return self._epoch, self._position

    def begin(self) -> Segment:
        """Enter the stretch the next iteration covers, advancing past an exhausted epoch."""
        epoch, start = self.next_segment()
        if epoch != self._epoch:
            self._epoch, self._position, self._done = epoch, 0, False
            self._new_epoch()
        self._pinned = self._restored = False
        self._generation += 1
        return Segment(epoch, start, self._generation)

    def advance(self, segment: Segment, position: int, done: bool) -> None:
        """Record progress of the iteration that ``segment`` started; stale iterations are ignored."""
        if segment.generation == self._generation:
            self._position, self._done = position, done

    def restore(self, epoch: int, position: int, done: bool) -> Segment:
        """Jump to a (validated) checkpointed position; returns it as the current segment."""
        self._epoch, self._position, self._done = epoch, position, done
        self._pinned, self._restored = False, True
        self._generation += 1
        return Segment(epoch, position, self._generation)

    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch``: keep the position if it is the current epoch, else start it at 0."""
        check_int_arg("epoch", epoch, minimum=0)
        if self._restored and epoch != self.next_segment()[0] and epoch != self._epoch:
            where = "at the end" if self._done else f"at position {self._position}"
            warnings.warn(
                f"{self._what}.set_epoch({epoch}) discards the restored position: the checkpoint left "
                f"off in epoch {self._epoch}, {where}. Start the epoch loop from the restored epoch, "
                f"`for epoch in range({self._what}.epoch, num_epochs)`, or let "
                f"`for epoch in {self._what}.epochs(num_epochs)` do it",
                ResumeWarning,
                stacklevel=3,
            )
        if epoch != self._epoch:
            self._epoch, self._position, self._done = epoch, 0, False
            self._generation += 1  # an iterator of the old epoch must not move the new one
            self._new_epoch()
        self._pinned = True
        self._restored = False

    def _new_epoch(self) -> None:
        if self._on_new_epoch is not None:
            self._on_new_epoch()

    def epochs(self, num_epochs: int, set_epoch: Callable[[int], None] | None = None) -> Iterator[int]:
        """Yield the epochs still to run, ``set_epoch`` applied to each: the loop that can't go wrong.

        Starts with the epoch the next iteration covers (the restored one, or the one after an
        exhausted epoch) and ends before ``num_epochs``. An epoch left by a ``break`` is yielded
        again, so its rest is consumed. ``set_epoch`` is the owner's, when it has more to do than
        move the cursor (the stream loader resets its slots).
        """
        check_int_arg("num_epochs", num_epochs, minimum=0)
        while True:
            epoch = self.next_segment()[0]
            if epoch >= num_epochs:
                return
            (set_epoch or self.set_epoch)(epoch)
            yield epoch
