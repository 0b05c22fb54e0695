"""accelerate over a ResumableDataLoader: what works as it is, and a skip that costs nothing.

``accelerator.prepare(..., loader, ...)`` rebuilds the loader from its public attributes; the
rebuilt one loads the same batches with the same global-RNG seeding (see ``map.fetch``). Under
accelerate, build the loader with ``world_size=1, rank=0``: ``prepare`` gives each process every
``num_processes``-th batch of the one global order (a loader already sharded by rank is refused with a
:class:`~resumable_data.ResumeError` rather than sharded twice). Then:

- ``DataLoaderConfiguration(use_stateful_dataloader=True)``: ``save_state``/``load_state`` carry the
  prepared loader's exact position (torchdata's StatefulDataLoader snapshots the batch sampler's
  iterator, which is stateful);
- ``register_for_checkpointing(loader)`` of a loader iterated directly (not prepared) saves its own
  ``state_dict()``;
- accelerate's ``skip_first_batches(prepared, n)`` skips the right batches with their augmentations,
  but walks the ``n`` batches' index lists; :func:`skip_first_batches` here moves the position
  instead, in O(1).

Epochs. A prepared loader calls ``set_epoch(iteration)`` on the batch sampler before each pass, with a
pass counter accelerate does not save: after a resume it counts from 0 again. On the stateful route
the restored state reaches the batch sampler's iterator after that call, and the sampler records the
difference between the restored epoch and the counter, so later passes select the right epochs
without the loop calling ``set_epoch`` (see :class:`~resumable_data.core.cursor.EpochCursor`); the
register route saves the loader's own epoch. accelerate marks a state saved on an epoch's last batch
as finished: the resumed loader's next pass is the next epoch, so resume the loop at the epoch the next
batch belongs to (``starting_epoch = step // len(loader)``, as accelerate's examples do). The skip
routes save no loader state, so there the loop's ``set_epoch(epoch)`` is what names the epoch; so it
is with several processes on the stateful route, where torchdata replays the sharded batches instead
of restoring a state. Before its first pass the prepared loader has not seen the restored state (torchdata
applies it then), so a loop that starts at ``loader.epoch`` runs one epoch too many.

Gradient accumulation. A state saved inside an accumulation window resumes exactly through
:class:`AcceleratorWindow` (the window's start and the micro-batches to read again); accelerate alone
restores ``accelerator.step`` and drops the accumulated gradient.

Batch settings. ``split_batches=True`` is exact: each process's part of a batch is a batch of its own
for the global-RNG seeding (see ``map.fetch``). ``even_batches=False`` pads nothing and is seeded;
``even_batches=True`` padding a short last batch is refused at that batch. ``dispatch_batches=True``
is refused by :func:`check_prepared` (process 0 reads for every process; the resumed processes
got each other's batches).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from accelerate import Accelerator
from accelerate import skip_first_batches as accelerate_skip_first_batches
from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, DataLoaderShard
from accelerate.utils import gather_object
from torch.utils.data import DataLoader

from ..accumulation import REWIND, RNG, AccumulationWindow, StatefulIterable, parse_state
from ..errors import ResumeError
from ..map.batch_sampler import ResumableBatchSampler

__all__ = ["AcceleratorWindow", "batch_sampler_of", "check_prepared", "skip_first_batches"]

_DISPATCH_REFUSED = (
    "accelerate's dispatch_batches=True is not supported over a ResumableDataLoader: process 0 reads "
    "every process's batches and slices them out, and what its loader saves does not put the resumed "
    "processes back on their own batches (after a resume process 0 was handed process 1's). Prepare "
    "the loader with DataLoaderConfiguration(dispatch_batches=False) (accelerate's default for a "
    "map-style dataset): each process then reads its share of the one global order itself, exactly"
)


def check_prepared(dataloader: DataLoader) -> None:
    """Refuse a prepared loader whose accelerate setting makes its resume inexact.

    ``dispatch_batches=True`` (a ``DataLoaderDispatcher``) is refused. accelerate's ``prepare``
    reads only a loader's public ``DataLoader`` attributes, so nothing of a ResumableDataLoader runs
    when it builds the dispatcher: this check runs where the adapter sees the prepared loader
    (:class:`AcceleratorWindow`, :func:`skip_first_batches`); call it right after ``prepare`` otherwise.

    Raises:
        ResumeError: the loader dispatches batches; the message names the setting and the alternative.
    """
    if isinstance(dataloader, DataLoaderDispatcher):
        raise ResumeError(_DISPATCH_REFUSED)


def batch_sampler_of(dataloader: DataLoader) -> tuple[ResumableBatchSampler, int] | None:
    """The ResumableBatchSampler a (prepared) loader draws from, and how many processes share it.

    Returns None when the loader is not built on one.
    """
    batches: Any = dataloader.batch_sampler
    processes = 1
    if isinstance(batches, BatchSamplerShard):
        batches, processes = batches.batch_sampler, batches.num_processes
    return (batches, processes) if isinstance(batches, ResumableBatchSampler) else None


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """Skip this process's next ``num_batches`` batches in O(1), as accelerate's function of that name does.

    For a loader built on a ResumableDataLoader (prepared or not), the position moves past the
    batches every process would have consumed, and the loader itself is returned: its next pass
    starts there, later passes are full epochs. Any other loader goes to accelerate's
    ``skip_first_batches``.

    Example:
        >>> # train_loader = skip_first_batches(accelerator.prepare(loader), resume_step)

    Raises:
        ResumeError: ``num_batches`` is negative or not an int; the loader dispatches batches
            (see :func:`check_prepared`).
    """
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise ResumeError(f"num_batches should be a non-negative int, but got num_batches={num_batches!r}")
    check_prepared(dataloader)
    found = batch_sampler_of(dataloader)
    if found is None:
        return accelerate_skip_first_batches(dataloader, num_batches)
    batches, processes = found
    epoch, start = batches.sampler.cursor.next_pass()
    batches.load_state_dict(batches.state_for(epoch, batches.position_after(epoch, start, num_batches * processes)))
    return dataloader


class AcceleratorWindow(AccumulationWindow):
    """An :class:`~resumable_data.accumulation.AccumulationWindow` for accelerate: saves inside a
    gradient-accumulation window resume to the uninterrupted run's optimizer steps, bitwise.

    accelerate's ``save_state`` restores ``accelerator.step`` but not the gradient accumulated since
    the last optimizer step, so a state saved inside a window resumed with the window's remaining
    micro-batches alone. Iterate this window instead of the loader: it registers itself with
    ``register_for_checkpointing``, so ``save_state`` writes the window start's loader state and every
    process's global RNG states (gathered: accelerate writes custom objects from the main process
    only), and ``load_state`` puts the loader, this process's RNGs and ``accelerator.step`` back at
    the window's start, after accelerate's own loader and RNG restore. The resumed run reads the
    window's ``rewound`` micro-batches again and recomputes the same gradient before the window's
    optimizer step; a micro-batch counter of the loop goes back by ``rewound``.

    Re-reading rather than saving the accumulated gradients: the state stays small (no model-sized
    tensor per process in every checkpoint), and costs at most ``gradient_accumulation_steps - 1``
    micro-batches of forward and backward once per resume.

    Args:
        accelerator: the ``Accelerator`` (its ``gradient_accumulation_steps`` is the window).
        loader: the prepared loader (``use_stateful_dataloader=True``), or a ResumableDataLoader
            iterated unprepared (then register the window, not the loader).

    Raises:
        ResumeError: the loader dispatches batches (:func:`check_prepared`), or is prepared without
            ``use_stateful_dataloader=True`` (it has no state to rewind to).

    Example::

        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        window = AcceleratorWindow(accelerator, loader)  # registered for checkpointing
        if resuming:
            accelerator.load_state(folder)
            step = saved_step - window.rewound  # the window's drawn micro-batches are read again
        for batch in window:
            with accelerator.accumulate(model):
                ...
            step += 1
            if time_to_save:  # any micro-batch, inside a window too
                accelerator.save_state(folder)
    """

    def __init__(self, accelerator: Accelerator, loader: StatefulIterable) -> None:
        if isinstance(loader, DataLoader):
            check_prepared(loader)
        if isinstance(loader, DataLoaderShard) and not loader.use_stateful_dataloader:
            raise ResumeError(
                "AcceleratorWindow needs the loader's state at the window's start, and a prepared loader has one "
                "only with DataLoaderConfiguration(use_stateful_dataloader=True); prepare it so, or iterate the "
                "ResumableDataLoader unprepared in the window (the skip routes save no loader state: save on "
                "optimizer steps only there)"
            )
        # accelerate steps the optimizer at the end of each pass (sync_with_dataloader, the default).
        restart = bool(accelerator.gradient_state.plugin_kwargs.get("sync_with_dataloader", True))
        super().__init__(loader, accelerator.gradient_accumulation_steps, restart_each_pass=restart)
        self.accelerator = accelerator
        self.rewound = 0  # micro-batches the last load_state_dict put back
        accelerator.register_for_checkpointing(self)

    def state_dict(self) -> dict[str, Any]:
        """The window's state, with every process's RNG states (a collective: call it on every process).

        Returns:
            :meth:`AccumulationWindow.state_dict`'s dict, ``"rng"`` a list indexed by process.
        """
        state = super().state_dict()
        rng = state[RNG]
        state[RNG] = gather_object([rng]) if self.accelerator.num_processes > 1 else [rng]
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Put the loader, this process's RNGs and ``accelerator.step`` back at the saved window's start.

        Raises:
            ResumeError: malformed state, or saved by another number of processes; nothing changed.
        """
        state = parse_state(state_dict)
        per_process, processes = state[RNG], self.accelerator.num_processes
        if not isinstance(per_process, list) or len(per_process) != processes:
            count = len(per_process) if isinstance(per_process, list) else type(per_process).__name__
            raise ResumeError(
                f"AcceleratorWindow state holds the RNG states of {count} processes, this run has "
                f"{processes}; resume with the number of processes that wrote the checkpoint"
            )
        super().load_state_dict({**state, RNG: per_process[self.accelerator.process_index]})
        self.rewound = state[REWIND]
        self.accelerator.step -= self.rewound
