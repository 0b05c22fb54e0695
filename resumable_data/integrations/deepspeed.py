"""DeepSpeed over a ResumableDataLoader or StreamLoader: the data and RNG state its checkpoints carry.

DeepSpeed's own recipe saves the step in ``client_state`` and, after ``load_checkpoint``, has the loop
skip the batches already trained on: the replay this library removes. Two calls put what a resume needs
into the checkpoint DeepSpeed writes anyway::

    engine.save_checkpoint(folder, client_state=client_state(loader, step=step, engine=engine))
    _, saved = engine.load_checkpoint(folder)
    load_client_state(loader, saved, seed=SEED)  # the position and this rank's RNGs: no skip loop
    step = resume_step(saved)

Where it is saved. DeepSpeed writes ``client_state`` into the model-state file of the data-parallel
writer rank only (``save_non_zero_checkpoint``, data-parallel rank 0), and every rank reads that file
back: what another rank put there is lost. So :func:`client_state` is a collective that makes every
rank's value the same: the loader's global state (:func:`~resumable_data.distributed.global_state`: a
ResumableDataLoader's state is already global and the ranks' agreement is checked, a StreamLoader's
slots are gathered from every rank and merged) and every rank's
:func:`~resumable_data.capture_rng_state`, gathered in rank order. :func:`load_client_state` gives each
rank its own entry back.

What stays identical. Resumed on the same number of ranks, every rank's next batch, its augmentation
(drawn from the global RNGs in ``__getitem__``) and its dropout masks are the uninterrupted run's, so
are the losses and weights. Resumed on another number of ranks, the rest of the epoch is read exactly
once over the new ranks (the loaders' elastic rules); a rank the checkpoint has no RNG state of is
seeded with ``seed_everything(rank_seed(seed, rank, step))``. A StreamLoader deals whole unfinished shards
to the new ranks, so they may have different numbers of batches left in the epoch, which DeepSpeed's
collectives do not allow: give them shards that divide evenly. DeepSpeed itself refuses a changed
data-parallel degree for ZeRO stages 1 and 2 when it loads their partitioned optimizer state
(``ZeRORuntimeException``); stage 0 loads it, and for 1 and 2 a universal checkpoint
(``ds_to_universal``) or ``load_checkpoint(..., load_optimizer_states=False)`` is DeepSpeed's way.

Inside a gradient-accumulation window. With ``gradient_accumulation_steps`` > 1 a save between two
optimizer steps (a preemption handler, a save every N micro-batches) holds the weights, optimizer and LR
scheduler of the window's start, but DeepSpeed keeps neither the gradient accumulated since (in its
ZeRO 2/3 buffers, with no public API) nor ``engine.micro_steps`` (0 after ``load_checkpoint``): resumed
from the data position of the save, the engine trains a fresh window from there and every later
optimizer step moves. Iterate an :class:`~resumable_data.accumulation.AccumulationWindow` and pass it
as ``window=``: the checkpoint then holds the loader's global state and every rank's RNGs of the
window's start, and how many micro-batches of it were drawn (``rewind``); the resumed loop reads them
again, recomputing the same gradient (bitwise on CPU) before the window's optimizer step, and
:func:`resume_step` gives the step to continue from (the step saved less ``rewind``). Given
``engine=``, :func:`client_state` refuses a save inside a window without ``window=``
(``engine.micro_steps % engine.gradient_accumulation_steps() != 0``) with a
:class:`~resumable_data.ResumeError`, and checks that the window agrees with the engine; without
``engine=`` it cannot see the window, so pass it. With ``managed_gradient_accumulation=False`` the
caller's ``step()`` is the boundary and the engine says nothing of backward passes since: a save then
needs ``window=`` (stepping every ``window.steps`` micro-batches), and is refused without one. The
engine's window is taken to be its micro-step count's, as ``is_gradient_accumulation_boundary()``
computes it; a loop that overrides it with ``set_gradient_accumulation_boundary`` passes a window
that steps where it does.

DeepSpeed's loader. ``deepspeed.initialize(training_data=dataset)`` builds a ``DeepSpeedDataLoader``
over a ``DistributedSampler`` whose position nothing saves; both functions here refuse it with a
:class:`~resumable_data.ResumeError`. Build the ResumableDataLoader (or StreamLoader) yourself, with the
engine's micro batch size, and leave ``training_data`` out. A model-parallel job passes its
data-parallel group as ``group`` (each model-parallel rank's file then holds its group's states; not
tested here).
This module never imports DeepSpeed.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ..accumulation import DATALOADER, REWIND, RNG, STEPS, AccumulationWindow
from ..core.dist import distributed_defaults
from ..core.state import VERSION, brief, check_version, is_int, keys_of, require_int, require_mapping
from ..distributed import fail_together, global_state
from ..errors import ResumeError, Stateful
from ..rng.capture import capture_rng_state, restore_rng_state
from ..rng.ranks import restore_rank_rng_state

__all__ = ["CLIENT_STATE_KEY", "client_state", "load_client_state", "resume_step"]

CLIENT_STATE_KEY = "resumable_data"
"""The one key :func:`client_state` adds to DeepSpeed's ``client_state``; keep it clear of your own keys."""
# The version of what is stored under CLIENT_STATE_KEY, and its keys. Version 1 (no window) still loads,
# as saved on an accumulation boundary.
STATE_VERSION = 2
_V1 = 1
_DATALOADER = DATALOADER  # the loader's global state (at the open window's start)
_RNG_PER_RANK = "rng_per_rank"  # one capture_rng_state() per rank of the group, in rank order (ditto)
_STEP = "step"  # the step it was saved at, for seeding ranks the checkpoint did not have
_STEPS = STEPS  # micro-batches per optimizer step (1 when saved with neither window nor engine)
_REWIND = REWIND  # micro-batches of the open window drawn before the save: the resumed loop reads them again
_WHAT = f"DeepSpeed client_state[{CLIENT_STATE_KEY!r}]"


def client_state(
    loader: Stateful,
    *,
    step: int,
    group: dist.ProcessGroup | None = None,
    window: AccumulationWindow | None = None,
    engine: Any = None,
) -> dict[str, Any]:
    """What to put in ``engine.save_checkpoint(..., client_state=...)``: one key, the same on every rank.

    A collective when a process group is initialized: call it on every rank of ``group``, as
    ``save_checkpoint`` is called.

    Args:
        loader: the training loader: a :class:`~resumable_data.ResumableDataLoader`, a
            :class:`~resumable_data.StreamLoader`, or another ``Stateful`` whose state all ranks share.
        step: the training step the checkpoint is written at, counting micro-batches (calls of
            ``engine.step()``) when the loop accumulates gradients (a rank added on resume is seeded
            from it).
        group: the data-parallel process group (the default group when None).
        window: the :class:`~resumable_data.accumulation.AccumulationWindow` over ``loader`` the loop
            draws its micro-batches from: the checkpoint then holds the open window's start, so a
            save inside a window resumes exactly.
        engine: the DeepSpeed engine, to refuse a save inside an accumulation window that ``window``
            does not describe. Without it nothing can tell where the save falls: pass it.

    Returns:
        ``{CLIENT_STATE_KEY: {"version", "dataloader", "rng_per_rank", "step", "steps", "rewind"}}``:
        merge your own keys into it.

    Raises:
        ResumeError: ``loader`` is DeepSpeed's own loader or keeps no state, the ranks' loader states
            disagree, or ``step`` is not a non-negative int; ``engine`` shows a save inside an
            accumulation window (micro-batch k of ``gradient_accumulation_steps``) and no ``window``
            was given, or ``window`` disagrees with it, or iterates another loader.

    Examples:
        Without a process group it holds this process's state and RNGs:

        >>> import torch
        >>> from resumable_data import ResumableDataLoader
        >>> loader = ResumableDataLoader(torch.arange(10), batch_size=4, seed=0)
        >>> saved = client_state(loader, step=0)
        >>> list(saved), sorted(saved[CLIENT_STATE_KEY]), len(saved[CLIENT_STATE_KEY]["rng_per_rank"])
        (['resumable_data'], ['dataloader', 'rewind', 'rng_per_rank', 'step', 'steps', 'version'], 1)

        In a DeepSpeed loop with gradient accumulation, on every rank::

            window = AccumulationWindow(loader, engine.gradient_accumulation_steps())
            for batch in window:  # where the loop drew from the loader
                ...
                engine.save_checkpoint(
                    folder, client_state=client_state(loader, step=step, window=window, engine=engine)
                )
    """
    _check_loader(loader)
    if not (is_int(step) and step >= 0):
        raise ResumeError(f"step should be a non-negative int, but got step={brief(step)}")
    steps, rewind = _window_of(loader, window, engine, step)
    if window is None:
        loader_state, rng = None, capture_rng_state()  # the present: a save on a window's boundary
    else:
        start = window.state_dict()  # the open window's start (the present on a boundary)
        loader_state, rng = start[DATALOADER], start[RNG]
    _, world = distributed_defaults(group)
    rng_per_rank: list[Any] = [rng]
    if world > 1:
        rng_per_rank = [None] * world
        dist.all_gather_object(rng_per_rank, rng, group=group)
    state = {
        VERSION: STATE_VERSION,
        _DATALOADER: global_state(loader, group=group, state=loader_state),
        _RNG_PER_RANK: rng_per_rank,
        _STEP: step,
        _STEPS: steps,
        _REWIND: rewind,
    }
    return {CLIENT_STATE_KEY: state}


def resume_step(saved: Mapping[str, Any]) -> int:
    """The step the resumed loop continues from: the step saved, less the window's micro-batches read again.

    Inside an accumulation window the loader and the RNGs are put back to the window's start, so a
    step counter that counts micro-batches goes back by the ``rewind`` micro-batches drawn before
    the save; on a boundary it is the step saved.

    Args:
        saved: the ``client_state`` ``engine.load_checkpoint`` returned.

    Raises:
        ResumeError: ``saved`` holds no state of ours, or a malformed one.

    Example::

        _, saved = engine.load_checkpoint(folder)
        load_client_state(loader, saved, seed=SEED)
        step = resume_step(saved)
    """
    state = _parse(saved)
    return int(state[_STEP] - state[_REWIND])


def load_client_state(
    loader: Stateful,
    saved: Mapping[str, Any],
    *,
    seed: int,
    group: dist.ProcessGroup | None = None,
    window: AccumulationWindow | None = None,
) -> bool:
    """Load the loader's position and this rank's RNGs from what ``engine.load_checkpoint`` returned.

    A checkpoint saved inside an accumulation window puts them back to the window's start: the loop
    reads the window's first micro-batches again (continue from :func:`resume_step`), through a
    fresh :class:`~resumable_data.accumulation.AccumulationWindow` with the saved number of steps.

    A collective when a process group is initialized (a rank that fails makes every rank raise,
    rather than leave the others waiting in the next collective): call it on every rank, right after
    ``load_checkpoint`` and before the first batch is drawn. On failure no rank's loader or RNGs
    are changed (a rank that loaded while another failed puts its own back).

    Args:
        loader: the training loader, built as in the run that saved (at any number of ranks).
        saved: the ``client_state`` ``load_checkpoint`` returned (holding :data:`CLIENT_STATE_KEY`).
        seed: the run's seed, for a rank the checkpoint has no RNG state of (see
            :func:`~resumable_data.rank_seed`).
        group: the data-parallel process group (the default group when None).
        window: the window over ``loader`` the resumed loop draws from, to check that it has the
            saved ``steps`` and no micro-batch drawn yet (else the resumed window would end elsewhere).

    Returns:
        True when this rank's RNG states came from the checkpoint; False when the checkpoint was
        written by fewer ranks and they were seeded with ``rank_seed(seed, rank, step)``.

    Raises:
        ResumeError: ``saved`` holds no state of ours, or a malformed one or another version, or the
            loader refuses it, or ``window`` does not fit the saved window; on every rank. ``seed``
            is not an int.

    Example::

        _, saved = engine.load_checkpoint(folder)
        load_client_state(loader, saved, seed=SEED, window=window)
        step = resume_step(saved)
    """
    _check_loader(loader)
    if not is_int(seed):
        raise ResumeError(f"seed should be an int (the run's seed), but got seed={brief(seed)}")
    rank, _ = distributed_defaults(group)
    rng_before, loader_before = capture_rng_state(), loader.state_dict()
    loaded = False

    def attempt() -> bool:
        nonlocal loaded
        state = _parse(saved)
        if window is not None:
            _check_resumed_window(loader, window, state)
        restored = restore_rank_rng_state(state[_RNG_PER_RANK], rank, seed=seed, step=state[_STEP])
        try:
            loader.load_state_dict(state[_DATALOADER])
        except BaseException:
            restore_rng_state(rng_before)  # the loader refused: this rank's RNGs are as they were
            raise
        loaded = True
        return restored

    try:
        return fail_together(f"loading the data state from {_WHAT}", attempt)
    except ResumeError:
        if loaded:  # another rank failed: this one goes back to where it was, as that one is
            restore_rng_state(rng_before)
            loader.load_state_dict(loader_before)
        raise


def _parse(saved: Mapping[str, Any]) -> Mapping[str, Any]:
    """Our part of ``client_state``, checked (the loader and the RNG states check their own parts).

    A version-1 state (saved before windows were kept) is read as saved on a boundary: ``steps`` 1,
    ``rewind`` 0.
    """
    saved = require_mapping(saved, "DeepSpeed client_state")
    if CLIENT_STATE_KEY not in saved:
        raise ResumeError(
            f"DeepSpeed client_state has no {CLIENT_STATE_KEY!r} key (it has keys {keys_of(saved)}): the "
            "checkpoint was saved without client_state(loader, step=...); save with "
            "engine.save_checkpoint(folder, client_state={**client_state(loader, step=step, engine=engine), ...})"
        )
    state = require_mapping(saved[CLIENT_STATE_KEY], _WHAT)
    if is_int(state.get(VERSION)) and state[VERSION] == _V1:
        state = {**state, VERSION: STATE_VERSION, _STEPS: 1, _REWIND: 0}
    check_version(state, STATE_VERSION, _WHAT)
    for key in (_DATALOADER, _RNG_PER_RANK):
        if key not in state:
            raise ResumeError(f"{_WHAT} is missing the key {key!r}; got keys {keys_of(state)}")
    step = require_int(state, _STEP, _WHAT, minimum=0)
    steps = require_int(state, _STEPS, _WHAT, minimum=1)
    rewind = require_int(state, _REWIND, _WHAT, minimum=0)
    if rewind >= steps or rewind > step:
        raise ResumeError(
            f"{_WHAT} has rewind={rewind} micro-batches to read again, expected fewer than its steps={steps} "
            f"and at most its step={step}"
        )
    return state


def _window_of(loader: Stateful, window: AccumulationWindow | None, engine: Any, step: int) -> tuple[int, int]:
    """``(steps, rewind)`` of the save: micro-batches per optimizer step, and of the open window drawn.

    Refuses what would resume silently elsewhere: a save inside the engine's accumulation window that
    no ``window`` describes, or a ``window`` that is not the engine's or not over ``loader``.
    """
    if window is not None:
        if not isinstance(window, AccumulationWindow):
            raise ResumeError(
                f"window should be a resumable_data.accumulation.AccumulationWindow, got {type(window).__name__}"
            )
        if window.loader is not loader:
            raise ResumeError(
                "window= iterates another loader than loader=: build it over the training loader, "
                "AccumulationWindow(loader, engine.gradient_accumulation_steps()), and draw the micro-batches from it"
            )
        if window.taken > step:
            raise ResumeError(
                f"step={step} is smaller than the {window.taken} micro-batches of the open accumulation window: "
                "with gradient accumulation, step should count micro-batches (calls of engine.step())"
            )
    if engine is not None:
        steps = engine.gradient_accumulation_steps()
        # DeepSpeed 0.19.8 has it; an engine without it is taken to count micro-steps, as managed ones do.
        managed = getattr(engine, "managed_gradient_accumulation", None)
        if managed is not None and not managed():
            if window is None:
                raise ResumeError(
                    "with managed_gradient_accumulation=False the engine does not say how many backward passes "
                    "it accumulated since the last step(), so a save may fall inside an accumulation window and "
                    "resume to other optimizer steps; draw the micro-batches from "
                    "AccumulationWindow(loader, <micro-batches per step()>) and pass it as window="
                )
        else:
            taken = engine.micro_steps % steps
            if window is None and taken:
                raise ResumeError(
                    f"save inside a gradient-accumulation window: after micro-batch {taken} of "
                    f"gradient_accumulation_steps={steps} since the last optimizer step (engine.micro_steps="
                    f"{engine.micro_steps}); DeepSpeed's checkpoint keeps neither the gradient accumulated since nor "
                    "the micro-step count, so the resumed run would step elsewhere. Draw the micro-batches from "
                    "window = AccumulationWindow(loader, engine.gradient_accumulation_steps()) and pass "
                    "client_state(loader, step=step, window=window, engine=engine), or save when "
                    "engine.micro_steps % engine.gradient_accumulation_steps() == 0"
                )
            if window is not None and (window.steps, window.taken) != (steps, taken):
                raise ResumeError(
                    f"window= disagrees with the engine: the window has steps={window.steps} with {window.taken} "
                    f"micro-batches of the open window drawn, the engine gradient_accumulation_steps={steps} with "
                    f"{taken} (engine.micro_steps={engine.micro_steps}); build the window as "
                    "AccumulationWindow(loader, engine.gradient_accumulation_steps()) and call engine.step() once "
                    "per micro-batch drawn from it"
                )
            if window is None:
                return steps, 0
    if window is None:
        return 1, 0
    return window.steps, window.taken


def _check_resumed_window(loader: Stateful, window: AccumulationWindow, state: Mapping[str, Any]) -> None:
    """Refuse a window the resumed loop would end elsewhere: another loader, steps, or one already drawn from."""
    if window.loader is not loader:
        raise ResumeError(
            "window= iterates another loader than loader=: build it over the training loader, "
            "AccumulationWindow(loader, engine.gradient_accumulation_steps())"
        )
    if window.taken:
        raise ResumeError(
            f"window= has {window.taken} micro-batches of a window drawn: load the checkpoint before the first "
            "micro-batch is drawn, into a fresh AccumulationWindow"
        )
    if state[_REWIND] and window.steps != state[_STEPS]:
        raise ResumeError(
            f"{_WHAT} was saved inside an accumulation window of steps={state[_STEPS]} micro-batches, "
            f"{state[_REWIND]} of them drawn; this window has steps={window.steps}: resume with the "
            "gradient_accumulation_steps that wrote the checkpoint, or from a checkpoint saved on a boundary"
        )


def _check_loader(loader: Any) -> None:
    """Refuse DeepSpeed's own loader, and anything without a state to save."""
    if _is_deepspeeds_loader(loader):
        raise ResumeError(
            "this is DeepSpeed's DeepSpeedDataLoader (what deepspeed.initialize(training_data=...) returns): "
            "it draws from a DistributedSampler whose position no checkpoint keeps, so a resume would start "
            "the epoch over; build ResumableDataLoader(dataset, batch_size=<train_micro_batch_size_per_gpu>, "
            "seed=...) yourself, leave training_data out of deepspeed.initialize, and pass that loader"
        )
    if not isinstance(loader, Stateful):
        raise ResumeError(
            f"the loader must have state_dict/load_state_dict (a ResumableDataLoader or StreamLoader), "
            f"got {type(loader).__name__}; wrap a torch DataLoader with resumable_data.wrap(loader, seed=...)"
        )


def _is_deepspeeds_loader(loader: Any) -> bool:
    # A DeepSpeedDataLoader exists only once its module is imported, so DeepSpeed is never imported here.
    module = sys.modules.get("deepspeed.runtime.dataloader")
    return module is not None and isinstance(loader, module.DeepSpeedDataLoader)
