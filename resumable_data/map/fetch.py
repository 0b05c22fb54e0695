"""The global RNGs seeded for each batch, carried by the batch's own index list.

Users' augmentation draws from the *global* RNGs (torchvision's transforms use ``torch.rand*``;
others use ``numpy.random`` or ``random``). Inside DataLoader workers those RNGs are seeded once per
worker and iterator, so what a batch gets depends on which worker fetched it and on everything that
worker fetched before — a resume (or another ``num_workers``) changes the augmentations.

The fix is to make the global RNGs a function of *what* is fetched: before each batch (or each
sample) torch's CPU RNG, numpy's global RNG and python's ``random`` are seeded from
``(seed, epoch, position)`` (or ``(seed, epoch, index)`` per sample). Then a batch's augmentations
are the same in any worker, after any resume, with persistent workers, and with ``num_workers=0``.

The seeding travels with the batch itself, through public protocols only, so that a ``DataLoader``
rebuilt from a ResumableDataLoader's public attributes (``dataset``, ``batch_sampler``,
``collate_fn``: what accelerate's ``prepare`` and ``skip_first_batches`` copy) seeds exactly as the
original does. The batch sampler yields :class:`BatchIndices`, a ``list`` of the batch's indices that
also carries the batch's key:

- In a worker, the list arrives pickled through DataLoader's index queue, and unpickling rebuilds
  it through :func:`_arrive`, which seeds the worker's global RNGs for the key. The worker fetches
  the batch right after it unpickles it, whatever the dataset does with the list.
- In the main process (``num_workers=0``), the three RNGs are the training loop's too (dropout,
  ``random.random()``): they are forked (saved, then seeded) when the fetch first reads the list —
  DataLoader's fetcher iterates it, and so does ``__getitems__`` turning it into a tensor or an
  array — and the loader's ``collate_fn``, a :class:`SeededCollate`, puts them back after
  collation. So the main process's streams are exactly what they would be with workers: model
  randomness never depends on the data, and ``num_workers`` can change across a resume.

A batch that reaches the collate function without having been seeded (a plain list built by a
wrapper that cut or padded the batches) raises a :class:`ResumeError` instead of being augmented
from whatever state the RNGs were in. Seeding, saving and restoring run once per batch, so they are
done the fast way (``rng.global_rngs``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np
from torch.utils.data import get_worker_info

from ..core.hash import hash_ints, hash_more, hash_more_array
from ..errors import ResumeError
from ..rng.global_rngs import GLOBAL_RNGS

__all__ = [
    "GLOBAL_RNG_MODES",
    "BatchIndices",
    "MapDataset",
    "SeededCollate",
    "batch_keys",
    "fetch_here",
    "restore_pending",
]

GLOBAL_RNG_MODES = ("batch", "sample")
SKIPPED = "skipped"  # the seeding of a stand-in for a batch a wrapper discards unread (see BatchIndices)
# Domain separation: the global-RNG seeds must not coincide with the order's or sample_generator's.
_BATCH_SALT = 0x6261746368  # "batch"
_SAMPLE_SALT = 0x73616D706C  # "sampl"
_KEY_BLOCK = 64  # batch keys computed together, vectorized, after a pass's first


class MapDataset(Protocol):
    """What a ResumableDataLoader can load from: a sized, indexable dataset (a ``Dataset``, a list, a tensor)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: Any, /) -> Any: ...


def batch_keys(seed: int, epoch: int, first: int, stride: int, count: int) -> Iterator[int]:
    """The keys of ``count`` batches at global positions ``first, first + stride, ...``.

    A batch's key is ``hash_ints(seed, epoch, position, salt)``: what it fetches draws from the
    global RNGs seeded by it, whichever process fetches it. The first key is computed alone (a
    restore waits for it); the rest in vectorized blocks, a fraction of a microsecond each
    instead of two, since the main process makes one per batch.
    """
    prefix = hash_ints(seed, epoch)
    if count > 0:
        yield hash_more(prefix, first, _BATCH_SALT)
    for start in range(1, count, _KEY_BLOCK):
        positions = first + stride * np.arange(start, min(start + _KEY_BLOCK, count), dtype=np.int64)
        yield from hash_more_array(prefix, positions, _BATCH_SALT).tolist()


def check_global_rng(mode: Any) -> str | None:
    """Validate the ``global_rng`` argument."""
    if mode is not None and mode not in GLOBAL_RNG_MODES:
        raise ResumeError(f"global_rng should be one of {GLOBAL_RNG_MODES} or None, but got global_rng={mode!r}")
    return mode


class _Seeding(threading.local):
    """This thread's seeding bookkeeping: the main process's pending fork, a worker's seeded batch.

    Per thread: two 0-worker loaders in two threads each fork and put back their own RNG states
    (the fork holds the process-wide lock of ``GLOBAL_RNGS`` until collation, so they take turns).
    """

    forked: AbstractContextManager[Any] | None = None  # the fork a fetch opened, until collation
    seeded = False  # whether the batch being fetched had its RNGs seeded (checked at collation)


_Process = _Seeding()


def restore_pending() -> None:
    """Put back the main process's RNGs if a fetch forked them and did not reach collation."""
    forked, _Process.forked = _Process.forked, None
    if forked is not None:
        forked.__exit__(None, None, None)


def _fork(key: int) -> None:
    restore_pending()  # a fetch that raised, or a list read by a wrapper before its fetch
    forked = GLOBAL_RNGS.seeded(key, restore=True)
    forked.__enter__()
    _Process.forked, _Process.seeded = forked, True


class BatchIndices(list[Any]):  # a plain list to everyone who reads it
    """One batch's dataset indices, and the key its fetch seeds the global RNGs with.

    Args:
        indices: the batch's indices (ints, or :class:`~resumable_data.rng.SampleKey` objects).
        key: the batch key (:func:`batch_keys`).
        seeding: the loader's ``global_rng`` mode.
        prefix: ``hash_ints(seed, epoch)``, from which ``global_rng="sample"`` keys each sample.
        main_fetch: the loader fetches in the main process (``num_workers=0``): fork the RNGs there
            when the fetch reads the list.
    """

    __slots__ = ("key", "main_fetch", "prefix", "seeding")

    def __init__(self, indices: list[Any], key: int, seeding: str | None, prefix: int, main_fetch: bool) -> None:
        super().__init__(indices)
        self.key, self.seeding, self.prefix, self.main_fetch = key, seeding, prefix, main_fetch

    def plain(self) -> list[Any]:
        """The indices as a plain list, read without the fetch's seeding of the global RNGs: what a
        record of the batch takes (iterating the batch in the main process seeds them, for the fetch)."""
        return list(list.__iter__(self))

    def __reduce__(self) -> tuple[Callable[..., BatchIndices], tuple[Any, ...]]:
        return _arrive, (list(self), self.key, self.seeding, self.prefix, self.main_fetch)

    def __getitem__(self, item: Any) -> Any:
        """An index as a list gives it; a slice is a batch of its own, keyed by the batch's key and
        the slice's start: accelerate's ``split_batches`` hands each process such a part."""
        if not isinstance(item, slice):
            return list.__getitem__(self, item)
        start = item.indices(len(self))[0]
        part = list.__getitem__(self, item)
        return BatchIndices(part, hash_ints(self.key, start), self.seeding, self.prefix, self.main_fetch)

    def __iter__(self) -> Iterator[Any]:
        if self.seeding in GLOBAL_RNG_MODES and self.main_fetch and get_worker_info() is None:
            _fork(self.key)
        if self.seeding == "sample":
            return self._seeding_each_sample()
        return super().__iter__()

    def _seeding_each_sample(self) -> Iterator[Any]:
        # A sample's key: hash_ints(seed, epoch, index, salt), all of the batch's at once.
        items = list.__iter__(self)
        indices = [int(getattr(item, "index", item)) for item in list.__iter__(self)]
        for item, key in zip(
            items, hash_more_array(self.prefix, np.asarray(indices), _SAMPLE_SALT).tolist(), strict=True
        ):
            GLOBAL_RNGS.seed(key)
            yield item


def _arrive(indices: list[Any], key: int, seeding: str | None, prefix: int, main_fetch: bool) -> BatchIndices:
    """Unpickle a batch's indices; in a DataLoader worker, seed its global RNGs for the batch.

    A worker unpickles each batch's indices from its index queue right before fetching it, so the
    fetch draws from RNGs seeded by the key. Elsewhere (a copy in the main process) nothing is seeded.
    """
    if seeding == "batch" and get_worker_info() is not None:
        GLOBAL_RNGS.seed(key)
        _Process.seeded = True
    elif seeding == "sample" and get_worker_info() is not None:
        _Process.seeded = True  # each sample is seeded as the fetch iterates the list
    return BatchIndices(indices, key, seeding, prefix, main_fetch)


class SeededCollate:
    """A ResumableDataLoader's ``collate_fn``: collates as ``collate_fn`` does, then puts back the
    main process's RNGs that the fetch forked; refuses a batch fetched without its seeding.

    Args:
        collate_fn: the collate function the loader was given (DataLoader's default when none).
        seeding: the loader's ``global_rng`` mode; ``None`` checks nothing.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], seeding: str | None) -> None:
        self.collate_fn = collate_fn
        self.seeding = seeding

    def __call__(self, samples: list[Any]) -> Any:
        seeded, _Process.seeded = _Process.seeded, False
        try:
            if self.seeding is not None and not seeded:
                raise ResumeError(
                    "a batch reached collate_fn without its global-RNG seeding: the indices it was "
                    "fetched from are not the ResumableDataLoader's own. Either a loader rebuilt around "
                    "its batch_sampler padded them (accelerate's even_batches pads a short last batch "
                    "with a list of its own: use drop_last=True, even_batches=False, or a dataset length "
                    "that divides into full batches on every process), or a stand-in for a batch "
                    "consumed before the checkpoint was fetched (the wrapper that skips a resumed "
                    "epoch's first batches skipped fewer than the checkpoint consumed: resume with the "
                    "configuration that wrote it, same batch size, gradient accumulation and processes)"
                )
            return self.collate_fn(samples)
        finally:
            restore_pending()


def fetch_here(dataset: MapDataset, indices: BatchIndices, collate_fn: Callable[[list[Any]], Any]) -> Any:
    """Fetch and collate a batch in this (the main) process, as DataLoader's fetcher does, seeded."""
    if indices.seeding is not None:
        _fork(indices.key)
    getitems = getattr(dataset, "__getitems__", None)
    samples = getitems(indices) if getitems is not None else [dataset[index] for index in indices]
    return collate_fn(samples)
