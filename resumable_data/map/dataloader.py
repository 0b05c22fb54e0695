"""ResumableDataLoader and wrap(): a DataLoader whose state is exactly the batches it handed out.

How the position stays exact with workers and prefetching, with no messages to workers: with
``in_order=True`` a ``DataLoader`` yields batches in the order its batch sampler produced them, and
every batch but the last of an epoch holds ``batch_size`` indices per rank. So the number of batches
handed to the caller determines the global position: ``start + world_size * batch_size * k``.
The loader counts the batches it yields — batches prefetched by workers are not counted, because
they have not been yielded — and the restored loader simply starts its batch plan at that position.

Each batch travels to its worker as a :class:`~resumable_data.map.fetch.Ticket` (seed, epoch, position,
indices), so the worker can seed the global RNGs for exactly that batch (``global_rng``): a batch's
augmentations do not depend on which process fetched it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.utils.data
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler
from torchdata.stateful_dataloader.sampler import BatchSampler as StatefulBatchSampler

from ..core import state as keys
from ..core.cursor import EpochCursor, Segment
from ..core.dist import distributed_defaults
from ..core.hash import hash_ints
from ..core.state import check_int_arg
from ..errors import ResumeError
from .fetch import BatchFetcher, MapDataset, Ticket, batch_keys, check_global_rng
from .sampler import ResumableSampler
from .warm import WarmPass, WarmStart

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
        dataset: a map-style dataset (``__getitem__`` + ``__len__``; ``__getitems__`` is used when
            present). A dataset whose class sets ``wants_sample_key = True`` is indexed with
            :class:`~resumable_data.SampleKey` so it can draw per-sample randomness.
        batch_size: samples per batch on this rank (>= 1).
        shuffle: shuffle each epoch with a keyed permutation of ``(seed, epoch)``.
        seed: the order's seed (also the global-RNG seeds' and the workers'); the global RNG is never
            consumed. ``None`` takes ``torch.initial_seed()`` and adopts a checkpoint's seed on load.
        rank: this rank; defaults to ``group``'s rank when ``torch.distributed`` is initialized, else 0.
        world_size: data-parallel size; defaults to ``group``'s size when initialized, else 1.
        group: the data-parallel process group (``None``: the default group). Ranks outside a
            data-parallel split (tensor parallel peers) share a group rank and get the same batches.
        drop_last: drop the last partial batch and trim the uneven tail across ranks.
        sampler: a :class:`ResumableSampler` to use instead of building one; then ``shuffle``,
            ``seed``, ``rank``, ``world_size`` and ``group`` must be left at their defaults.
        global_rng: ``"batch"`` (default) seeds torch's, numpy's and python's global RNGs from
            ``(seed, epoch, position)`` before each batch is fetched, so augmentation drawn from them
            (torchvision transforms) resumes bitwise with any ``num_workers`` (for the same batch
            size and world size); ``"sample"`` seeds them from ``(seed, epoch, index)`` before each
            sample (also independent of batch size and world size; costs ~5 µs per sample);
            ``None`` leaves them alone.
        warm_start: with workers, fetch the first batch of each pass (a resume, an epoch start)
            in the main process instead of waiting for the workers to start, and hand over to them
            as soon as they deliver; batches are bitwise the same either way. ``None`` (default):
            on for non-persistent workers without a ``worker_init_fn`` — where it won every
            measurement in ``benchmarks/bench_resume.py`` and where the dataset cannot depend on
            per-worker set-up — off otherwise.
        **dataloader_kwargs: any other ``DataLoader`` keyword (``num_workers``, ``collate_fn``,
            ``pin_memory``, ``prefetch_factor``, ``persistent_workers``, ``worker_init_fn``, ...).

    ``state_dict()`` may be called at any batch boundary; ``load_state_dict()`` followed by
    iteration yields exactly the next batch of the uninterrupted run. ``num_workers``,
    ``prefetch_factor``, ``pin_memory`` and ``persistent_workers`` may change across a resume with
    no effect on the stream. ``batch_size`` and ``world_size`` may change too: the rest of the epoch
    is then consumed exactly once across the new ranks (batches are cut differently, so only the
    sequence of global positions is the same as before, not the batches).

    ``loader.dataset`` is the fetcher the workers use; the dataset passed in is
    ``loader.dataset.dataset`` (attribute access falls through to it).

    Example:
        >>> data = torch.arange(10)
        >>> loader = ResumableDataLoader(data, batch_size=4, seed=0)
        >>> for epoch in loader.epochs(2):
        ...     for batch in loader:
        ...         state = loader.state_dict()  # save it with the model
        >>> resumed = ResumableDataLoader(data, batch_size=4, seed=0)
        >>> resumed.load_state_dict(state)
        >>> (resumed.epoch, resumed.position)
        (1, 10)
    """

    def __init__(
        self,
        dataset: MapDataset,
        batch_size: int = 1,
        *,
        shuffle: bool = True,
        seed: int | None = 0,
        rank: int | None = None,
        world_size: int | None = None,
        group: dist.ProcessGroup | None = None,
        drop_last: bool = False,
        sampler: ResumableSampler | None = None,
        global_rng: str | None = "batch",
        warm_start: bool | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise ResumeError(
                "ResumableDataLoader takes map-style datasets; for an IterableDataset use "
                "resumable_data's stream pipelines (ShardedIterable and its wrappers)"
            )
        check_int_arg("batch_size", batch_size, minimum=1)
        check_global_rng(global_rng)
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
            default_rank, default_world = distributed_defaults(group)
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
        elif (shuffle, seed, rank, world_size, group) != (True, 0, None, None, None):
            raise ResumeError(
                "pass either sampler= or shuffle=/seed=/rank=/world_size=/group=, not both; the "
                "sampler already fixes them"
            )
        elif sampler.dataset_length != len(dataset):
            raise ResumeError(
                f"sampler covers {sampler.dataset_length} samples but the dataset has {len(dataset)}; "
                f"build the sampler as ResumableSampler(dataset, ...)"
            )
        # A private generator: torch draws each iterator's worker base seed from it, which would
        # otherwise consume the global RNG (and change model randomness after a resume).
        self._seed_generator = torch.Generator()
        self._resumable = sampler
        self._cursor = sampler.cursor
        self._plan = _BatchPlan(sampler, batch_size, drop_last)
        if warm_start is None:
            warm_start = (
                not dataloader_kwargs.get("persistent_workers") and dataloader_kwargs.get("worker_init_fn") is None
            )
        self._warm_start = bool(warm_start)
        self._warm_pass: WarmPass | None = None  # the last pass's handle, never the iterator
        self._fetcher = fetcher = BatchFetcher(
            dataset, global_rng=global_rng, sample_keys=bool(getattr(dataset, "wants_sample_key", False))
        )
        super().__init__(
            fetcher,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            generator=self._seed_generator,
            **dataloader_kwargs,
        )

    @property
    def _index_sampler(self) -> _BatchPlan:
        # DataLoader's hook for what its iterators draw from: our batch tickets, cut from the
        # sampler's order for the segment the current iteration covers.
        return self._plan

    # -- read-only views ---------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._cursor.epoch

    @property
    def position(self) -> int:
        """Global samples handed out in the current epoch (all ranks together)."""
        return self._cursor.position

    def set_epoch(self, epoch: int) -> None:
        """As :meth:`ResumableSampler.set_epoch`: the restored epoch keeps its position."""
        self._cursor.set_epoch(epoch)

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """The epochs still to run, each already ``set_epoch``-ed; starts at the restored epoch.

        Example:
            >>> loader = ResumableDataLoader(torch.arange(6), batch_size=3, shuffle=False)
            >>> [(epoch, [b.tolist() for b in loader]) for epoch in loader.epochs(2)]
            [(0, [[0, 1, 2], [3, 4, 5]]), (1, [[0, 1, 2], [3, 4, 5]])]
        """
        return self._cursor.epochs(num_epochs)

    def peek_indices(self, n_batches: int = 1) -> list[list[int]]:
        """Dataset indices of the next ``n_batches`` batches iteration would yield (changes nothing).

        Useful to fingerprint the next batch in a checkpoint and check it after a resume.
        """
        check_int_arg("n_batches", n_batches, minimum=1)
        epoch, start = self._cursor.next_segment()
        size = self._plan.batch_size
        count = min(n_batches, self._plan.batch_count(start)) * size
        flat = [i for chunk in self._resumable.index_chunks(epoch, start, count) for i in chunk.tolist()]
        return [flat[i : i + size] for i in range(0, len(flat), size)]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # ours wraps DataLoader's iterator
        if self._warm_pass is not None:  # a previous warm pass's thread may still hold the workers
            self._warm_pass.close()
            self._warm_pass = None
        segment = self._cursor.begin()
        self._seed_generator.manual_seed(hash_ints(self._resumable.seed, segment.epoch, segment.start) >> 1)
        inner: Iterator[Any]
        if self._warm_start and self.num_workers > 0:
            inner = warm = WarmStart(
                lambda first_batch: self._worker_iterator(segment, first_batch),
                lambda batch: self._fetch_here(segment, batch),
                self._plan.batch_count(segment.start),
                self._pin_device(),
            )
            self._warm_pass = warm.handle
        else:
            inner = self._worker_iterator(segment, None)
        return _ResumableIterator(inner, self._cursor, self._plan, segment)

    def _pin_device(self) -> str | None:
        """Where DataLoader's pin thread would pin batches (None: it would not), for warm start."""
        if not self.pin_memory or not torch.accelerator.is_available():
            return None
        accelerator = torch.accelerator.current_accelerator()
        return None if accelerator is None or accelerator.type == "mps" else accelerator.type

    def _worker_iterator(self, segment: Segment, first_batch: Callable[[], int] | None) -> Iterator[Any]:
        """DataLoader's own iterator over ``segment`` (from batch ``first_batch()`` when given)."""
        self._plan.select(segment, first_batch)
        return super().__iter__()

    def _fetch_here(self, segment: Segment, batch: int) -> Any:
        """Batch ``batch`` of ``segment`` fetched and collated in this process (warm start)."""
        return self.collate_fn(self._fetcher.__getitems__(self._plan.ticket(segment, batch)))

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``version``, ``epoch``, ``position`` (global samples handed out) and the configuration.

        O(1) time and size (under 512 bytes serialized), whatever the dataset size, position,
        world size or number of workers.
        """
        state = self._resumable.state_dict()
        state[keys.BATCH_SIZE] = self._plan.batch_size
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Continue from ``state_dict``; see :meth:`ResumableSampler.load_state_dict`.

        Raises:
            ResumeError: malformed or mismatching state; the loader is unchanged.
        """
        self._resumable.check_state(state_dict, strict=strict, what=_WHAT)()


class _BatchPlan(torch.utils.data.Sampler[Ticket]):
    """The batches of one segment of an epoch, as tickets; what the DataLoader's iterators draw."""

    def __init__(self, sampler: ResumableSampler, batch_size: int, drop_last: bool) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._segment = Segment(0, 0, 0)
        self._first_batch: Callable[[], int] | None = None

    def select(self, segment: Segment, first_batch: Callable[[], int] | None = None) -> None:
        """Make ``segment`` the stretch the next ``iter()`` covers.

        ``first_batch``, when given, is asked on the first draw which batch of the segment to
        start from (warm start: the main process served the ones before).
        """
        self._segment, self._first_batch = segment, first_batch

    def batch_count(self, start: int) -> int:
        """Batches this rank yields when the epoch continues from global position ``start``."""
        samples = self.sampler.rank_samples(start)
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def __len__(self) -> int:
        return self.batch_count(0)

    def ticket(self, segment: Segment, batch: int) -> Ticket:
        """Batch number ``batch`` of ``segment``, on its own (what the main process fetches)."""
        return next(self._tickets(segment, batch))

    def __iter__(self) -> Iterator[Ticket]:
        # A generator: first_batch is asked on the first draw, i.e. once the workers exist.
        segment, first_batch = self._segment, self._first_batch
        yield from self._tickets(segment, first_batch() if first_batch is not None else 0)

    def _tickets(self, segment: Segment, skip: int) -> Iterator[Ticket]:
        sampler, size = self.sampler, self.batch_size
        epoch, start = segment.epoch, sampler.position_after(segment.start, skip * size)
        batches = self.batch_count(start)
        # The first chunk is one batch: a restore (or an epoch start) waits for it alone.
        chunks = sampler.index_chunks(epoch, start, batches * size, first_chunk=size)
        first, stride = start + sampler.rank, sampler.world_size * size
        keys = batch_keys(sampler.seed, epoch, first, stride, batches)
        buffer: list[int] = []
        offset = 0
        for batch, key in enumerate(keys):
            if len(buffer) - offset < size:
                buffer, offset = buffer[offset:], 0
                for chunk in chunks:
                    buffer.extend(chunk.tolist())
                    if len(buffer) >= size:
                        break
            yield Ticket(sampler.seed, epoch, first + batch * stride, buffer[offset : offset + size], key)
            offset += size


class _ResumableIterator(Iterator[Any]):
    """Wraps the DataLoader's iterator and advances the cursor as each batch is handed out."""

    def __init__(self, inner: Iterator[Any], cursor: EpochCursor, plan: _BatchPlan, segment: Segment) -> None:
        self._inner = inner
        self._cursor = cursor
        self._sampler = plan.sampler
        self._batch_size = plan.batch_size
        self._segment = segment
        self._n_batches = plan.batch_count(segment.start)
        self._yielded = 0

    def __iter__(self) -> _ResumableIterator:
        return self

    def __len__(self) -> int:
        return self._n_batches - self._yielded

    def __next__(self) -> Any:
        start = self._segment.start
        try:
            batch = next(self._inner)
        except StopIteration:
            self._cursor.advance(self._segment, self._sampler.end_position(start), True)
            raise
        self._yielded += 1
        if self._yielded >= self._n_batches:
            position = self._sampler.end_position(start)
        else:
            position = self._sampler.position_after(start, self._yielded * self._batch_size)
        self._cursor.advance(self._segment, position, self._sampler.is_end(position))
        return batch


def wrap(dataloader: DataLoader, *, seed: int | None = None, global_rng: str | None = "batch") -> ResumableDataLoader:
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

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = wrap(DataLoader(list(range(8)), batch_size=4, shuffle=True), seed=0)
        >>> sorted(i for batch in loader for i in batch.tolist())
        [0, 1, 2, 3, 4, 5, 6, 7]

    Raises:
        ResumeError: the loader's order cannot be resumed exactly (sampling with replacement, a
            custom sampler or batch_sampler, an IterableDataset, no automatic batching).
    """
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
    dataset = cast(MapDataset, dataloader.dataset)
    if dataloader.batch_size is None or type(dataloader.batch_sampler) not in _PLAIN_BATCH_SAMPLERS:
        raise ResumeError(
            "wrap() supports loaders built with batch_size= (a plain BatchSampler); a custom "
            "batch_sampler decides batches itself and cannot be resumed from a position. Use "
            "ResumableDataLoader(dataset, batch_size=..., shuffle=..., seed=...) instead"
        )
    source = dataloader.sampler
    world, rank, drop_tail = 1, 0, dataloader.drop_last
    own_seed: int | None = None
    if isinstance(source, DistributedSampler):
        shuffle, own_seed = source.shuffle, source.seed
        world, rank, drop_tail = source.num_replicas, source.rank, source.drop_last
    elif isinstance(source, RandomSampler):
        if source.replacement or source.num_samples != len(dataset):
            raise ResumeError(
                "wrap() cannot resume RandomSampler(replacement=True) or a num_samples different "
                "from the dataset length: that is sampling, not an order. Use "
                "ResumableDataLoader(dataset, shuffle=True, seed=...) for a shuffled epoch"
            )
        shuffle = True
        if source.generator is not None:
            own_seed = source.generator.initial_seed()
    elif isinstance(source, SequentialSampler):
        shuffle = False
    else:
        raise ResumeError(
            f"wrap() cannot resume a custom sampler ({type(source).__name__}); build a "
            "ResumableSampler (or ResumableDataLoader with shuffle=/seed=) instead"
        )
    sampler = ResumableSampler(
        dataset,
        shuffle=shuffle,
        seed=seed if seed is not None else own_seed if own_seed is not None else torch.initial_seed(),
        rank=rank,
        world_size=world,
        drop_last=drop_tail,
        adopt_checkpoint_seed=seed is None,
    )
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
        dataset,
        batch_size=dataloader.batch_size,
        drop_last=dataloader.drop_last,
        sampler=sampler,
        global_rng=global_rng,
        **kwargs,
    )
