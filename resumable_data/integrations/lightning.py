"""Lightning over a ResumableDataLoader or StreamLoader: the one callback a resumed fit needs.

Lightning 2.x saves and restores a train loader's ``state_dict()`` itself, in the checkpoint's fit-loop
state, so the data position resumes as it is. What it does not save is the global RNGs the model
draws from (dropout, ``torch.rand`` in ``training_step``): :class:`ResumeCallback` saves every rank's
:func:`~resumable_data.capture_rng_state` in the checkpoint and puts each back right before the
first training step after the resume. The uninterrupted run does the same: its first training step
after a checkpoint also starts from the RNG states saved in it. Whatever runs between the save and
that step (the validation Lightning runs after a checkpoint on a validation step, whose loader draws
its order and worker seeds from torch's global RNG; callbacks and hooks) is not repeated by a resumed
run, so its draws must not reach the training steps of either run. It also warns
(:class:`~resumable_data.ResumeWarning`) when a resumed fit's checkpoint holds no loader state for a
resumable loader, which would otherwise silently start the epoch over while Lightning's ``batch_idx``
goes on.

A train loader without ``len`` (a :class:`~resumable_data.StreamLoader`) is fetched one batch ahead by
Lightning (to know when the epoch ends), so the ``state_dict()`` Lightning saves is one batch past the
steps taken and a resume would skip that batch. The callback counts the batches the fit has trained
on in the epoch and, when the loader has handed out one more, replaces the saved loader state with
``loader.state_dict(unconsumed=1)``: the position before the fetched-ahead batch. No public Lightning
hook exposes that state: it is written at ``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]``
(the list of the train loaders' states, one here), the layout Lightning 2.x uses, pinned by
``tests/integrations/test_lightning.py``.

With ``limit_train_batches`` Lightning ends an epoch before the loader is exhausted and, at the next
epoch's start, calls ``loader.sampler.set_epoch``: a ResumableDataLoader starts that epoch afresh. A
checkpoint written after the epoch's last allowed batch would hold a position inside the old epoch,
and a resumed fit creates its iterator from the restored position before it calls ``set_epoch``, so
it would train on the old epoch's remaining samples. The callback saves such a state as the end of
the epoch instead (``trainer.num_training_batches`` says where Lightning ends it). A StreamLoader has
no sampler, Lightning calls no ``set_epoch`` on it and its next ``iter()`` goes on in the same epoch,
in the uninterrupted run as in a resumed one: its state is left as it is.

From a checkpoint written at an epoch's end (``ModelCheckpoint(every_n_epochs=...)`` or ``save_last``
alone, without validation inside the epoch, in a ``max_epochs`` fit) Lightning restores no loader
state: it counts the epoch as done and starts the next one with a fresh loader, whose iterator it
creates before it calls ``sampler.set_epoch(next epoch)``. For a ResumableDataLoader the callback
loads the state Lightning left in the checkpoint itself (``on_train_start``), and a loader pass that
has not drawn yet takes a ``load_state_dict`` or ``set_epoch`` made after its ``iter()``: the next
epoch is the uninterrupted fit's. A StreamLoader cannot be helped there: Lightning draws its first
batch (to learn whether the epoch is empty) before any callback hook runs, and calls no ``set_epoch``
on it, so its resumed epoch has epoch 0's order; the callback warns
(:class:`~resumable_data.ResumeWarning`) and names the checkpoint cadence that resumes it exactly
(inside epochs, ``ModelCheckpoint(every_n_train_steps=...)``, or ``Trainer(max_steps=...)``).

With ``accumulate_grad_batches > 1`` a checkpoint can be written inside an accumulation window
(``trainer.save_checkpoint`` from a callback, a hook or a preemption signal handler;
``ModelCheckpoint`` after a validation that ``val_check_interval`` puts inside a window).
``ModelCheckpoint(every_n_train_steps=...)`` cannot land there: it counts optimizer steps and saves
right after one. Lightning saves the window's position but not its accumulated gradient, and resumes
with an empty window: the optimizer step would lose the gradient of the micro-batches before the save.
After every optimizer step (and at the fit's start) the callback keeps ``Trainer.fit_loop.state_dict()``,
the fit loop's state exactly as Lightning writes it in ``checkpoint["loops"]["fit_loop"]`` (its train
loader states corrected as above), and, at the next window's first training step, the RNG states. A
checkpoint written inside the window gets those instead of the present ones: it is the checkpoint
Lightning would have written at the window's start (the weights, optimizer and scheduler are those of
the window's start anyway, nothing stepped them since). The resumed fit reads the window's
micro-batches again, with their RNG states, and recomputes the same gradient, bitwise on CPU; the
loop's own counters (``epoch_loop.batch_progress``, which drives Lightning's accumulation boundary and
``batch_idx``, the optimizer-step and zero-grad progress, ``_batches_that_stepped``) line up with the
uninterrupted fit's again. An epoch's first window starts at the previous epoch's last step, so its
checkpoint resumes as Lightning resumes one written there. Writing that entry, and reading its
optimizer-step and batch counters (``epoch_loop.automatic_optimization.optim_progress.optimizer.step.total``,
``epoch_loop.batch_progress.current``) to know whether a window is open, is writing Lightning 2.x's
checkpoint layout, not its private attributes: ``tests/integrations/test_lightning.py`` fails if it
changes. Between the last micro-batch's backward and the end of its optimizer step (an
``on_before_optimizer_step`` hook, a signal landing in the step) the weights may or may not have
stepped: a checkpoint there is refused with a :class:`~resumable_data.ResumeError` naming the window.
Under ``strategy.handles_gradient_accumulation`` (DeepSpeed) the strategy accumulates by itself and
the callback does none of this: such a checkpoint inside a window is not covered (nor tested).

Under ``strategy="ddp"`` pass ``Trainer(use_distributed_sampler=False)``: the ResumableDataLoader
shards itself by rank (a DistributedSampler injected by Lightning is refused with a ResumeError).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from ..core.state import EPOCH, POSITION
from ..errors import ResumeError, ResumeWarning
from ..map.dataloader import ResumableDataLoader
from ..rng.capture import capture_rng_state, restore_rng_state
from ..streams.loader import StreamLoader

__all__ = ["ResumeCallback"]

_KEY = "resumable_data.ResumeCallback"  # the checkpoint's top-level key
_VERSION = "version"
_RANKS = "rng_per_rank"  # one capture_rng_state() per rank, in rank order
STATE_VERSION = 1
# Lightning 2.x's checkpoint layout, read and written as the module docstring says (pinned by tests).
_LOOPS, _FIT_LOOP = "loops", "fit_loop"  # checkpoint["loops"]["fit_loop"] is Trainer.fit_loop.state_dict()
_OPTIMIZER_STEP = ("epoch_loop.automatic_optimization.optim_progress", "optimizer", "step", "total")
_BATCH_PROGRESS = ("epoch_loop.batch_progress", "current")


@dataclasses.dataclass
class _WindowStart:
    """The open accumulation window's start: the fit loop's state as a checkpoint then would hold it."""

    fit_loop: dict[str, Any]  # Trainer.fit_loop.state_dict(), its train loader states corrected
    global_step: int  # optimizer steps taken before the window
    rng: dict[str, Any] | None = None  # capture_rng_state() before the window's first training step
    drawn: bool = False  # whether a micro-batch of the window has reached on_train_batch_start
    stepping: bool = False  # the window's optimizer step has begun updating the weights


class ResumeCallback(Callback):
    """Saves and restores every rank's global RNG states in Lightning's checkpoints.

    The training step after a checkpoint starts from the states saved in it, in a resumed fit and in
    the uninterrupted one alike; the train loader's saved state is corrected where Lightning's is not
    where the fit goes on (a StreamLoader fetched ahead, an epoch cut short by ``limit_train_batches``).

    Example:
        >>> from resumable_data.integrations.lightning import ResumeCallback
        >>> # trainer = lightning.Trainer(callbacks=[ResumeCallback(), ModelCheckpoint(...)])
        >>> # trainer.fit(model, train_dataloaders=ResumableDataLoader(dataset, batch_size=32), ckpt_path="last")
    """

    def __init__(self) -> None:
        # This rank's RNG state, put back before the next training step: the resumed checkpoint's, or
        # the one this fit just saved (see the module docstring).
        self._pending: dict[str, Any] | None = None
        self._loader_state_found: bool | None = None  # None: not a resumed fit
        self._loader_states: list[Any] = []  # the train loaders' states in the resumed checkpoint
        self._trained = 0  # batches of the current epoch the fit has trained on (batch_idx + 1)
        self._loaded_fit_loop: dict[str, Any] | None = None  # the resumed checkpoint's fit-loop state
        self._window: _WindowStart | None = None  # with accumulate_grad_batches > 1 only

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING
        window = self._open_window(trainer, checkpoint) if fitting else None
        # Every rank builds the checkpoint; rank 0 writes it, so the states are gathered there.
        state = window.rng if window is not None and window.rng is not None else capture_rng_state()
        states = [state]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(states, state)
        checkpoint[_KEY] = {_VERSION: STATE_VERSION, _RANKS: states}
        if window is not None:  # the checkpoint Lightning would have written at the window's start
            checkpoint[_LOOPS][_FIT_LOOP] = copy.deepcopy(window.fit_loop)
            return
        if fitting:
            self._pending = state  # not after the fit (trainer.save_checkpoint): a later fit starts afresh
        self._correct_loader_states(trainer, _fit_loop_of(checkpoint))

    def _open_window(self, trainer: Trainer, checkpoint: dict[str, Any]) -> _WindowStart | None:
        """The open accumulation window's start, or None on a window's boundary.

        Raises:
            ResumeError: the checkpoint is written inside the optimizer step, where the weights may or
                may not have stepped yet.
        """
        if self._window is None or trainer.global_step != self._window.global_step:
            return None  # no accumulation, or the window's optimizer step was just taken
        fit_loop = _fit_loop_of(checkpoint)
        step = _at(fit_loop, _OPTIMIZER_STEP)
        batches = _at(fit_loop, _BATCH_PROGRESS)
        if step["ready"] != step["completed"] and self._window.stepping:
            steps = trainer.accumulate_grad_batches
            drawn = batches["ready"] - (batches["ready"] - 1) // steps * steps  # of the window, this one included
            raise ResumeError(
                f"a checkpoint is being written inside optimizer step {step['ready']} (micro-batch {drawn} of "
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} since the last optimizer step), "
                "where the weights may or may not have stepped, so no resume from it is exact; save between "
                "batches (a callback's on_train_batch_end, or ModelCheckpoint(every_n_train_steps=...), which "
                "saves right after optimizer steps)"
            )
        if not self._window.drawn and batches["ready"] == batches["started"]:
            return None  # no micro-batch of the window drawn yet: the present is the window's start
        return self._window

    def _correct_loader_states(self, trainer: Trainer, fit_loop: dict[str, Any]) -> None:
        """Correct the train loader states of ``fit_loop`` (Lightning's) to where the fit goes on."""
        self._take_back_fetched_ahead(trainer, fit_loop)
        self._end_limited_epoch(trainer, fit_loop)

    def _take_back_fetched_ahead(self, trainer: Trainer, fit_loop: dict[str, Any]) -> None:
        """Save a StreamLoader's state before the batch Lightning fetched ahead and has not trained on."""
        loader = trainer.train_dataloader
        saved = _saved_loader_states(fit_loop)
        if not isinstance(loader, StreamLoader) or not saved:
            return
        ahead = loader.batches_yielded - self._trained
        if ahead == 1:
            saved[0] = loader.state_dict(unconsumed=1)
        elif ahead != 0:
            warnings.warn(
                f"the StreamLoader has handed out {loader.batches_yielded} batches of this epoch and the fit "
                f"has trained on {self._trained}; its saved state is {ahead} batches off, so a resume from "
                "this checkpoint is not exact",
                ResumeWarning,
                stacklevel=2,
            )

    def _end_limited_epoch(self, trainer: Trainer, fit_loop: dict[str, Any]) -> None:
        """Save the end of the epoch when Lightning ends it here, before the loader is exhausted."""
        saved = _saved_loader_states(fit_loop)
        loader = trainer.train_dataloader
        if not saved or self._trained < trainer.num_training_batches:
            return
        if isinstance(loader, ResumableDataLoader):
            state = saved[0]
            saved[0] = {**state, POSITION: loader.sampler.end_position(state[EPOCH], state[POSITION])}
        elif any(isinstance(each, ResumableDataLoader) for each in _resumable_loaders(loader)):
            warnings.warn(
                "the fit ends this epoch before its train loaders are exhausted (limit_train_batches), "
                "and ResumeCallback saves the end of the epoch for a single train loader only: a resume "
                "from this checkpoint goes on with the rest of this epoch; train on one loader",
                ResumeWarning,
                stacklevel=2,
            )

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(_KEY)
        if saved is not None:
            if saved.get(_VERSION) != STATE_VERSION:
                raise ResumeError(
                    f"ResumeCallback state version is {saved.get(_VERSION)!r}, expected {STATE_VERSION}; "
                    "resume with the resumable_data version that wrote the checkpoint"
                )
            states = saved[_RANKS]
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            if len(states) != trainer.world_size:
                raise ResumeError(
                    f"the checkpoint holds RNG states of {len(states)} ranks, this fit has "
                    f"{trainer.world_size}; resume on {len(states)} ranks to resume exactly"
                )
            self._pending = states[rank]
        self._loaded_fit_loop = checkpoint.get(_LOOPS, {}).get(_FIT_LOOP)
        self._loader_states = list(_saved_loader_states(_fit_loop_of(checkpoint)) or [])
        self._loader_state_found = bool(self._loader_states)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.accumulate_grad_batches > 1 and not trainer.strategy.handles_gradient_accumulation:
            # The first window starts here: at the resumed checkpoint (saved at a window's start), or
            # at the fit's start.
            fit_loop = self._loaded_fit_loop
            if fit_loop is None:
                fit_loop = trainer.fit_loop.state_dict()
                self._correct_loader_states(trainer, fit_loop)
            self._window = _WindowStart(copy.deepcopy(fit_loop), trainer.global_step, self._pending)
        self._loaded_fit_loop = None
        loaders = trainer.train_dataloader
        if not isinstance(loaders, StreamLoader) and any(
            isinstance(loader, StreamLoader) for loader in _resumable_loaders(loaders)
        ):
            warnings.warn(
                "a StreamLoader among several train loaders: Lightning fetches it one batch ahead and "
                "ResumeCallback corrects the saved state of a single train loader only, so a resume "
                "may skip a batch; train on the StreamLoader alone (mix streams with resumable_data.mix)",
                ResumeWarning,
                stacklevel=2,
            )
        if self._loader_state_found and not trainer.fit_loop.restarting:
            self._restore_finished_epoch(loaders)
        if self._loader_state_found is False and any(_resumable_loaders(loaders)):
            warnings.warn(
                "this fit resumes from a checkpoint that holds no state for its "
                "ResumableDataLoader/StreamLoader, so the epoch starts over at position 0 while "
                "Lightning's step count goes on; resume from a checkpoint written with the resumable "
                "loader as the train loader (Lightning saves its state_dict() in every checkpoint)",
                ResumeWarning,
                stacklevel=2,
            )

    def _restore_finished_epoch(self, loaders: Any) -> None:
        """Load the train loader's state from a checkpoint Lightning resumes at an epoch's end (it loads none)."""
        if isinstance(loaders, ResumableDataLoader) and len(self._loader_states) == 1:
            loaders.load_state_dict(self._loader_states[0])
        elif any(_resumable_loaders(loaders)):
            warnings.warn(
                "this fit resumes from a checkpoint written at the end of an epoch, where Lightning restores "
                "no train loader state and has already drawn from a fresh StreamLoader (or from one of several "
                "train loaders): the next epoch has epoch 0's order, not the uninterrupted fit's; checkpoint "
                "inside epochs (ModelCheckpoint(every_n_train_steps=...)) or train with Trainer(max_steps=...), "
                "where Lightning restores the loader",
                ResumeWarning,
                stacklevel=3,
            )

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._trained = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._pending is not None:
            restore_rng_state(self._pending)
            self._pending = None
        if self._window is not None:
            if self._window.rng is None:  # the window's first micro-batch: its training step starts here
                self._window.rng = capture_rng_state()
            self._window.drawn = True

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # Called after the last micro-batch's backward, right before the optimizer updates the weights:
        # until the step is counted, a checkpoint cannot say whether the weights have stepped.
        if self._window is not None:
            self._window.stepping = True

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._trained = batch_idx + 1
        if self._window is not None and trainer.global_step != self._window.global_step:
            # The window's optimizer step is taken: the next window starts with the next batch.
            fit_loop = trainer.fit_loop.state_dict()
            self._correct_loader_states(trainer, fit_loop)
            self._window = _WindowStart(fit_loop, trainer.global_step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pending = None  # a later fit with this callback starts from its own RNG states
        self._window = None

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._pending = None  # as at the end of training: the fit is over
        self._window = None


def _fit_loop_of(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Lightning's fit-loop state in ``checkpoint`` (empty if it has none)."""
    fit_loop: dict[str, Any] = checkpoint.get(_LOOPS, {}).get(_FIT_LOOP, {})
    return fit_loop


def _saved_loader_states(fit_loop: dict[str, Any]) -> list[Any] | None:
    """The train loaders' states in a Lightning 2.x fit-loop state (see the module docstring), if any."""
    states: list[Any] | None = fit_loop.get("state_dict", {}).get("combined_loader")
    return states


def _at(state: dict[str, Any], path: tuple[str, ...]) -> Any:
    """``state[path[0]][path[1]]...``, or a ResumeError naming the Lightning layout that changed."""
    value: Any = state
    for key in path:
        if not isinstance(value, dict) or key not in value:
            raise ResumeError(
                f"Lightning's checkpoint has no loops.fit_loop{''.join(f'[{k!r}]' for k in path)}, the layout "
                "ResumeCallback rewrites for a checkpoint inside an accumulation window; use the Lightning 2.x "
                "version resumable_data supports, or save only on optimizer steps "
                "(ModelCheckpoint(every_n_train_steps=...))"
            )
        value = value[key]
    return value


def _resumable_loaders(loaders: Any) -> Iterator[Any]:
    """The ResumableDataLoaders and StreamLoaders among a fit's train loaders (a loader or a collection)."""
    if isinstance(loaders, (ResumableDataLoader, StreamLoader)):
        yield loaders
    elif isinstance(loaders, dict):
        for loader in loaders.values():
            yield from _resumable_loaders(loader)
    elif isinstance(loaders, (list, tuple)):
        for loader in loaders:
            yield from _resumable_loaders(loader)
