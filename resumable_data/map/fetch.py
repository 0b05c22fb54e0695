"""What a ResumableDataLoader fetches: batch tickets, and the global RNGs seeded for each batch.

Users' augmentation draws from the *global* RNGs (torchvision's transforms use ``torch.rand*``;
others use ``numpy.random`` or ``random``). Inside DataLoader workers those RNGs are seeded once per
worker and iterator, so what a batch gets depends on which worker fetched it and on everything that
worker fetched before — a resume (or another ``num_workers``) changes the augmentations.

The fix is to make the global RNGs a function of *what* is fetched: before each batch (or each
sample) the fetcher seeds torch's CPU RNG, numpy's global RNG and python's ``random`` from
``(seed, epoch, position)`` (or ``(seed, epoch, index)`` per sample). Then a batch's augmentations
are the same in any worker, after any resume, with persistent workers, and with ``num_workers=0``.

With ``num_workers=0`` the fetch runs in the main process, where the model draws from the same global
RNGs (dropout, ``random.random()`` in the training loop). There all three are saved before the fetch
and restored after it, so the main process's streams are exactly what they would be with workers:
model randomness never depends on the data, and ``num_workers`` can change across a resume.
How the RNGs are seeded and put back, through public APIs only, is ``rng.global_rngs``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
import torch.utils.data
from torch.utils.data import get_worker_info

from ..core.hash import hash_ints, hash_more, hash_more_array
from ..errors import ResumeError
from ..rng.global_rngs import GLOBAL_RNGS
from ..rng.sample import SampleKey

__all__ = ["GLOBAL_RNG_MODES", "BatchFetcher", "MapDataset", "Ticket", "batch_keys"]

GLOBAL_RNG_MODES = ("batch", "sample")
# Domain separation: the global-RNG seeds must not coincide with the order's or sample_generator's.
_BATCH_SALT = 0x6261746368  # "batch"
_SAMPLE_SALT = 0x73616D706C  # "sampl"
_KEY_BLOCK = 64  # batch keys computed together, vectorized, after a pass's first


class MapDataset(Protocol):
    """What a ResumableDataLoader can load from: a sized, indexable dataset (a ``Dataset``, a list, a tensor)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: Any, /) -> Any: ...


class Ticket(NamedTuple):
    """One batch to fetch: its indices and what fixes its randomness."""

    seed: int
    epoch: int
    position: int  # global position of this rank's first sample of the batch
    indices: list[int]
    key: int  # seeds the global RNGs for the batch (global_rng="batch"): see batch_keys


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


class BatchFetcher(torch.utils.data.Dataset):
    """The dataset a ResumableDataLoader hands its workers: fetches a :class:`Ticket`'s samples.

    Indexing it with an int reads the user's dataset directly; attribute access falls through to
    the user's dataset too (``loader.dataset.classes``), which is ``loader.dataset.dataset``.
    """

    def __init__(self, dataset: MapDataset, *, global_rng: str | None, sample_keys: bool) -> None:
        self.dataset = dataset
        self.global_rng = global_rng
        self.sample_keys = sample_keys

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found normally; never for "dataset" itself (unpickling).
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitems__(self, ticket: Ticket) -> list[Any]:
        if self.global_rng is None:
            return self._fetch(ticket)
        if self.global_rng == "sample":
            return self._fetch_seeding_each_sample(ticket)
        # In the main process the three RNGs are the training loop's too: they are put back after the fetch.
        with GLOBAL_RNGS.seeded(ticket.key, restore=get_worker_info() is None):
            return self._fetch(ticket)

    def _fetch_seeding_each_sample(self, ticket: Ticket) -> list[Any]:
        # A sample's key: hash_ints(seed, epoch, index, salt), all of the batch's at once.
        prefix = hash_ints(ticket.seed, ticket.epoch)
        keys = hash_more_array(prefix, np.asarray(ticket.indices), _SAMPLE_SALT).tolist()
        with GLOBAL_RNGS.seeded(keys[0], restore=get_worker_info() is None) as rngs:
            samples = []
            for n, (index, key) in enumerate(zip(ticket.indices, keys, strict=True)):
                if n:
                    rngs.seed(key)
                samples.append(self._one(ticket, index))
            return samples

    def _one(self, ticket: Ticket, index: int) -> Any:
        return self.dataset[SampleKey(index, ticket.epoch, ticket.seed) if self.sample_keys else index]

    def _fetch(self, ticket: Ticket) -> list[Any]:
        if self.sample_keys:
            return [self._one(ticket, index) for index in ticket.indices]
        dataset = self.dataset
        getitems = getattr(dataset, "__getitems__", None)
        if getitems is not None:
            return getitems(ticket.indices)
        return [dataset[index] for index in ticket.indices]  # as DataLoader's fetcher: no call per sample
