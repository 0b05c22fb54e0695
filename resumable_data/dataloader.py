"""ResumableDataLoader and wrap(): a DataLoader whose state is exactly the batches it handed out.

How the position stays exact with workers and prefetching, with no messages to workers: with
``in_order=True`` a ``DataLoader`` yields batches in the order its batch sampler produced them, and
every batch but the last of an epoch holds ``batch_size`` indices per rank. So the number of batches
handed to the caller determines the global position: ``start + world_size * batch_size * k``.
The loader counts the batches it yields — batches prefetched by workers are not counted, because
they have not been yielded — and the restored loader simply starts its batch sampler at that position.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.data
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler
from torchdata.stateful_dataloader.sampler import BatchSampler as StatefulBatchSampler

from . import _state as keys
from ._hash import hash_ints
from ._state import ResumeError, check_int_arg
from .sampler import ResumableSampler

__all__ = ["ResumableDataLoader", "wrap"]

_WHAT = "ResumableDataLoader"
# DataLoader arguments that the resumable loader decides itself.
_OWNED = ("sampler", "batch_sampler", "generator")
# Batch samplers that only cut the sampler's order into batch_size pieces (torchdata's
# StatefulDataLoader builds its own subclass), so wrap() can take them over.
_PLAIN_BATCH_SAMPLERS = (BatchSampler, StatefulBatchSampler)


class ResumableDataLoader(DataLoader):
    """A ``torch.utils.data.DataLoader`` that saves and restores its exact position in O(1).

    Args:
        dataset: a map-style dataset (``__getitem__`` + ``__len__``). A dataset whose class sets
            ``wants_sample_key = True`` is indexed with :class:`~resumable_data.SampleKey` so it can
            draw per-sample randomness that resumes exactly.
        batch_size: samples per batch on this rank (>= 1).
        shuffle: shuffle each epoch with a keyed permutation of ``(seed, epoch)``.
        seed: the order's seed (also seeds worker processes); the global RNG is never consumed.
        rank: this rank; defaults to ``torch.distributed``'s when initialized, else 0.
        world_size: data-parallel size; defaults to ``torch.distributed``'s when initialized, else 1.
        drop_last: drop the last partial batch and trim the uneven tail across ranks.
        sampler: a :class:`ResumableSampler` to use instead of building one; then ``shuffle``,
            ``seed``, ``rank`` and ``world_size`` must be left at their defaults.
        **dataloader_kwargs: any other ``DataLoader`` keyword (``num_workers``, ``collate_fn``,
            ``pin_memory``, ``prefetch_factor``, ``persistent_workers``, ``worker_init_fn``, ...).

    ``state_dict()`` may be called at any batch boundary; ``load_state_dict()`` followed by
    iteration yields exactly the next batch of the uninterrupted run. ``num_workers``,
    ``prefetch_factor``, ``pin_memory`` and ``persistent_workers`` may change across a resume with
    no effect on the stream. ``batch_size`` and ``world_size`` may change too: the rest of the epoch
    is then consumed exactly once across the new ranks (batches are cut differently, so only the
    sequence of global positions is the same as before, not the batches).

    Example:
        >>> loader = ResumableDataLoader(dataset, batch_size=32, seed=0, num_workers=2)
        >>> if checkpoint: loader.load_state_dict(checkpoint["dataloader"])
        >>> for batch in loader:
        ...     train_step(batch)
        ...     if step % 1000 == 0:
        ...         save({"dataloader": loader.state_dict(), ...})
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        batch_size: int = 1,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        sampler: ResumableSampler | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise ResumeError(
                "ResumableDataLoader takes map-style datasets; for an IterableDataset use "
                "resumable_data's stream pipelines (ShardedIterable and its wrappers)"
            )
        check_int_arg("batch_size", batch_size, minimum=1)
        for name in _OWNED:
            if dataloader_kwargs.get(name) is not None:
                raise ResumeError(
                    f"ResumableDataLoader decides {name!r} itself (the order is a function of seed "
                    f"and epoch); remove {name}=... and pass shuffle=/seed= instead"
                )
            dataloader_kwargs.pop(name, None)
        if dataloader_kwargs.get("in_order", True) is False:
            raise ResumeError(
                "in_order=False hands out batches in whatever order workers finish them, so the "
                "position cannot be resumed exactly; leave in_order=True"
            )
        if sampler is None:
            default_rank, default_world = _distributed_defaults()
            sampler = ResumableSampler(
                dataset,
                shuffle=shuffle,
                seed=seed,
                rank=default_rank if rank is None else rank,
                world_size=default_world if world_size is None else world_size,
                drop_last=drop_last,
            )
        elif not isinstance(sampler, ResumableSampler):
            raise ResumeError(
                f"sampler must be a ResumableSampler, got {type(sampler).__name__}; "
                "pass shuffle=/seed=/rank=/world_size= instead"
            )
        elif (shuffle, seed, rank, world_size) != (True, 0, None, None):
            raise ResumeError("pass either sampler= or shuffle/seed/rank/world_size, not both")
        elif sampler.dataset_length != len(dataset):
            raise ResumeError(
                f"sampler covers {sampler.dataset_length} samples but the dataset has {len(dataset)}"
            )
        sampler._driven = True
        sampler._yield_keys = bool(getattr(dataset, "wants_sample_key", False))
        # A private generator: torch draws each iterator's worker base seed from it, which would
        # otherwise consume the global RNG (and change model randomness after a resume).
        self._seed_generator = torch.Generator()
        super().__init__(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            generator=self._seed_generator,
            **dataloader_kwargs,
        )
        self._resumable = sampler
        # Only the newest iterator moves the position. A counter, not a reference: a reference
        # would form a cycle (loader <-> iterator) that keeps abandoned worker processes alive
        # until the garbage collector happens to run.
        self._generation = 0

    # -- read-only views ---------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._resumable.epoch

    @property
    def position(self) -> int:
        """Global samples handed out in the current epoch (all ranks together)."""
        return self._resumable.position

    def set_epoch(self, epoch: int) -> None:
        """As :meth:`ResumableSampler.set_epoch`: the restored epoch keeps its position."""
        self._resumable.set_epoch(epoch)

    def _batches_from(self, start: int) -> int:
        """Batches this rank yields when the epoch continues from global position ``start``."""
        samples = self._resumable.rank_samples(start)
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def peek_indices(self, n_batches: int = 1) -> list[list[int]]:
        """Dataset indices of the next ``n_batches`` batches iteration would yield (changes nothing).

        Useful to fingerprint the next batch in a checkpoint and check it after a resume.
        """
        check_int_arg("n_batches", n_batches, minimum=1)
        epoch, start = self._resumable._next_segment()
        count = min(n_batches, self._batches_from(start)) * self.batch_size
        flat = [i for chunk in self._resumable.index_chunks(epoch, start, count) for i in chunk.tolist()]
        return [flat[i : i + self.batch_size] for i in range(0, len(flat), self.batch_size)]

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self._resumable._begin()
        self._seed_generator.manual_seed(hash_ints(self._resumable.seed, epoch, start) >> 1)
        self._generation += 1
        return _ResumableIterator(self, super().__iter__(), start, self._batches_from(start))

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``version``, ``epoch``, ``position`` (global samples handed out) and the configuration.

        O(1) time and size (under 512 bytes serialized), whatever the dataset size, position,
        world size or number of workers.
        """
        state = self._resumable.state_dict()
        state[keys.BATCH_SIZE] = self.batch_size
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Continue from ``state_dict``; see :meth:`ResumableSampler.load_state_dict`.

        Raises:
            ResumeError: malformed or mismatching state; the loader is unchanged.
        """
        self._resumable._restore(state_dict, strict=strict, what=_WHAT)
        self._generation += 1  # an iterator from before the load no longer moves the position


class _ResumableIterator(Iterator[Any]):
    """Wraps the DataLoader's iterator and advances the position as each batch is handed out."""

    def __init__(self, loader: ResumableDataLoader, inner: Iterator[Any], start: int, n_batches: int) -> None:
        self._loader = loader
        self._inner = inner
        self._start = start
        self._n_batches = n_batches
        self._yielded = 0
        self._generation = loader._generation

    def __iter__(self) -> _ResumableIterator:
        return self

    def __len__(self) -> int:
        return self._n_batches - self._yielded

    def __next__(self) -> Any:
        sampler = self._loader._resumable
        try:
            batch = next(self._inner)
        except StopIteration:
            if self._loader._generation == self._generation:
                sampler._position = sampler.end_position(self._start)
            raise
        self._yielded += 1
        if self._loader._generation == self._generation:
            taken = self._yielded * self._loader.batch_size
            if self._yielded >= self._n_batches:
                sampler._position = sampler.end_position(self._start)
            else:
                sampler._position = sampler.position_after(self._start, taken)
        return batch


def _distributed_defaults() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def wrap(dataloader: DataLoader, *, seed: int = 0) -> ResumableDataLoader:
    """Make an existing ``DataLoader`` resumable, keeping its dataset, batch size and settings.

    The sampler decides the order: ``SequentialSampler`` → no shuffle; ``RandomSampler`` →
    shuffled by ``seed``; ``DistributedSampler`` → its shuffle, seed, rank, world size and
    drop_last. The shuffled order is resumable_data's keyed order, not the one the original
    sampler would have drawn.

    Example:
        >>> loader = resumable_data.wrap(DataLoader(ds, batch_size=64, shuffle=True, num_workers=4))

    Raises:
        ResumeError: the loader's order cannot be resumed exactly (sampling with replacement, a
            custom sampler or batch_sampler, an IterableDataset, no automatic batching).
    """
    if isinstance(dataloader, ResumableDataLoader):
        raise ResumeError("this loader is already a ResumableDataLoader; use it as it is")
    if not isinstance(dataloader, DataLoader):
        raise ResumeError(f"wrap() takes a torch DataLoader, got {type(dataloader).__name__}")
    dataset = dataloader.dataset
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise ResumeError(
            "wrap() takes loaders over map-style datasets; the order of an IterableDataset is its own. "
            "Build it from resumable_data's stream pipelines instead"
        )
    if dataloader.batch_size is None or type(dataloader.batch_sampler) not in _PLAIN_BATCH_SAMPLERS:
        raise ResumeError(
            "wrap() supports loaders built with batch_size= (a plain BatchSampler); a custom "
            "batch_sampler decides batches itself and cannot be resumed from a position. Use "
            "ResumableDataLoader(dataset, batch_size=..., shuffle=..., seed=...) instead"
        )
    source = dataloader.sampler
    world, rank, drop_tail = 1, 0, dataloader.drop_last
    if isinstance(source, DistributedSampler):
        shuffle, seed = source.shuffle, source.seed
        world, rank, drop_tail = source.num_replicas, source.rank, source.drop_last
    elif isinstance(source, RandomSampler):
        if source.replacement or source.num_samples != len(dataset):
            raise ResumeError(
                "wrap() cannot resume RandomSampler(replacement=True) or a num_samples different "
                "from the dataset length: that is sampling, not an order. Use "
                "ResumableDataLoader(dataset, shuffle=True, seed=...) for a shuffled epoch"
            )
        shuffle = True
    elif isinstance(source, SequentialSampler):
        shuffle = False
    else:
        raise ResumeError(
            f"wrap() cannot resume a custom sampler ({type(source).__name__}); build a "
            "ResumableSampler (or ResumableDataLoader with shuffle=/seed=) instead"
        )
    sampler = ResumableSampler(dataset, shuffle=shuffle, seed=seed, rank=rank, world_size=world, drop_last=drop_tail)
    kwargs: dict[str, Any] = {
        "num_workers": dataloader.num_workers,
        "collate_fn": dataloader.collate_fn,
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
    return ResumableDataLoader(
        dataset, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last, sampler=sampler, **kwargs
    )

