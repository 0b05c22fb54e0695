"""ResumableBatchSampler: a ResumableDataLoader's ``batch_sampler``, public, rebuildable, resumable in O(1).

It cuts a :class:`~resumable_data.ResumableSampler`'s order into batches and yields each as a
:class:`~resumable_data.map.fetch.BatchIndices` — a plain ``list`` of dataset indices that also carries
the key its fetch seeds the global RNGs with (see ``map.fetch``). So a ``DataLoader`` built from a
ResumableDataLoader's public attributes (``DataLoader(loader.dataset,
batch_sampler=loader.batch_sampler, collate_fn=loader.collate_fn, ...)``, which is what accelerate's
``prepare`` and ``skip_first_batches`` do) fetches the same batches with the same augmentations.

Two ways to be iterated:

- By its ResumableDataLoader, which counts the batches it hands out (workers draw ahead of that):
  the loader says which stretch of the epoch to cover (:meth:`ResumableBatchSampler.driven`), and
  the iteration moves nothing itself.
- By anyone else (a rebuilt loader, ``list()``): like the standalone sampler, each ``iter()`` is a
  pass over the selected epoch from its start (or from a pending restore) that owns its progress,
  so it moves nothing the loader or a later pass yields; ``state_dict()`` reports the newest pass's
  progress. The iterator is itself stateful, so torchdata's ``StatefulDataLoader`` (accelerate's
  ``use_stateful_dataloader=True``) snapshots the position of the very batches it handed out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch.utils.data

from ..core import state as keys
from ..core.cursor import Segment
from ..core.hash import hash_ints
from ..core.state import check_int_arg
from ..errors import ResumeError
from ..rng.sample import SampleKey
from .fetch import SKIPPED, BatchIndices, batch_keys, restore_pending
from .sampler import ResumableSampler

__all__ = ["ResumableBatchSampler"]

_WHAT = "batch sampler"


class ResumableBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of a :class:`~resumable_data.ResumableSampler`'s order, each carrying its global-RNG key.

    Built by :class:`~resumable_data.ResumableDataLoader` (``loader.batch_sampler``); it shares the
    loader's sampler, so ``set_epoch`` and ``load_state_dict`` on either act on both, and
    ``loader.state_dict()`` and ``loader.batch_sampler.state_dict()`` agree until the batch sampler
    is iterated by something else (then it reports that pass).

    Args:
        sampler: the order (``loader.sampler``).
        batch_size: samples per batch on this rank.
        drop_last: drop the last partial batch.
        global_rng: the loader's ``global_rng`` mode.
        sample_keys: yield :class:`~resumable_data.rng.SampleKey` objects instead of ints.
        main_fetch: batches are fetched in the main process (``num_workers=0``).

    Example:
        >>> from resumable_data import ResumableDataLoader
        >>> loader = ResumableDataLoader(list(range(6)), batch_size=4, shuffle=False)
        >>> [list(batch) for batch in loader.batch_sampler]
        [[0, 1, 2, 3], [4, 5]]
        >>> loader.batch_sampler.state_dict()["position"], loader.position  # the loader did not move
        (6, 0)
    """

    def __init__(
        self,
        sampler: ResumableSampler,
        batch_size: int,
        drop_last: bool = False,
        *,
        global_rng: str | None = "batch",
        sample_keys: bool = False,
        main_fetch: bool = True,
    ) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.global_rng = global_rng
        self.sample_keys = sample_keys
        self.main_fetch = main_fetch
        self._driven: tuple[Segment, Callable[[], int] | None] | None = None
        self._stand_ins = 0

    def set_epoch(self, epoch: int) -> None:
        """As :meth:`ResumableSampler.set_epoch`: epoch ``epoch`` from its start, or a pending restore of it."""
        self.sampler.set_epoch(epoch)

    # -- the arithmetic of batches ---------------------------------------------------------------
    def batch_count(self, epoch: int, start: int) -> int:
        """Batches this rank yields when epoch ``epoch`` continues from global position ``start``."""
        samples = self.sampler.rank_samples(epoch, start)
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def __len__(self) -> int:
        """Batches in a full pass of the current epoch on this rank."""
        return self.batch_count(self.sampler.epoch, 0)

    def position_after(self, epoch: int, start: int, batches: int) -> int:
        """The global position once every rank has taken ``batches`` batches of epoch ``epoch`` from ``start``."""
        if batches >= self.batch_count(epoch, start):
            return self.sampler.end_position(epoch, start)
        return self.sampler.position_after(epoch, start, batches * self.batch_size)

    # -- batches ---------------------------------------------------------------------------------
    @contextmanager
    def driven(self, segment: Segment, first_batch: Callable[[], int] | None = None) -> Iterator[None]:
        """Within the block, ``iter()`` covers ``segment`` and moves nothing (the loader counts).

        ``first_batch``, when given, is asked on the first draw which batch of the segment to
        start from (warm start: the main process served the ones before).
        """
        self._driven = (segment, first_batch)
        try:
            yield
        finally:
            self._driven = None

    def skip_ahead(self, batches: int) -> None:
        """Begin the next pass of a rebuilt loader with ``batches`` stand-ins for consumed batches.

        For a wrapper that discards a resumed epoch's first batches unread — transformers' Trainer
        resumes through accelerate's ``skip_first_batches`` — after a restore that already put the
        position past them: the wrapper discards stand-ins (a fixed list, no index is computed), so
        the skip costs next to nothing whatever its length. A stand-in that is fetched raises
        :class:`ResumeError` (the wrapper skipped fewer batches than the checkpoint consumed).
        """
        self._stand_ins = check_int_arg("batches", batches, minimum=0)

    def __iter__(self) -> Iterator[BatchIndices]:
        if self._driven is not None:
            return self._driven_batches(*self._driven)
        if self.sampler.world_size > 1:
            raise ResumeError(
                f"this ResumableDataLoader's batches are already rank {self.sampler.rank}'s share of "
                f"{self.sampler.world_size} ranks, and a loader rebuilt from its batch_sampler (accelerate's "
                "prepare or skip_first_batches, which shard again) would give each rank part of its part. "
                "Under accelerate build it with world_size=1, rank=0: accelerate hands each process its "
                "batches of the one global order (or iterate the ResumableDataLoader itself)"
            )
        stand_ins, self._stand_ins = self._stand_ins, 0
        return _BatchIterator(self, stand_ins)

    def _driven_batches(self, segment: Segment, first_batch: Callable[[], int] | None) -> Iterator[BatchIndices]:
        # A generator: first_batch is asked on the first draw, i.e. once the workers exist.
        for batch in self.batches(segment, first_batch() if first_batch is not None else 0):
            if self.main_fetch:  # with workers, the draw may run in warm start's thread, mid-fetch
                restore_pending()
            yield batch

    def batch(self, segment: Segment, number: int) -> BatchIndices:
        """Batch ``number`` of ``segment``, on its own (what the main process fetches)."""
        return next(self.batches(segment, number))

    def batches(self, segment: Segment, skip: int = 0) -> Iterator[BatchIndices]:
        """The batches of ``segment`` from batch ``skip`` on; pure (moves nothing)."""
        sampler, size = self.sampler, self.batch_size
        epoch = segment.epoch
        start = sampler.position_after(epoch, segment.start, skip * size)
        count = self.batch_count(epoch, start)
        # The first chunk is one batch: a restore (or an epoch start) waits for it alone.
        chunks = sampler.index_chunks(epoch, start, count * size, first_chunk=size)
        first, stride = start + sampler.rank, sampler.world_size * size
        prefix = hash_ints(sampler.seed, epoch)
        seeding, main_fetch = self.global_rng, self.main_fetch
        buffer: list[Any] = []
        offset = 0
        for key in batch_keys(sampler.seed, epoch, first, stride, count):
            if len(buffer) - offset < size:
                buffer, offset = buffer[offset:], 0
                for chunk in chunks:
                    indices = chunk.tolist()
                    buffer.extend([SampleKey(i, epoch, sampler.seed) for i in indices] if self.sample_keys else indices)
                    if len(buffer) >= size:
                        break
            yield BatchIndices(buffer[offset : offset + size], key, seeding, prefix, main_fetch)
            offset += size

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The sampler's state (its newest pass's progress), with the batch size."""
        state = self.sampler.state_dict()
        state[keys.BATCH_SIZE] = self.batch_size
        return state

    def state_for(self, epoch: int, position: int) -> dict[str, Any]:
        """The state dict at ``(epoch, position)``."""
        state = self.sampler.state_for(epoch, position)
        state[keys.BATCH_SIZE] = self.batch_size
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Continue from ``state_dict`` (a ResumableDataLoader's state); see :meth:`ResumableSampler.load_state_dict`."""
        self.sampler.check_state(state_dict, strict=strict, what=_WHAT)()


class _BatchIterator(Iterator[BatchIndices]):
    """One pass of a batch sampler iterated by a rebuilt loader; owns its progress, reported as it draws.

    Entered lazily, on the first ``next()``, so that a ``load_state_dict`` between ``iter()`` and
    ``next()`` (what StatefulDataLoader does on a restore) decides where it starts.
    """

    def __init__(self, batch_sampler: ResumableBatchSampler, stand_ins: int = 0) -> None:
        self._owner = batch_sampler
        self._stand_ins = stand_ins
        size = batch_sampler.batch_size
        self._stand_in = BatchIndices([0] * size, 0, SKIPPED, 0, False)
        self._segment: Segment | None = None
        self._batches: Iterator[BatchIndices] = iter(())
        self._taken = 0
        self._total = 0

    def __iter__(self) -> _BatchIterator:
        return self

    def _enter(self, segment: Segment) -> Segment:
        self._segment, self._taken = segment, 0
        self._total = self._owner.batch_count(segment.epoch, segment.start)
        self._batches = self._owner.batches(segment)
        return segment

    def __next__(self) -> BatchIndices:
        if self._stand_ins:
            self._stand_ins -= 1
            return self._stand_in
        owner, cursor = self._owner, self._owner.sampler.cursor
        if owner.main_fetch:
            restore_pending()  # a fetch that raised before collation left the RNGs forked
        segment = self._segment or self._enter(cursor.begin_pass())
        if self._taken >= self._total:
            cursor.advance_pass(segment, owner.sampler.end_position(segment.epoch, segment.start), True)
            raise StopIteration
        batch = next(self._batches)
        self._taken += 1
        position = owner.position_after(segment.epoch, segment.start, self._taken)
        cursor.advance_pass(segment, position, owner.sampler.is_end(segment.epoch, position))
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The state after the batches this iterator has drawn (before any: where it will start)."""
        if self._segment is None:
            return self._owner.state_for(*self._owner.sampler.cursor.next_pass())
        epoch = self._segment.epoch
        return self._owner.state_for(epoch, self._owner.position_after(epoch, self._segment.start, self._taken))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue this iterator from ``state_dict`` (the sampler's next pass too, if this one never draws)."""
        self._enter(self._owner.sampler.check_state(state_dict, strict=True, what=_WHAT, through_iterator=True)())
