"""Checkpoints inside a gradient-accumulation window, resumed from the window's start.

With gradient accumulation an optimizer step consumes ``steps`` micro-batches. A checkpoint written
between two of them (a preemption handler that saves when the signal arrives, a save every N batches)
holds the weights, optimizer and LR scheduler of the window's start, since nothing stepped them
since, but not the gradient accumulated over the window's first micro-batches: DeepSpeed, Lightning
and accelerate all start an empty window after a load. Resuming from the data position of the save
then trains the window's remaining micro-batches alone, or shifts every later optimizer step: a
different run, silently.

:class:`AccumulationWindow` iterates a loader and remembers, at the start of every window, the
loader's state and every global RNG (:func:`~resumable_data.capture_rng_state`). Its state is that
of the open window's start, with how many micro-batches of the window were drawn (``rewind``): the
resumed run reads those again, with the RNG states they had, and recomputes the same gradient
(bitwise on CPU) before the window's optimizer step. The cost is at most ``steps - 1`` micro-batches
of forward and backward once per resume, whatever the position in the epoch. Saving the accumulated
gradients instead would add a model-sized tensor per rank to every checkpoint, and is out of reach
where the trainer keeps them partitioned in its own buffers (DeepSpeed ZeRO 2 and 3 have no public
API for them).

On a window's boundary (``rewind == 0``) the state is the loader's and the RNGs' at the save, as a
loop without accumulation would save them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from .core.state import VERSION, check_int_arg, check_version, keys_of, require_int, require_mapping
from .errors import ResumeError
from .rng.capture import capture_rng_state, restore_rng_state

__all__ = ["AccumulationWindow"]

STATE_VERSION = 1
# The keys of AccumulationWindow.state_dict(), declared once.
DATALOADER = "dataloader"  # the loader's state at the open window's start
RNG = "rng"  # capture_rng_state() at the open window's start
REWIND = "rewind"  # micro-batches of the open window drawn before the save: read again on resume
STEPS = "steps"  # micro-batches per optimizer step
_WHAT = "AccumulationWindow"


class StatefulIterable(Protocol):
    """A loader: iterable, with ``state_dict()`` and ``load_state_dict()``."""

    def __iter__(self) -> Iterator[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None: ...


class AccumulationWindow:
    """Iterates ``loader`` and keeps the state of the open gradient-accumulation window's start.

    Args:
        loader: the training loader (a :class:`~resumable_data.ResumableDataLoader`, a
            :class:`~resumable_data.StreamLoader`, or any iterable with ``state_dict``/``load_state_dict``).
        steps: micro-batches per optimizer step (the gradient-accumulation steps).
        restart_each_pass: each pass of the loader starts a window (the trainer steps at a pass's end).

    Windows run on across epochs, as a trainer's micro-step counter does: iterate the window where
    you would iterate the loader (``set_epoch`` still goes to the loader). With
    ``restart_each_pass=True`` every pass of the loader starts a window instead, for a trainer that
    steps the optimizer at the end of each pass (accelerate's ``sync_with_dataloader``).

    Example:
        >>> import torch
        >>> from resumable_data import ResumableDataLoader
        >>> from resumable_data.accumulation import AccumulationWindow
        >>> loader = ResumableDataLoader(torch.arange(12), batch_size=2, seed=0)
        >>> window = AccumulationWindow(loader, steps=3)
        >>> batches = iter(window)
        >>> first = [next(batches) for _ in range(4)]  # one optimizer step, then one micro-batch
        >>> saved = window.state_dict()  # inside the second window
        >>> saved["rewind"], saved["dataloader"]["position"]
        (1, 6)
        >>> resumed = AccumulationWindow(ResumableDataLoader(torch.arange(12), batch_size=2, seed=0), steps=3)
        >>> resumed.load_state_dict(saved)  # the loader and the RNGs as the window began
        >>> bool(torch.equal(next(iter(resumed)), first[3]))  # that micro-batch is read again
        True
    """

    def __init__(self, loader: StatefulIterable, steps: int, *, restart_each_pass: bool = False) -> None:
        self.loader = loader
        self.steps = check_int_arg("steps", steps, minimum=1)
        self.restart_each_pass = restart_each_pass
        self._taken = 0  # micro-batches of the open window drawn
        self._start: tuple[dict[str, Any], dict[str, Any]] | None = None  # (loader state, RNG states)

    @property
    def taken(self) -> int:
        """Micro-batches of the open window drawn so far (0 on a window's boundary)."""
        return self._taken

    def __iter__(self) -> Iterator[Any]:
        if self.restart_each_pass:
            self._taken = 0
        batches = iter(self.loader)
        while True:
            if self._taken == 0:  # before the window's first micro-batch is drawn
                self._start = (self.loader.state_dict(), capture_rng_state())
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._taken = (self._taken + 1) % self.steps
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The state to resume from: the open window's start, or the present on a window's boundary.

        Returns:
            ``{"version", "steps", "rewind", "dataloader", "rng"}``: ``rewind`` micro-batches of the
            window were drawn before the save; ``dataloader`` and ``rng`` are the loader's state and
            :func:`~resumable_data.capture_rng_state` from before the first of them.
        """
        if self._taken == 0 or self._start is None:
            loader_state, rng = self.loader.state_dict(), capture_rng_state()
        else:
            loader_state, rng = self._start
        return {VERSION: STATE_VERSION, STEPS: self.steps, REWIND: self._taken, DATALOADER: loader_state, RNG: rng}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Put the loader and the global RNGs back where the saved window began.

        The resumed run draws the window's first ``state_dict["rewind"]`` micro-batches again: a step
        counter that counts micro-batches goes back by as many.

        Raises:
            ResumeError: malformed state, another version, or ``steps`` differs (the window would
                end elsewhere); the loader, the RNGs and the window are unchanged.
        """
        state = parse_state(state_dict)
        if state[STEPS] != self.steps:
            raise ResumeError(
                f"{_WHAT} state was saved with steps={state[STEPS]} micro-batches per optimizer step, this window has "
                f"steps={self.steps}; resume with the gradient accumulation that wrote the checkpoint"
            )
        rng_before = capture_rng_state()
        restore_rng_state(state[RNG])  # checks the RNG part before the loader is touched
        try:
            self.loader.load_state_dict(state[DATALOADER])
        except BaseException:
            restore_rng_state(rng_before)
            raise
        self._taken, self._start = 0, None


def parse_state(state_dict: Any) -> Mapping[str, Any]:
    """:meth:`AccumulationWindow.state_dict`'s value, its own fields checked (the parts check theirs)."""
    state = require_mapping(state_dict, _WHAT)
    check_version(state, STATE_VERSION, _WHAT)
    for key in (DATALOADER, RNG):
        if key not in state:
            raise ResumeError(f"{_WHAT} state is missing the key {key!r}; got keys {keys_of(state)}")
    steps = require_int(state, STEPS, _WHAT, minimum=1)
    rewind = require_int(state, REWIND, _WHAT, minimum=0)
    if rewind >= steps:
        raise ResumeError(f"{_WHAT} state has rewind={rewind}, expected fewer than its steps={steps} micro-batches")
    return state
