"""ResumableDataLoader: a DataLoader whose state is exactly the batches it handed out.

How the position stays exact with workers and prefetching, with no messages to workers: with
``in_order=True`` a ``DataLoader`` yields batches in the order its batch sampler produced them, and
every batch but the last of an epoch holds ``batch_size`` indices per rank. So the number of batches
handed to the caller determines the global position: ``start + world_size * batch_size * k``.
The loader counts the batches it yields — batches prefetched by workers are not counted, because
they have not been yielded — and the restored loader simply starts its batch plan at that position.

Its public surface is DataLoader's: ``loader.dataset`` is the dataset passed in, ``loader.sampler``
the :class:`ResumableSampler`, ``loader.batch_sampler`` a
:class:`~resumable_data.map.batch_sampler.ResumableBatchSampler` whose batches are plain lists of
indices that carry their global-RNG key, and ``loader.collate_fn`` a
:class:`~resumable_data.map.fetch.SeededCollate` around the collate function passed in (see
``map.fetch``). A DataLoader rebuilt from them fetches the same batches with the same augmentations. ``wrap()``
(``map.wrapping``) takes over an existing DataLoader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.utils.data
from torch.utils.data import DataLoader, DistributedSampler

from ..audit.records import Recorder, loader_id, recorder
from ..core.cursor import EpochCursor, Progress, Segment
from ..core.dist import distributed_defaults
from ..core.growth import ERROR
from ..core.hash import hash_ints
from ..core.state import check_int_arg
from ..errors import ResumeError
from .batch_sampler import ResumableBatchSampler
from .fetch import MapDataset, SeededCollate, check_global_rng, fetch_here
from .sampler import ResumableSampler
from .warm import WarmPass, WarmStart

__all__ = ["ResumableDataLoader"]

_WHAT = "ResumableDataLoader"
# DataLoader arguments that the resumable loader decides itself.
_OWNED = ("sampler", "batch_sampler", "generator")


class ResumableDataLoader(DataLoader):
    """A ``torch.utils.data.DataLoader`` that saves and restores its exact position in O(1).

    Args:
        dataset: a map-style dataset (``__getitem__`` + ``__len__``; ``__getitems__`` is used when
            present). A dataset whose class sets ``wants_sample_key = True`` is indexed with
            :class:`~resumable_data.rng.SampleKey` so it can draw per-sample randomness.
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
            ``seed``, ``rank``, ``world_size``, ``group`` and ``growth`` must be left at their defaults.
        growth: what ``load_state_dict`` does with a checkpoint taken on a shorter dataset (samples
            appended since): ``"error"`` (default) refuses it; ``"next_epoch"`` finishes the
            restored epoch over the checkpoint's samples in its order and takes the new ones from
            the next epoch; ``"append"`` finishes it with the new samples, shuffled, after the
            rest of its order (see :class:`ResumableSampler`). A shorter dataset is refused.
        global_rng: ``"batch"`` (default) seeds torch's, numpy's and python's global RNGs from
            ``(seed, epoch, position)`` before each batch is fetched, so augmentation drawn from them
            (torchvision transforms) resumes bitwise with any ``num_workers`` (for the same batch
            size and world size); ``"sample"`` seeds them from ``(seed, epoch, index)`` before each
            sample (also independent of batch size and world size, at a cost per sample);
            ``None`` leaves them alone.
        warm_start: with workers, fetch the first batch of each pass (a resume, an epoch start)
            in the main process instead of waiting for the workers to start, and hand over to them
            as soon as they deliver; batches are bitwise the same either way. ``None`` (default):
            on for non-persistent workers without a ``worker_init_fn`` — where workers start at
            every pass and the dataset cannot depend on per-worker set-up — off otherwise
            (``benchmarks/bench_resume.py`` compares both).
        **dataloader_kwargs: any other ``DataLoader`` keyword (``num_workers``, ``collate_fn``,
            ``pin_memory``, ``prefetch_factor``, ``persistent_workers``, ``worker_init_fn``, ...).

    ``state_dict()`` may be called at any batch boundary; ``load_state_dict()`` followed by
    iteration yields exactly the next batch of the uninterrupted run. ``num_workers``,
    ``prefetch_factor``, ``pin_memory`` and ``persistent_workers`` may change across a resume with
    no effect on the stream. ``batch_size`` and ``world_size`` may change too: the rest of the epoch
    is then consumed exactly once across the new ranks (batches are cut differently, so only the
    sequence of global positions is the same as before, not the batches).

    ``loader.dataset`` is the dataset passed in; ``loader.sampler`` is the
    :class:`ResumableSampler`, ``loader.batch_sampler`` the batches it is cut into (a
    ``ResumableBatchSampler``), ``loader.batch_size`` and ``loader.drop_last`` theirs. A
    ``DataLoader`` rebuilt from these public attributes (accelerate's ``prepare``) loads the same
    batches with the same augmentations.

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
        growth: str = ERROR,
        **dataloader_kwargs: Any,
    ) -> None:
        _check_arguments(dataset, batch_size, global_rng, dataloader_kwargs)
        if sampler is None:
            default_rank, default_world = distributed_defaults(group)
            sampler = ResumableSampler(
                dataset,
                shuffle=shuffle,
                seed=seed,
                rank=default_rank if rank is None else rank,
                world_size=default_world if world_size is None else world_size,
                drop_last=drop_last,
                growth=growth,
            )
        else:
            _check_sampler(sampler, dataset, (shuffle, seed, rank, world_size, group, growth))
        # A private generator: torch draws each iterator's worker base seed from it, which would
        # otherwise consume the global RNG (and change model randomness after a resume).
        self._seed_generator = torch.Generator()
        self._cursor = sampler.cursor
        self._progress = Progress()  # this loader's own: another loader or pass over the sampler does not move it
        self._audit_id = loader_id()  # None unless RESUMABLE_DATA_AUDIT asks for batch records
        self._batches = ResumableBatchSampler(
            sampler,
            batch_size,
            drop_last,
            global_rng=global_rng,
            sample_keys=bool(getattr(dataset, "wants_sample_key", False)),
            main_fetch=not dataloader_kwargs.get("num_workers"),
        )
        if warm_start is None:
            warm_start = (
                not dataloader_kwargs.get("persistent_workers") and dataloader_kwargs.get("worker_init_fn") is None
            )
        self._warm_start = bool(warm_start)
        self._warm_pass: WarmPass | None = None  # the last pass's handle, never the iterator
        collate_fn = dataloader_kwargs.pop("collate_fn", None) or torch.utils.data.default_collate
        self._dataset = dataset
        super().__init__(
            cast(torch.utils.data.Dataset, dataset),
            batch_sampler=self._batches,
            collate_fn=SeededCollate(collate_fn, global_rng),
            generator=self._seed_generator,
            **dataloader_kwargs,
        )

    # DataLoader's sampler, batch_size and drop_last describe what the batch sampler does; DataLoader
    # assigns its own placeholders (a SequentialSampler, None, False) as it initializes, which these
    # properties ignore.
    @property  # type: ignore[override]
    def sampler(self) -> ResumableSampler:
        """The order: a :class:`ResumableSampler` (``rank``, ``world_size``, ``seed``, ...)."""
        return self._batches.sampler

    @sampler.setter
    def sampler(self, _: Any) -> None:
        pass

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank."""
        return self._batches.batch_size

    @batch_size.setter
    def batch_size(self, _: Any) -> None:
        pass

    @property
    def drop_last(self) -> bool:
        """Whether the last partial batch is dropped."""
        return self._batches.drop_last

    @drop_last.setter
    def drop_last(self, _: Any) -> None:
        pass

    # -- read-only views ---------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._cursor.state_of(self._progress).epoch

    @property
    def position(self) -> int:
        """Global samples handed out in the current epoch (all ranks together)."""
        return self._cursor.state_of(self._progress).position

    def set_epoch(self, epoch: int) -> None:
        """The next pass is epoch ``epoch`` from its start; a pending restore of that epoch is kept.

        So a loop calling ``set_epoch(epoch)`` at the top of every epoch resumes mid-epoch, and a
        loader given the same epoch again (Lightning's validation loop) makes a full pass each time.
        """
        self._cursor.set_epoch(epoch)

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """The epochs still to run, each already ``set_epoch``-ed; starts at the restored epoch.

        Example:
            >>> loader = ResumableDataLoader(torch.arange(6), batch_size=3, shuffle=False)
            >>> [(epoch, [b.tolist() for b in loader]) for epoch in loader.epochs(2)]
            [(0, [[0, 1, 2], [3, 4, 5]]), (1, [[0, 1, 2], [3, 4, 5]])]
        """
        return self._cursor.epochs(num_epochs, owner=self._progress)

    def peek_indices(self, n_batches: int = 1) -> list[list[int]]:
        """Dataset indices of the next ``n_batches`` batches iteration would yield (changes nothing).

        Useful to fingerprint the next batch in a checkpoint and check it after a resume.
        """
        check_int_arg("n_batches", n_batches, minimum=1)
        epoch, start = self._cursor.next_segment(self._progress)
        size = self.batch_size
        count = min(n_batches, self._batches.batch_count(epoch, start)) * size
        flat = [i for chunk in self.sampler.index_chunks(epoch, start, count) for i in chunk.tolist()]
        return [flat[i : i + size] for i in range(0, len(flat), size)]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # ours wraps DataLoader's iterator
        return self._open()

    def _open(self) -> _ResumableIterator:
        """A pass over the stretch of the epoch the loader's next iteration covers."""
        if self._warm_pass is not None:  # a previous warm pass's thread may still hold the workers
            self._warm_pass.close()
            self._warm_pass = None
        segment = self._cursor.begin(self._progress)
        self._seed_generator.manual_seed(hash_ints(self.sampler.seed, segment.epoch, segment.start) >> 1)
        inner: Iterator[Any]
        if self._warm_start and self.num_workers > 0:
            inner = warm = WarmStart(
                lambda first_batch: self._worker_iterator(segment, first_batch),
                lambda batch: self._fetch_here(segment, batch),
                self._batches.batch_count(segment.epoch, segment.start),
                self._pin_device(),
            )
            self._warm_pass = warm.handle
        else:
            inner = self._worker_iterator(segment, None)
        audit = recorder(self._audit_id, self.sampler.rank)
        return _ResumableIterator(inner, self._cursor, self._progress, self._batches, segment, self._open, audit)

    def _pin_device(self) -> str | None:
        """Where DataLoader's pin thread would pin batches (None: it would not), for warm start."""
        if not self.pin_memory or not torch.accelerator.is_available():
            return None
        accelerator = torch.accelerator.current_accelerator()
        return None if accelerator is None or accelerator.type == "mps" else accelerator.type

    def _fetch_here(self, segment: Segment, batch: int) -> Any:
        """Batch ``batch`` of ``segment`` fetched and collated in this process (warm start)."""
        return fetch_here(self._dataset, self._batches.batch(segment, batch), self.collate_fn)

    def _worker_iterator(self, segment: Segment, first_batch: Callable[[], int] | None) -> Iterator[Any]:
        """DataLoader's own iterator over ``segment`` (from batch ``first_batch()`` when given)."""
        with self._batches.driven(segment, first_batch):
            return super().__iter__()

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``version``, ``epoch``, ``position`` (global samples handed out) and the configuration.

        O(1) time and size (under 512 bytes serialized), whatever the dataset size, position,
        world size or number of workers.

        Examples:
            >>> loader = ResumableDataLoader(torch.arange(10), batch_size=4, seed=0)
            >>> _ = next(iter(loader))
            >>> loader.state_dict()
            {'version': 2, 'epoch': 0, 'position': 4, 'dataset_length': 10, 'seed': 0, 'shuffle': True,
             'world_size': 1, 'drop_last': False, 'batch_size': 4}
        """
        state = self._cursor.state_of(self._progress)
        return self._batches.state_for(state.epoch, state.position)

    def load_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Continue from ``state_dict``; see :meth:`ResumableSampler.load_state_dict`.

        Raises:
            ResumeError: malformed or mismatching state; the loader is unchanged.
        """
        self.sampler.check_state(state_dict, strict=strict, what=_WHAT, for_loader=True)()


def _check_arguments(dataset: Any, batch_size: int, global_rng: Any, dataloader_kwargs: dict[str, Any]) -> None:
    """Refuse what a ResumableDataLoader cannot resume (and drop the owned keywords left at None)."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise ResumeError(
            "ResumableDataLoader takes map-style datasets; for an IterableDataset use "
            "resumable_data's stream pipelines (ShardedIterable and its wrappers)"
        )
    check_int_arg("batch_size", batch_size, minimum=1)
    check_global_rng(global_rng)
    for name in _OWNED:
        if isinstance(dataloader_kwargs.get(name), DistributedSampler):
            raise ResumeError(
                "ResumableDataLoader shards by rank itself and was given a DistributedSampler: "
                "Lightning injects one under strategy='ddp'; pass Trainer(use_distributed_sampler=False)"
            )
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
    if global_rng == "sample" and getattr(dataset, "__getitems__", None) is not None:
        raise ResumeError(
            f"global_rng='sample' seeds the global RNGs before each sample, but {type(dataset).__name__} "
            "defines __getitems__, which fetches a whole batch at once; use global_rng='batch'"
        )


def _check_sampler(sampler: Any, dataset: MapDataset, order_arguments: tuple[Any, ...]) -> None:
    """Refuse a ``sampler=`` that is not a ResumableSampler over ``dataset``, or one given with order arguments."""
    if not isinstance(sampler, ResumableSampler):
        raise ResumeError(
            f"sampler must be a ResumableSampler, got {type(sampler).__name__}; "
            "pass shuffle=/seed=/rank=/world_size= instead"
        )
    if order_arguments != (True, 0, None, None, None, ERROR):
        raise ResumeError(
            "pass either sampler= or shuffle=/seed=/rank=/world_size=/group=/growth=, not both; the sampler "
            "already fixes them"
        )
    if sampler.dataset_length != len(dataset):
        raise ResumeError(
            f"sampler covers {sampler.dataset_length} samples but the dataset has {len(dataset)}; "
            f"build the sampler as ResumableSampler(dataset, ...)"
        )


class _ResumableIterator(Iterator[Any]):
    """Wraps the DataLoader's iterator and advances the cursor as each batch is handed out.

    The pass is bound to its stretch of the epoch when ``iter()`` is called, but a ``set_epoch`` or a
    ``load_state_dict`` that comes before its first batch is taken (Lightning creates the train
    iterator first and calls ``set_epoch`` after; a callback may load a state in between): at the
    first ``next()`` such a pass is replaced by a fresh one over the new selection.
    """

    def __init__(
        self,
        inner: Iterator[Any],
        cursor: EpochCursor,
        progress: Progress,
        batches: ResumableBatchSampler,
        segment: Segment,
        reopen: Callable[[], _ResumableIterator] | None = None,
        audit: Recorder | None = None,
    ) -> None:
        self._inner = inner
        self._cursor = cursor
        self._progress = progress
        self._batches = batches
        self._segment = segment
        self._n_batches = batches.batch_count(segment.epoch, segment.start)
        self._yielded = 0
        self._reopen = reopen  # the loader's _open, until the first batch is drawn
        self._audit = audit

    def __iter__(self) -> _ResumableIterator:
        return self

    def __len__(self) -> int:
        return self._n_batches - self._yielded

    def __next__(self) -> Any:
        if self._reopen is not None:
            reopen, self._reopen = self._reopen, None
            if self._cursor.state_of(self._progress) is not self._progress:  # selected since iter()
                fresh = reopen()
                self._inner, self._segment, self._n_batches = fresh._inner, fresh._segment, fresh._n_batches
        epoch, start, sampler = self._segment.epoch, self._segment.start, self._batches.sampler
        try:
            batch = next(self._inner)
        except StopIteration:
            self._cursor.advance(self._segment, sampler.end_position(epoch, start), True, self._progress)
            raise
        if self._audit is not None:  # the batch's place in the epoch and its indices, before it counts
            where = self._batches.position_after(epoch, start, self._yielded)
            indices = self._batches.batch(self._segment, self._yielded).plain()  # the RNGs untouched
            self._audit.batch(batch, epoch=epoch, position=where, indices=indices)
        self._yielded += 1
        position = self._batches.position_after(epoch, start, self._yielded)
        self._cursor.advance(self._segment, position, sampler.is_end(epoch, position), self._progress)
        return batch
