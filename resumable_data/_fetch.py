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
numpy's public ``get_state``/``set_state`` copy its 624-word state in a Python loop (~100 µs
each), so numpy's state is copied as raw bytes through its bit generator's ctypes interface instead
(checked against ``get_state`` once per process; the slow path is the fallback).
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
import torch.utils.data

from ._hash import hash_ints
from ._state import ResumeError
from .rng import SampleKey

__all__ = ["GLOBAL_RNG_MODES", "BatchFetcher", "MapDataset", "Ticket", "fork_global_rngs", "seed_global_rngs"]

GLOBAL_RNG_MODES = ("batch", "sample")
# Domain separation: the global-RNG seeds must not coincide with the order's or sample_generator's.
_BATCH_SALT = 0x6261746368  # "batch"
_SAMPLE_SALT = 0x73616D706C  # "sampl"


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


def seed_global_rngs(key: int) -> None:
    """Seed torch's CPU RNG, numpy's global RNG and python's ``random`` from a 64-bit ``key``."""
    torch.default_generator.manual_seed(key >> 1)
    np.random.seed(key & 0xFFFFFFFF)
    random.seed(key)


class _NumpyGlobalState:
    """Save and restore numpy's legacy global RNG (MT19937 words, position, Gaussian cache) fast."""

    _SIZE = 624 * 4 + 4  # mt19937_state: uint32 key[624]; int pos

    def __init__(self) -> None:
        self._fast: bool | None = None  # decided on first use

    def _address(self) -> int:
        return int(np.random.mtrand.get_bit_generator().ctypes.state_address)

    def _check_layout(self) -> bool:
        """Whether the raw struct reads as ``get_state`` says (numpy internals could change)."""
        saved = np.random.get_state()
        try:
            np.random.seed(20240611)
            np.random.random_sample(7)
            words = np.frombuffer(ctypes.string_at(self._address(), self._SIZE), dtype=np.uint32)
            state = np.random.get_state(legacy=True)
            if not isinstance(state, tuple):  # a non-MT19937 global generator: use the slow path
                return False
            _, key, pos, *_ = state
            return bool(np.array_equal(words[:624], key)) and int(words[624]) == pos
        finally:
            np.random.set_state(saved)

    def save(self) -> Callable[[], None]:
        """Capture the state; returns the thunk that puts it back."""
        if self._fast is None:
            self._fast = self._check_layout()
        if not self._fast:
            state = np.random.get_state()
            return lambda: np.random.set_state(state)
        address = self._address()
        raw = ctypes.string_at(address, self._SIZE)
        # The Gaussian cache lives outside the struct. Drawing one normal tells it: a cached value
        # is returned without touching the words; otherwise the words move (and get put back).
        probe = float(np.random.standard_normal())
        if ctypes.string_at(address, self._SIZE) == raw:
            words = np.frombuffer(raw, dtype=np.uint32)
            cached = ("MT19937", words[:624].copy(), int(words[624]), 1, probe)
            return lambda: np.random.set_state(cached)

        def restore() -> None:
            np.random.seed(0)  # clears the Gaussian cache; the words are overwritten next
            ctypes.memmove(address, raw, self._SIZE)

        return restore


_NUMPY = _NumpyGlobalState()


def fork_global_rngs() -> Callable[[], None]:
    """Save torch's CPU, numpy's global and python's RNG; returns the thunk that restores them."""
    torch_state = torch.get_rng_state()
    python_state = random.getstate()
    restore_numpy = _NUMPY.save()

    def restore() -> None:
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        restore_numpy()

    return restore


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
        in_main_process = torch.utils.data.get_worker_info() is None
        restore = fork_global_rngs() if in_main_process else None
        try:
            if self.global_rng == "batch":
                seed_global_rngs(hash_ints(ticket.seed, ticket.epoch, ticket.position, _BATCH_SALT))
                return self._fetch(ticket)
            samples = []
            for index in ticket.indices:
                seed_global_rngs(hash_ints(ticket.seed, ticket.epoch, index, _SAMPLE_SALT))
                samples.append(self._one(ticket, index))
            return samples
        finally:
            if restore is not None:
                restore()

    def _one(self, ticket: Ticket, index: int) -> Any:
        return self.dataset[SampleKey(index, ticket.epoch, ticket.seed) if self.sample_keys else index]

    def _fetch(self, ticket: Ticket) -> list[Any]:
        if not self.sample_keys:
            getitems = getattr(self.dataset, "__getitems__", None)
            if getitems is not None:
                return getitems(ticket.indices)
        return [self._one(ticket, index) for index in ticket.indices]
