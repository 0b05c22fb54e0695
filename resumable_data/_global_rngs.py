"""Seed, save and restore the three global RNGs (torch's CPU, numpy's legacy, python's ``random``), fast.

A ResumableDataLoader does this around every batch it fetches (see ``_fetch``), so the cost is per
batch and has to be small next to the batch itself: at 50 µs per sample a 32-sample batch takes
1.6 ms, and 2 % of that is 32 µs for everything. The public APIs are too slow for that budget once
the surrounding work has pushed them out of the CPU caches (measured 50–100 µs per batch for the
three; ``random.getstate()`` alone builds a 625-int tuple, numpy's ``get_state()`` copies its words
in a Python loop). So numpy's and python's Mersenne Twister states are copied as raw bytes:

- python: the ``_random.Random`` object behind ``random.random`` holds ``int index`` and
  ``uint32 state[624]`` right after the object header; ``gauss_next`` is a plain attribute.
- numpy: the global ``RandomState``'s bit generator exposes its ``mt19937_state`` (``uint32
  key[624]; int pos``) through ``ctypes.state_address``; the Gaussian cache (``int has_gauss;
  double gauss``) lives in the ``RandomState`` object, found by searching for a planted value.

Each layout is checked once per process against the public ``getstate``/``get_state`` (and a
python seed against ``random.seed``); if anything reads differently (another interpreter, another
numpy, a non-MT19937 global bit generator) that RNG takes the public, slow path. torch's state goes
through ``torch.get_rng_state``/``set_rng_state`` (its C++ object has no stable byte layout).
"""

from __future__ import annotations

import _random
import ctypes
import random
import struct
import sys
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["GLOBAL_RNGS", "Forked", "GlobalRngs"]

_MT_WORDS = 624
_PY_HEADER = object.__basicsize__  # the object header before a C object's own fields
_PY_STATE_BYTES = 4 + 4 * _MT_WORDS  # int index; uint32 state[624]
_NP_STATE_BYTES = 4 * _MT_WORDS + 4  # uint32 key[624]; int pos
_NP_GAUSS_BYTES = 16  # int has_gauss (padded to 8); double gauss
_PROBE_SEED = 20240611
_PROBE_GAUSS = 0.8097132618302045  # planted to find numpy's Gaussian cache; any distinctive double


def _python_fast_layout(instance: Any) -> bool:
    """Whether python's RNG state is ``(index, words)`` right after the header, and the C seed
    plus ``gauss_next = None`` is ``random.seed``."""
    if sys.implementation.name != "cpython" or type(instance) is not random.Random:
        return False
    saved = instance.getstate()
    try:
        instance.seed(_PROBE_SEED)
        instance.random()
        _, internal, _ = instance.getstate()
        raw = struct.unpack(f"{1 + _MT_WORDS}I", ctypes.string_at(id(instance) + _PY_HEADER, _PY_STATE_BYTES))
        if raw[0] != internal[-1] or list(raw[1:]) != list(internal[:-1]):
            return False
        instance.seed(_PROBE_SEED + 1)
        expected = instance.getstate()
        instance.gauss_next = 1.0  # type: ignore[attr-defined]  # typeshed lacks it
        _random.Random.seed(instance, _PROBE_SEED + 1)
        instance.gauss_next = None  # type: ignore[attr-defined]
        return instance.getstate() == expected
    finally:
        instance.setstate(saved)


def _numpy_gauss_offset(state: np.random.RandomState) -> int | None:
    """Offset of ``(has_gauss, gauss)`` in numpy's global RandomState object, or None if not found."""
    saved = state.get_state()
    try:
        if not isinstance(saved, tuple) or saved[0] != "MT19937":
            return None
        size = type(state).__basicsize__
        state.set_state(("MT19937", saved[1], saved[2], 1, _PROBE_GAUSS))
        gauss_at = ctypes.string_at(id(state), size).find(struct.pack("d", _PROBE_GAUSS))
        if gauss_at < 8:
            return None
        offset = gauss_at - 8
        if struct.unpack("i", ctypes.string_at(id(state) + offset, 4))[0] != 1:
            return None
        state.set_state(("MT19937", saved[1], saved[2], 0, 0.0))
        if struct.unpack("i", ctypes.string_at(id(state) + offset, 4))[0] != 0:
            return None
        return offset
    finally:
        state.set_state(saved)


def _numpy_words_readable(address: int, state: np.random.RandomState) -> bool:
    """Whether the bytes at ``address`` read as ``get_state``'s words and position."""
    saved = state.get_state()
    try:
        state.seed(_PROBE_SEED)
        state.random_sample(7)
        probed: Any = state.get_state()
        _, key, pos, *_ = probed
        words = np.frombuffer(ctypes.string_at(address, _NP_STATE_BYTES), dtype=np.uint32)
        return bool(np.array_equal(words[:_MT_WORDS], key)) and int(words[_MT_WORDS]) == pos
    finally:
        state.set_state(saved)


def _raw_view(address: int, size: int) -> memoryview:
    """A writable view of ``size`` bytes at ``address`` (empty for address 0)."""
    if not address:
        return memoryview(b"")
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class Forked(NamedTuple):
    """What :meth:`GlobalRngs.fork` saved. On the fast path python's and numpy's words are in the
    instance's buffers (``python``/``numpy`` None); otherwise their public states."""

    torch: torch.Tensor
    python_gauss: float | None
    python: Any  # None (in the buffers) or random.getstate()
    numpy: Any  # None (in the buffers) or numpy.random.get_state()


class GlobalRngs:
    """The process's three global RNGs: :meth:`seed` them from one key, or :meth:`fork` and :meth:`restore` them.

    One instance per process (``GLOBAL_RNGS``), built at import: the layouts are checked then (each
    check puts the RNG it probes back exactly), so a restore's first batch does not pay for them, and
    a spawned DataLoader worker checks for itself. Everything here runs once per batch, so it is
    written for few calls (bound methods looked up once) rather than for elegance.

    Args:
        fast: ``False`` takes the public APIs only (the reference the fast paths are tested against).
    """

    def __init__(self, *, fast: bool = True) -> None:
        self._python: Any = random.random.__self__  # type: ignore[attr-defined]  # the hidden random.Random
        self._numpy: np.random.RandomState = np.random.random_sample.__self__  # type: ignore[attr-defined]
        self._fast = fast
        # Raw addresses, 0 where the public path is taken.
        self._python_address = id(self._python) + _PY_HEADER if fast and _python_fast_layout(self._python) else 0
        self._python_c_seed = _random.Random.seed.__get__(self._python)  # random.seed minus gauss_next = None
        self._numpy_bit_generator: Any = None  # the bit generator the numpy views were checked for
        self._torch_seed = torch.default_generator.manual_seed
        self._torch_get_state = torch.default_generator.get_state
        self._torch_set_state = torch.default_generator.set_state
        # The live states as memoryviews (empty where the public path is taken), and buffers for
        # them: a memoryview slice assignment is a plain memcpy, several times cheaper per call
        # than ctypes.memmove.
        self._python_state = _raw_view(self._python_address, _PY_STATE_BYTES)
        self._numpy_state = self._numpy_gauss = memoryview(b"")  # set by _numpy_is_fast
        self._python_buffer = memoryview(bytearray(_PY_STATE_BYTES))
        self._numpy_buffer = memoryview(bytearray(_NP_STATE_BYTES))
        self._gauss_buffer = memoryview(bytearray(_NP_GAUSS_BYTES))
        self._buffers_in_use = False
        self._numpy_is_fast()

    @property
    def fast_paths(self) -> dict[str, bool]:
        """Which RNGs are copied as raw bytes in this process."""
        return {"python": self._python_address != 0, "numpy": self._numpy_is_fast()}

    def seed(self, key: int) -> None:
        """Seed torch's CPU RNG, numpy's global RNG and python's ``random`` from a 64-bit ``key``.

        The streams are those of ``torch.manual_seed(key >> 1)``, ``numpy.random.seed(key % 2**32)``
        and ``random.seed(key)``.
        """
        self._torch_seed(key >> 1)
        self._numpy.seed(key & 0xFFFFFFFF)
        if self._python_address:
            self._python_c_seed(key)
            self._python.gauss_next = None
        else:
            self._python.seed(key)

    def fork(self, key: int) -> Forked:
        """Save all three states, then :meth:`seed` them from ``key``; :meth:`restore` puts them back.

        The fast path copies into buffers kept by this instance (no allocation per batch); a fork
        inside a fork (a dataset that itself iterates a loader in the main process) takes the
        public path, so the outer fork's buffers are never overwritten.
        """
        python = self._python
        if (
            self._numpy_state
            and self._python_address
            and not self._buffers_in_use
            and np.random.mtrand.get_bit_generator() is self._numpy_bit_generator
        ):
            # The fast path, written out (it runs once per batch): save into the buffers, then seed.
            self._buffers_in_use = True
            self._python_buffer[:] = self._python_state
            self._numpy_buffer[:] = self._numpy_state
            self._gauss_buffer[:] = self._numpy_gauss
            forked = Forked(self._torch_get_state(), python.gauss_next, None, None)
            self._torch_seed(key >> 1)
            self._numpy.seed(key & 0xFFFFFFFF)
            self._python_c_seed(key)
            python.gauss_next = None
            return forked
        # The public path: not CPython, a fork inside a fork, or a new numpy bit generator
        # (numpy.random.set_bit_generator), which is checked here for the next fork.
        self._numpy_is_fast()
        forked = Forked(self._torch_get_state(), python.gauss_next, python.getstate(), self._numpy.get_state())
        self.seed(key)
        return forked

    def restore(self, forked: Forked) -> None:
        """Put back what :meth:`fork` saved."""
        self._torch_set_state(forked.torch)
        if forked.python is None:
            self._python_state[:] = self._python_buffer
            self._numpy_state[:] = self._numpy_buffer
            self._numpy_gauss[:] = self._gauss_buffer
            self._buffers_in_use = False
        else:
            self._python.setstate(forked.python)
            self._numpy.set_state(forked.numpy)
        self._python.gauss_next = forked.python_gauss

    def _numpy_is_fast(self) -> bool:
        """Whether numpy's global bit generator is copied raw; checks it when it is new."""
        if not self._fast:
            return False
        bit_generator = np.random.mtrand.get_bit_generator()
        if bit_generator is not self._numpy_bit_generator:  # first use, or numpy.random.set_bit_generator
            self._numpy_bit_generator = bit_generator
            self._numpy_state = self._numpy_gauss = memoryview(b"")
            offset = _numpy_gauss_offset(self._numpy)
            if offset is not None:
                address = int(bit_generator.ctypes.state_address)
                if _numpy_words_readable(address, self._numpy):
                    self._numpy_state = _raw_view(address, _NP_STATE_BYTES)
                    self._numpy_gauss = _raw_view(id(self._numpy) + offset, _NP_GAUSS_BYTES)
        return bool(self._numpy_state)


GLOBAL_RNGS = GlobalRngs()
