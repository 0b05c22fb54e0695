"""wrap(): make an existing ``DataLoader`` resumable, keeping its dataset, batch size and settings.

It reads what fixes the original loader's order (its sampler's kind, seed, ranks, ``drop_last``) and
builds the :class:`~resumable_data.map.dataloader.ResumableDataLoader` that reproduces that kind of
order, refusing loaders whose order is not a position in a permutation (sampling with replacement, a
custom sampler or batch sampler, an ``IterableDataset``).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any, cast

import torch
import torch.utils.data
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler
from torchdata.stateful_dataloader.sampler import BatchSampler as StatefulBatchSampler

from ..core.growth import ERROR
from ..errors import ResumeError
from .batch_sampler import ResumableBatchSampler
from .dataloader import ResumableDataLoader
from .fetch import MapDataset, SeededCollate
from .sampler import ResumableSampler

__all__ = ["wrap"]

# Batch samplers that only cut the sampler's order into batch_size pieces (torchdata's
# StatefulDataLoader builds its own subclass), so wrap() can take them over.
_PLAIN_BATCH_SAMPLERS = (BatchSampler, StatefulBatchSampler)


def wrap(
    dataloader: DataLoader, *, seed: int | None = None, global_rng: str | None = "batch", growth: str = ERROR
) -> ResumableDataLoader:
    """Make an existing ``DataLoader`` resumable, keeping its dataset, batch size and settings.

    The sampler decides the order: ``SequentialSampler`` → no shuffle; ``RandomSampler`` →
    shuffled; ``DistributedSampler`` → its shuffle, seed, rank, world size and drop_last. The
    shuffled order is resumable_data's keyed order, not the one the original sampler would have
    drawn.

    Args:
        dataloader: the loader to take over.
        seed: the order's seed. ``None`` (default): the original sampler's seed if it has one (a
            ``RandomSampler``'s generator, a ``DistributedSampler``'s ``seed``), else
            ``torch.initial_seed()`` — so runs that differ in ``torch.manual_seed`` differ in order
            too; and since that seed was not chosen here, ``load_state_dict`` adopts a checkpoint's
            seed (with a :class:`~resumable_data.ResumeWarning` saying so). An explicit seed that
            differs from a checkpoint's is refused.
        global_rng: as for :class:`ResumableDataLoader`.
        growth: as for :class:`ResumableDataLoader`.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = wrap(DataLoader(list(range(8)), batch_size=4, shuffle=True), seed=0)
        >>> sorted(i for batch in loader for i in batch.tolist())
        [0, 1, 2, 3, 4, 5, 6, 7]

    Raises:
        ResumeError: the loader's order cannot be resumed exactly (sampling with replacement, a
            custom sampler or batch_sampler, an IterableDataset, no automatic batching).
    """
    dataset, batch_size, drop_last, source = _wrappable(dataloader)
    shuffle, own_seed, world, rank, drop_tail = _order_of(source, dataset, drop_last)
    sampler = ResumableSampler(
        dataset,
        shuffle=shuffle,
        seed=seed if seed is not None else own_seed if own_seed is not None else torch.initial_seed(),
        rank=rank,
        world_size=world,
        drop_last=drop_tail,
        adopt_checkpoint_seed=seed is None,
        growth=growth,
    )
    return ResumableDataLoader(
        dataset,
        batch_size=batch_size,
        drop_last=drop_last,
        sampler=sampler,
        global_rng=global_rng,
        **_settings_of(dataloader),
    )


def _wrappable(dataloader: Any) -> tuple[MapDataset, int, bool, Any]:
    """``(dataset, batch_size, drop_last, sampler)`` of a loader wrap() can take over, or a ResumeError."""
    if isinstance(dataloader, ResumableDataLoader):
        raise ResumeError("this loader is already a ResumableDataLoader; use it as it is")
    if not isinstance(dataloader, DataLoader):
        raise ResumeError(f"wrap() takes a torch DataLoader, got {type(dataloader).__name__}")
    if isinstance(dataloader.dataset, torch.utils.data.IterableDataset):
        raise ResumeError(
            "wrap() takes loaders over map-style datasets; the order of an IterableDataset is its own. "
            "Build it from resumable_data's stream pipelines instead"
        )
    if not isinstance(dataloader.dataset, Sized):
        raise ResumeError(
            f"wrap() needs a dataset with __len__ (the order is a permutation of its length); "
            f"{type(dataloader.dataset).__name__} has none: add __len__ to it"
        )
    batches = dataloader.batch_sampler
    if isinstance(batches, ResumableBatchSampler):
        raise ResumeError(
            "this loader was rebuilt around a ResumableDataLoader's batch_sampler (accelerate's "
            "prepare does that) and already resumes; use it as it is"
        )
    if type(batches).__name__ == "BatchSamplerShard":
        raise ResumeError(
            "wrap() cannot take over a loader accelerate has sharded across processes (its "
            "batch_sampler is a BatchSamplerShard); build a ResumableDataLoader before "
            "accelerator.prepare, or use resumable_data.integrations.transformers.ResumableTrainer"
        )
    # A plain BatchSampler: DataLoader's own (batch_size=...) or one passed as batch_sampler= by a
    # library that rebuilt the loader (accelerate's prepare on one process), which leaves batch_size None.
    if batches is None or type(batches) not in _PLAIN_BATCH_SAMPLERS:
        raise ResumeError(
            "wrap() supports loaders built with batch_size= (a plain BatchSampler); a custom "
            "batch_sampler decides batches itself and cannot be resumed from a position. Use "
            "ResumableDataLoader(dataset, batch_size=..., shuffle=..., seed=...) instead"
        )
    plain = cast(BatchSampler, batches)
    return cast(MapDataset, dataloader.dataset), plain.batch_size, plain.drop_last, plain.sampler


def _order_of(source: Any, dataset: MapDataset, drop_last: bool) -> tuple[bool, int | None, int, int, bool]:
    """``(shuffle, seed or None, world_size, rank, drop_last)`` that reproduce ``source``'s kind of order."""
    if isinstance(source, DistributedSampler):
        return source.shuffle, source.seed, source.num_replicas, source.rank, source.drop_last
    if isinstance(source, RandomSampler):
        if source.replacement or source.num_samples != len(dataset):
            raise ResumeError(
                "wrap() cannot resume RandomSampler(replacement=True) or a num_samples different "
                "from the dataset length: that is sampling, not an order. Use "
                "ResumableDataLoader(dataset, shuffle=True, seed=...) for a shuffled epoch"
            )
        own_seed = source.generator.initial_seed() if source.generator is not None else None
        return True, own_seed, 1, 0, drop_last
    if isinstance(source, SequentialSampler):
        return False, None, 1, 0, drop_last
    raise ResumeError(
        f"wrap() cannot resume a custom sampler ({type(source).__name__}); build a "
        "ResumableSampler (or ResumableDataLoader with shuffle=/seed=) instead"
    )


def _settings_of(dataloader: DataLoader) -> dict[str, Any]:
    """The DataLoader keywords of ``dataloader`` that a ResumableDataLoader keeps as they are."""
    collate_fn = dataloader.collate_fn
    kwargs: dict[str, Any] = {
        "num_workers": dataloader.num_workers,
        "collate_fn": collate_fn.collate_fn if isinstance(collate_fn, SeededCollate) else collate_fn,
        "pin_memory": dataloader.pin_memory,
        "timeout": dataloader.timeout,
        "worker_init_fn": dataloader.worker_init_fn,
        "multiprocessing_context": dataloader.multiprocessing_context,
        "persistent_workers": dataloader.persistent_workers,
        "pin_memory_device": dataloader.pin_memory_device,
    }
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    if hasattr(dataloader, "in_order"):
        kwargs["in_order"] = dataloader.in_order
    return kwargs
