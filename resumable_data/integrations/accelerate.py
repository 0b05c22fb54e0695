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
of restoring a state.
"""

from __future__ import annotations

from typing import Any

from accelerate import skip_first_batches as accelerate_skip_first_batches
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import DataLoader

from ..errors import ResumeError
from ..map.batch_sampler import ResumableBatchSampler

__all__ = ["batch_sampler_of", "skip_first_batches"]


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
        ResumeError: ``num_batches`` is negative or not an int.
    """
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise ResumeError(f"num_batches should be a non-negative int, but got num_batches={num_batches!r}")
    found = batch_sampler_of(dataloader)
    if found is None:
        return accelerate_skip_first_batches(dataloader, num_batches)
    batches, processes = found
    epoch, start = batches.sampler.cursor.next_pass()
    batches.load_state_dict(batches.state_for(epoch, batches.position_after(epoch, start, num_batches * processes)))
    return dataloader
