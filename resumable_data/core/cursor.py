"""EpochCursor: which epoch the next pass covers and from where, and the epoch rules, in one place.

The sampler, the loaders and the stream loader follow the same rules, so they share this object
instead of each keeping ``epoch``/``position`` fields and re-implementing them.

Who owns a position. The cursor holds the *selection* — the epoch that ``set_epoch`` chose, or the
position a checkpoint restored — and each pass owns its progress. Two kinds of pass read it:

* A *loader* pass (``ResumableDataLoader``, ``StreamLoader``) continues its loader's own progress:
  a new ``iter()`` after a ``break`` goes on after the last batch handed out, and an ``iter()``
  after an exhausted epoch starts the next epoch — unless a selection (``set_epoch``, a restore)
  came after that loader's last pass: then the selection decides. Each loader keeps its progress
  in its own :class:`Progress`, so two loaders over one sampler do not move each other.
* A *sampler* pass (a ``ResumableSampler`` or a loader's ``batch_sampler`` iterated by anyone else:
  a plain or torchdata ``DataLoader``, accelerate's rebuilt loader, ``list()``) is pure: it covers
  the selected epoch from its start, as ``DistributedSampler`` does, and never moves what the
  next pass yields. Inspecting a sampler changes nothing.

The rules:

* ``set_epoch(e)``: the next pass is epoch ``e`` from its start — also after an exhausted or
  broken-off epoch ``e`` (a validation loader gets a full pass each time). The one exception is a
  pending restore (``load_state_dict`` and nothing has drawn since): ``set_epoch`` with the
  restored epoch (or, when the restored epoch was finished, with the next one) keeps the restored
  position, so loops that call ``set_epoch(epoch)`` at the top of every epoch resume mid-epoch. Any
  other epoch then warns (:class:`ResumeWarning`): that is the classic ``for epoch in
  range(num_epochs)`` loop that forgot to start from ``loader.epoch``.
* A restore is consumed by the first pass that draws (like torchdata's
  ``StatefulDistributedSampler``); a loader's pass after a restored *finished* epoch starts the
  next epoch unless ``set_epoch`` pinned the restored one.
* A caller whose epoch counter restarted (accelerate's ``DataLoaderShard`` numbers its passes from
  0 in every process and calls ``set_epoch`` with that number before torchdata applies the
  restored state to the sampler's iterator): when a restore arrives through an iterator after
  ``set_epoch(k)`` and its epoch ``E`` differs from ``k``, later ``set_epoch(j)`` select epoch
  ``j + E - k``. A torchdata state taken after its epoch ended (accelerate marks every state taken
  on an epoch's last batch so) is replaced by a fresh iterator before it draws: that pass is the
  next epoch, ``E + 1``, and the offset is ``E + 1 - k``. Any other restore resets the offset.
* Only the newest pass reports progress: each pass start and each selection starts a new
  *generation*, and an older iterator's progress is ignored. That keeps an abandoned or draw-ahead
  iterator (a DataLoader prefetching, a checkpoint library creating a throwaway iterator) from
  moving the state of the one that is really consumed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import ResumeWarning
from .state import check_int_arg

__all__ = ["EpochCursor", "Progress", "Segment"]


class Segment(NamedTuple):
    """A stretch of an epoch that one iteration covers: ``epoch`` from ``start``."""

    epoch: int
    start: int
    generation: int


@dataclass
class Progress:
    """Where a pass stands: ``epoch``, ``position`` (in its owner's unit), ``done`` (the epoch is exhausted).

    ``generation`` is that of the pass (or selection) that wrote it; -1 before any.
    """

    epoch: int = 0
    position: int = 0
    done: bool = False
    generation: int = -1


class EpochCursor:
    """The selected epoch and start of an order, with the epoch rules (see the module docstring).

    ``position`` is whatever unit the owner counts (global samples for the sampler; unused by the
    stream loader, whose position is its slot states). ``epoch``, ``position`` and ``done`` report
    the newest pass's progress (or the newest selection). Methods that take ``owner`` act for a
    loader that keeps its progress in that :class:`Progress` (default: one the cursor holds, for an
    owner that is the cursor's only loader).
    """

    def __init__(self, what: str, on_new_epoch: Callable[[], None] | None = None) -> None:
        self._what = what  # how the owner is named in messages ("loader", "sampler", ...)
        # Called whenever iteration or set_epoch leaves the current epoch for another one: an owner
        # that keeps something about one epoch only (the sampler's grown order) drops it then.
        self._on_new_epoch = on_new_epoch
        # What a pass covers unless its loader continues its own progress: the epoch set_epoch chose
        # (position 0) or a restored position, or the epoch a pass moved on to by itself.
        self._selection = Progress(generation=0)
        self._selection_pinned = False  # the selection came from set_epoch
        self._restored = False  # the selection is a restore and no pass has drawn since
        self._restored_for_loader = False  # ... made through a loader: a sampler pass does not consume it
        self._selection_explicit = True  # the selection came from set_epoch or a restore, not a pass
        # (epoch, set_epoch's argument before it) of a restore through an iterator at an epoch's end,
        # until the next selection or pass: the fresh pass after it is the one set_epoch was meant for.
        self._ended: tuple[int, int | None] | None = None
        self._offset = 0  # added to set_epoch's argument (a caller whose counter restarted)
        self._requested: int | None = None  # set_epoch's argument since the last pass began
        self._generation = 0
        self._report = Progress(generation=0)
        self._undrawn = False  # the newest generation is a pass that has not drawn yet
        self._owner = Progress()

    @property
    def epoch(self) -> int:
        """The epoch of the newest pass or selection."""
        return self._report.epoch

    @property
    def position(self) -> int:
        """Progress of the newest pass (or the selected start), in the owner's unit."""
        return self._report.position

    @property
    def done(self) -> bool:
        """Whether the newest pass (or the restored position) exhausted its epoch."""
        return self._report.done

    @property
    def pinned(self) -> bool:
        """Whether ``set_epoch`` chose the epoch and no pass has begun since."""
        return self._selection_pinned and self._generation == self._selection.generation

    # -- a loader's passes ---------------------------------------------------------------------
    def state_of(self, owner: Progress | None = None) -> Progress:
        """The loader's position: its own progress, or the selection when one came after its last pass.

        The result is read-only.
        """
        owner = owner or self._owner
        if owner.generation >= self._selection.generation:
            return owner
        # A selection a pass made by moving on by itself (another loader's) does not move this loader.
        return owner if owner.generation >= 0 and not self._selection_explicit else self._selection

    def next_segment(self, owner: Progress | None = None) -> tuple[int, int]:
        """``(epoch, start)`` the loader's next ``begin()`` covers, without changing anything."""
        state = self.state_of(owner)
        if state.done and not (state is self._selection and self._selection_pinned):
            return state.epoch + 1, 0
        return state.epoch, state.position

    def begin(self, owner: Progress | None = None) -> Segment:
        """Enter the stretch the loader's next iteration covers (see the module docstring)."""
        owner = owner or self._owner
        state = self.state_of(owner)
        epoch, start = self.next_segment(owner)
        done = state.done and (epoch, start) == (state.epoch, state.position)
        segment = self._new_pass(epoch, start, done)
        owner.epoch, owner.position, owner.done, owner.generation = epoch, start, done, segment.generation
        return segment

    def advance(self, segment: Segment, position: int, done: bool, owner: Progress | None = None) -> None:
        """Record the progress of the loader's pass that ``segment`` started; stale passes are ignored."""
        owner = owner or self._owner
        if owner.generation == segment.generation:
            owner.position, owner.done = position, done
        self._report_pass(segment, position, done, consume=True)

    # -- a sampler's passes ----------------------------------------------------------------------
    def _pass_start(self) -> tuple[int, int, bool, int]:
        """``(epoch, start, done, offset)`` of the next sampler pass."""
        selection = self._selection
        if self._ended is not None:
            # A fresh pass after the restored iterator's epoch had ended (torchdata replaces an iterator
            # restored from a state taken after the epoch's end, with workers after it has drawn its
            # empty rest): the same epoch again, as any pass without set_epoch; after set_epoch(k), the
            # next epoch, which k was meant to number.
            epoch, requested = self._ended
            if requested is None:
                return epoch, 0, False, self._offset
            return epoch + 1, 0, False, epoch + 1 - requested
        if self._restored:
            return selection.epoch, selection.position, selection.done, self._offset
        return selection.epoch, 0, False, self._offset

    def next_pass(self) -> tuple[int, int]:
        """``(epoch, start)`` the next sampler pass covers, without changing anything."""
        return self._pass_start()[:2]

    def begin_pass(self) -> Segment:
        """Enter a sampler pass: the selected epoch from its start, or from a pending restore."""
        epoch, start, done, self._offset = self._pass_start()
        return self._new_pass(epoch, start, done)

    def advance_pass(self, segment: Segment, position: int, done: bool) -> None:
        """Record a sampler pass's progress; its first draw consumes a pending restore, unless the
        restore was a loader's (inspecting a loader's sampler changes nothing)."""
        self._report_pass(segment, position, done, consume=not self._restored_for_loader)

    def _report_pass(self, segment: Segment, position: int, done: bool, *, consume: bool) -> None:
        if segment.generation == self._generation:
            report = self._report
            report.position, report.done = position, done
            self._undrawn = False
            if self._restored and consume:
                self._consume()

    # -- selections ----------------------------------------------------------------------------
    def restore(
        self, epoch: int, position: int, done: bool, *, through_iterator: bool = False, for_loader: bool = False
    ) -> Segment:
        """Jump to a (validated) checkpointed position; returns it as the segment of the restoring pass.

        ``through_iterator``: the state is applied to a sampler pass's iterator (torchdata's
        ``StatefulDataLoader``), after whatever ``set_epoch`` the caller made for that pass.
        ``for_loader``: a loader's ``load_state_dict``; only a loader pass consumes the restore.
        """
        requested = self._requested if through_iterator else None
        self._offset = 0 if requested is None else epoch - requested
        self._select(epoch, position, done, pinned=False, leaving=False)
        self._restored, self._restored_for_loader = True, for_loader
        self._ended = (epoch, requested) if through_iterator and done else None
        return Segment(epoch, position, self._generation)

    def set_epoch(self, epoch: int) -> bool:
        """Select ``epoch`` from its start, unless it keeps a pending restore (see the module docstring).

        Returns:
            True if the next pass starts the selected epoch from its beginning; False if the
            restored position was kept.
        """
        check_int_arg("epoch", epoch, minimum=0)
        self._requested = epoch
        return self._select_epoch(epoch + self._offset)

    def _select_epoch(self, target: int) -> bool:
        """``set_epoch`` of an epoch in the cursor's own numbering (no caller's offset); see there."""
        selection = self._selection
        if self._restored:
            if target == selection.epoch:
                self._selection_pinned = True
                return False
            if not (selection.done and target == selection.epoch + 1):
                where = "at the end" if selection.done else f"at position {selection.position}"
                warnings.warn(
                    f"{self._what}.set_epoch({target - self._offset}) discards the restored position: the checkpoint left "
                    f"off in epoch {selection.epoch}, {where}. Start the epoch loop from the restored epoch, "
                    f"`for epoch in range({self._what}.epoch, num_epochs)`, or let "
                    f"`for epoch in {self._what}.epochs(num_epochs)` do it",
                    ResumeWarning,
                    stacklevel=4,
                )
        elif self._undrawn and (self._report.epoch, self._report.position) == (target, 0):
            return True  # a loader's pass of that epoch from its start has begun (Lightning calls iter() first)
        self._select(target, 0, False, pinned=True, leaving=True)
        return True

    # -- the loop that can't go wrong --------------------------------------------------------------
    def epochs(
        self, num_epochs: int, set_epoch: Callable[[int], object] | None = None, owner: Progress | None = None
    ) -> Iterator[int]:
        """Yield a loader's epochs still to run, ``set_epoch`` applied to each.

        Starts with the epoch the loader's next iteration covers (the restored one, or the one after
        an exhausted epoch) and ends before ``num_epochs``. An epoch left by a ``break`` is yielded
        again without ``set_epoch``, so its rest is consumed. ``set_epoch`` is the owner's, when it
        has more to do than select the epoch (the stream loader resets its slots).
        """
        check_int_arg("num_epochs", num_epochs, minimum=0)
        owner = owner or self._owner
        while True:
            epoch = self.next_segment(owner)[0]
            if epoch >= num_epochs:
                return
            if self.state_of(owner) is not owner or owner.done:  # else: continue the broken-off pass
                (set_epoch or self._select_epoch)(epoch)
            yield epoch

    def pass_epochs(self, num_epochs: int) -> Iterator[int]:
        """Yield a sampler's epochs still to run, each ``set_epoch``-ed, one after another like ``range``.

        Starts with the restored epoch (the next one if it was finished), else the epoch after the
        newest pass if that pass exhausted it, else the selected epoch.
        """
        check_int_arg("num_epochs", num_epochs, minimum=0)
        last = -1
        while True:
            state = self._selection if self._restored else self._report
            epoch = state.epoch + 1 if state.done and not self.pinned else state.epoch
            epoch = max(epoch, last + 1)  # a sampler pass restarts its epoch: never yield one twice
            if epoch >= num_epochs:
                return
            self._select_epoch(epoch)
            last = epoch
            yield epoch

    # -- internals -----------------------------------------------------------------------------
    def _select(
        self, epoch: int, position: int, done: bool, *, pinned: bool, leaving: bool, explicit: bool = True
    ) -> None:
        """Make ``(epoch, position)`` what the next pass covers; a new generation."""
        if leaving and epoch != self._selection.epoch and self._on_new_epoch is not None:
            self._on_new_epoch()
        self._restored, self._restored_for_loader, self._ended, self._undrawn = False, False, None, False
        self._selection_explicit = explicit
        self._generation += 1  # an iterator of the old selection must not move the new one
        self._selection = Progress(epoch, position, done, self._generation)
        self._selection_pinned = pinned
        self._report = Progress(epoch, position, done, self._generation)

    def _new_pass(self, epoch: int, start: int, done: bool) -> Segment:
        # A pending restore stays pending until the pass draws: a set_epoch of its epoch between a
        # loader's iter() and its first batch (Lightning's order) keeps it.
        self._requested, self._ended = None, None
        if epoch != self._selection.epoch:  # the pass moved on to another epoch by itself
            self._select(epoch, 0, False, pinned=False, leaving=True, explicit=False)
        else:
            self._generation += 1
            self._report = Progress(epoch, start, done, self._generation)
        self._undrawn = True
        return Segment(epoch, start, self._generation)

    def _consume(self) -> None:
        """A pass has drawn: the pending restore and the caller's request are spent."""
        self._restored = False
        self._requested = None
