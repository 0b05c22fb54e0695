"""DeepSpeed over a ResumableDataLoader or StreamLoader: the data and RNG state its checkpoints carry.

DeepSpeed's own recipe saves the step in ``client_state`` and, after ``load_checkpoint``, has the loop
skip the batches already trained on: the replay this library removes. Two calls put what a resume needs
into the checkpoint DeepSpeed writes anyway::

    engine.save_checkpoint(folder, client_state={**client_state(loader, step=step), "step": step})
    _, saved = engine.load_checkpoint(folder)
    load_client_state(loader, saved, seed=SEED)  # the position and this rank's RNGs: no skip loop

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

from ..core.dist import distributed_defaults
from ..core.state import VERSION, brief, check_version, is_int, keys_of, require_int, require_mapping
from ..distributed import fail_together, global_state
from ..errors import ResumeError, Stateful
from ..rng.capture import capture_rng_state, restore_rng_state
from ..rng.ranks import restore_rank_rng_state

__all__ = ["CLIENT_STATE_KEY", "client_state", "load_client_state"]

CLIENT_STATE_KEY = "resumable_data"
"""The one key :func:`client_state` adds to DeepSpeed's ``client_state``; keep it clear of your own keys."""
# The version of what is stored under CLIENT_STATE_KEY, and its keys.
STATE_VERSION = 1
_DATALOADER = "dataloader"  # the loader's global state
_RNG_PER_RANK = "rng_per_rank"  # one capture_rng_state() per rank of the group, in rank order
_STEP = "step"  # the step it was saved at, for seeding ranks the checkpoint did not have
_WHAT = f"DeepSpeed client_state[{CLIENT_STATE_KEY!r}]"


def client_state(loader: Stateful, *, step: int, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """What to put in ``engine.save_checkpoint(..., client_state=...)``: one key, the same on every rank.

    A collective when a process group is initialized: call it on every rank of ``group``, as
    ``save_checkpoint`` is called.

    Args:
        loader: the training loader: a :class:`~resumable_data.ResumableDataLoader`, a
            :class:`~resumable_data.StreamLoader`, or another ``Stateful`` whose state all ranks share.
        step: the training step the checkpoint is written at (a rank added on resume is seeded from it).
        group: the data-parallel process group (the default group when None).

    Returns:
        ``{CLIENT_STATE_KEY: {"version", "dataloader", "rng_per_rank", "step"}}``: merge your own keys
        into it.

    Raises:
        ResumeError: ``loader`` is DeepSpeed's own loader or keeps no state, the ranks' loader states
            disagree, or ``step`` is not a non-negative int.

    Examples:
        Without a process group it holds this process's state and RNGs:

        >>> import torch
        >>> from resumable_data import ResumableDataLoader
        >>> loader = ResumableDataLoader(torch.arange(10), batch_size=4, seed=0)
        >>> saved = client_state(loader, step=0)
        >>> list(saved), sorted(saved[CLIENT_STATE_KEY]), len(saved[CLIENT_STATE_KEY]["rng_per_rank"])
        (['resumable_data'], ['dataloader', 'rng_per_rank', 'step', 'version'], 1)

        In a DeepSpeed loop, on every rank::

            engine.save_checkpoint(folder, client_state={**client_state(loader, step=step), "step": step})
    """
    _check_loader(loader)
    if not (is_int(step) and step >= 0):
        raise ResumeError(f"step should be a non-negative int, but got step={brief(step)}")
    _, world = distributed_defaults(group)
    rng = capture_rng_state()
    rng_per_rank: list[Any] = [rng]
    if world > 1:
        rng_per_rank = [None] * world
        dist.all_gather_object(rng_per_rank, rng, group=group)
    state = {
        VERSION: STATE_VERSION,
        _DATALOADER: global_state(loader, group=group),
        _RNG_PER_RANK: rng_per_rank,
        _STEP: step,
    }
    return {CLIENT_STATE_KEY: state}


def load_client_state(
    loader: Stateful, saved: Mapping[str, Any], *, seed: int, group: dist.ProcessGroup | None = None
) -> bool:
    """Load the loader's position and this rank's RNGs from what ``engine.load_checkpoint`` returned.

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

    Returns:
        True when this rank's RNG states came from the checkpoint; False when the checkpoint was
        written by fewer ranks and they were seeded with ``rank_seed(seed, rank, step)``.

    Raises:
        ResumeError: ``saved`` holds no state of ours, or a malformed one or another version, or the
            loader refuses it; on every rank. ``seed`` is not an int.

    Example::

        _, saved = engine.load_checkpoint(folder)
        load_client_state(loader, saved, seed=SEED)
        step = saved["step"]
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
    """Our part of ``client_state``, checked (the loader and the RNG states check their own parts)."""
    saved = require_mapping(saved, "DeepSpeed client_state")
    if CLIENT_STATE_KEY not in saved:
        raise ResumeError(
            f"DeepSpeed client_state has no {CLIENT_STATE_KEY!r} key (it has keys {keys_of(saved)}): the "
            "checkpoint was saved without client_state(loader, step=...); save with "
            "engine.save_checkpoint(folder, client_state={**client_state(loader, step=step), ...})"
        )
    state = require_mapping(saved[CLIENT_STATE_KEY], _WHAT)
    check_version(state, STATE_VERSION, _WHAT)
    for key in (_DATALOADER, _RNG_PER_RANK):
        if key not in state:
            raise ResumeError(f"{_WHAT} is missing the key {key!r}; got keys {keys_of(state)}")
    require_int(state, _STEP, _WHAT, minimum=0)
    return state


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
