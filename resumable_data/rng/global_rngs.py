"""Seed, save and restore the three global RNGs (torch's CPU, numpy's legacy, python's ``random``), fast.

A ResumableDataLoader does this around every batch it fetches (see ``map.fetch``), so the cost is per
batch and has to be small next to the batch itself: at 50 µs per sample a 32-sample batch takes
1.6 ms, and 2 % of that is 32 µs for everything. The public APIs are too slow for that budget once
the surrounding work has pushed them out of the CPU caches (measured 50–100 µs per batch for the
three; ``random.getstate()`` alone builds a 625-int tuple, numpy's ``get_state()`` copies its words
in a Python loop, torch's allocates a 5 KB tensor). So the three Mersenne Twister states are copied
as raw bytes, through memoryviews of their memory:

- python: the ``_random.Random`` object behind ``random.random`` holds ``int index`` and
  ``uint32 state[624]`` right after the object header; ``gauss_next`` is a plain attribute.
- numpy: the global ``RandomState``'s bit generator exposes its ``mt19937_state`` (``uint32
  key[624]; int pos``) through ``ctypes.state_address``; the Gaussian cache (``int has_gauss;
  double gauss``) lives in the ``RandomState`` object, found by searching for a planted value.
- torch: ``torch.default_generator`` points to a C++ ``CPUGeneratorImpl`` holding its
  ``mt19937`` (``uint64 seed; int left; bool seeded; uint32 next; uint32 state[624]``) and two
  normal-sample caches (``optional<float>``, ``optional<double>``); the engine is found by its
  header and words as ``get_state()`` reports them, the caches by planted values.

Seeding is the other half of the cost. A key seeds torch with ``torch.manual_seed(key >> 1)``,
numpy with ``numpy.random.seed(key % 2**32)``, and python's Twister the way numpy seeds its own,
from ``key >> 32`` (``random.seed`` would run its slower ``init_by_array``). numpy's and torch's
seedings fill the words by the same recurrence (``init_genrand``), so the fast path seeds a private
torch generator and copies its words into numpy's and python's states.

Each layout is checked once per process against the public ``getstate``/``get_state``, and the
fast seeding against the public one; if anything reads differently (another interpreter, another
numpy or torch build, a non-MT19937 global bit generator) the public, slow path is taken.
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["GLOBAL_RNGS", "Forked", "GlobalRngs"]

_MT_WORDS = 624
_WORDS_BYTES = 4 * _MT_WORDS
_SEEDED_POSITION = struct.pack("i", _MT_WORDS)  # a freshly seeded Twister's index: regenerate first
_PY_HEADER = object.__basicsize__  # the object header before a C object's own fields
_PY_STATE_BYTES = 4 + _WORDS_BYTES  # int index; uint32 state[624]
_NP_STATE_BYTES = _WORDS_BYTES + 4  # uint32 key[624]; int pos
_NP_GAUSS_BYTES = 16  # int has_gauss (padded to 8); double gauss
_NO_GAUSS = bytes(_NP_GAUSS_BYTES)  # numpy's cache after seeding: has_gauss = 0, gauss = 0.0
_TORCH_HEADER = struct.Struct("<QiiQ")  # get_state()'s: initial seed, left, seeded, next; then uint64 state[624]
_TORCH_WORDS_AT = 20  # uint64 seed; int left; bool seeded (+3 padding); uint32 next; then uint32 state[624]
_TORCH_ENGINE_BYTES = 2520  # the engine, padded to 8
_TORCH_BYTES = _TORCH_ENGINE_BYTES + 8 + 16  # then optional<float>, optional<double>
_TORCH_SCAN_BYTES = 512  # how far into the C++ object its engine is looked for
_PROBE_SEED = 20240611
_PROBE_GAUSS = 0.8097132618302045  # planted to find the Gaussian caches; any distinctive double
_PROBE_FLOAT = 0.6180339887498949  # planted in torch's float normal cache (as a float32)


def _python_address(instance: Any) -> int:
    """Address of python's ``(index, words)``, right after the object header; 0 if they read differently."""
    if sys.implementation.name != "cpython" or type(instance) is not random.Random:
        return 0
    saved = instance.getstate()
    try:
        instance.seed(_PROBE_SEED)
        instance.random()
        _, internal, _ = instance.getstate()
        address = id(instance) + _PY_HEADER
        raw = struct.unpack(f"{1 + _MT_WORDS}I", ctypes.string_at(address, _PY_STATE_BYTES))
        return address if raw[0] == internal[-1] and list(raw[1:]) == list(internal[:-1]) else 0
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


def _torch_address(generator: torch.Generator) -> int:
    """Address of the CPU generator's engine and normal caches (:data:`_TORCH_BYTES`), or 0.

    Found and checked against ``get_state()``: the engine by its header and words, the caches by
    planted values; then a raw save, draws and a raw restore must give back ``get_state()`` exactly.
    Reads stay inside the object: the header is looked for in its first bytes only.
    """
    if sys.implementation.name != "cpython" or generator.device.type != "cpu":
        return 0
    saved = generator.get_state()
    try:
        generator.manual_seed(_PROBE_SEED)
        torch.rand(7, generator=generator)
        legacy = generator.get_state().numpy().tobytes()
        seed, left, seeded, next_ = _TORCH_HEADER.unpack_from(legacy)
        words = np.frombuffer(legacy, np.uint64, _MT_WORDS, _TORCH_HEADER.size).astype(np.uint32).tobytes()
        impl = ctypes.c_void_p.from_address(id(generator) + _PY_HEADER).value or 0
        start = ctypes.string_at(impl, _TORCH_SCAN_BYTES).find(struct.pack("<Qi", seed, left)) if impl else -1
        if start < 0 or start % 8:
            return 0
        address = impl + start
        engine = ctypes.string_at(address, _TORCH_WORDS_AT + _WORDS_BYTES)  # the 3 bytes after "seeded": padding
        if (
            engine[12] != seeded
            or struct.unpack_from("<I", engine, 16)[0] != next_
            or engine[_TORCH_WORDS_AT:] != words
        ):
            return 0
        # Plant both normal caches through the public API and find them where the layout says.
        planted = bytearray(legacy)
        tail = len(legacy) - 40  # double normal_x, normal_y, normal_rho; int valid; float next; bool valid
        struct.pack_into("<dddi4xf?", planted, tail, 0.0, _PROBE_GAUSS, 1.0, 1, _PROBE_FLOAT, True)
        generator.set_state(torch.frombuffer(planted, dtype=torch.uint8))
        caches = ctypes.string_at(address + _TORCH_ENGINE_BYTES, _TORCH_BYTES - _TORCH_ENGINE_BYTES)
        if caches[:5] != struct.pack("<f?", _PROBE_FLOAT, True) or caches[8:17] != struct.pack(
            "<d?", _PROBE_GAUSS, True
        ):
            return 0
        # A raw save and restore around draws that move the engine and fill and empty the caches.
        before = generator.get_state()
        raw = ctypes.string_at(address, _TORCH_BYTES)
        torch.randn(1, generator=generator), torch.rand(1000, generator=generator)
        ctypes.memmove(address, raw, _TORCH_BYTES)
        return address if torch.equal(generator.get_state(), before) else 0
    finally:
        generator.set_state(saved)


def _raw_view(address: int, size: int) -> memoryview:
    """A writable view of ``size`` bytes at ``address`` (empty for address 0)."""
    if not address:
        return memoryview(b"")
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class Forked(NamedTuple):
    """What :meth:`GlobalRngs.fork` saved. On the fast path the states are in the instance's
    buffers (``torch``/``python``/``numpy`` None); otherwise their public states."""

    torch: torch.Tensor | None  # None (in the buffers) or torch.get_rng_state()
    python_gauss: float | None
    python: Any  # None (in the buffers) or random.getstate()
    numpy: Any  # None (in the buffers) or numpy.random.get_state()


class GlobalRngs:
    """The process's three global RNGs: :meth:`seed` them from one key, or :meth:`fork` and :meth:`restore` them.

    One instance per process (``GLOBAL_RNGS``), built at import: the layouts are checked then (each
    check puts the RNG it probes back exactly), so a restore's first batch does not pay for them, and
    a spawned DataLoader worker checks for itself. Everything here runs once per batch, so it is
    written for few calls (bound methods and memoryview slices made once) rather than for elegance.

    Args:
        fast: ``False`` takes the public APIs only (the reference the fast paths are tested against).
    """

    def __init__(self, *, fast: bool = True) -> None:
        self._python: Any = random.random.__self__  # type: ignore[attr-defined]  # the hidden random.Random
        self._numpy: np.random.RandomState = np.random.random_sample.__self__  # type: ignore[attr-defined]
        self._fast = fast
        self._torch_seed = torch.default_generator.manual_seed
        self._torch_get_state = torch.default_generator.get_state
        self._torch_set_state = torch.default_generator.set_state
        self._public_words = np.random.RandomState(0)  # python's words, on the public path
        # The live states as memoryviews (empty where unknown), and buffers a fork saves them in:
        # a memoryview slice assignment is a plain memcpy, several times cheaper than ctypes.memmove.
        self._python_state = _raw_view(_python_address(self._python) if fast else 0, _PY_STATE_BYTES)
        self._python_index, self._python_words = self._python_state[:4], self._python_state[4:]
        self._torch_state = _raw_view(_torch_address(torch.default_generator) if fast else 0, _TORCH_BYTES)
        words = torch.Generator()  # seeded to fill numpy's and python's words (init_genrand)
        self._words_seed = words.manual_seed
        self._words = _raw_view(_torch_address(words) if fast else 0, _TORCH_BYTES)[
            _TORCH_WORDS_AT : _TORCH_WORDS_AT + _WORDS_BYTES
        ]
        self._numpy_bit_generator: Any = None  # the bit generator the numpy views were checked for
        self._numpy_state = self._numpy_words = self._numpy_position = self._numpy_gauss = memoryview(b"")
        self._python_buffer = memoryview(bytearray(_PY_STATE_BYTES))
        self._numpy_buffer = memoryview(bytearray(_NP_STATE_BYTES))
        self._gauss_buffer = memoryview(bytearray(_NP_GAUSS_BYTES))
        self._torch_buffer = memoryview(bytearray(_TORCH_BYTES))
        self._buffers_in_use = False
        # The fast path needs every layout (numpy's is checked again per bit generator, in
        # _numpy_is_fast) and a fast seeding that gives the public one's states.
        layouts = bool(self._python_state and self._torch_state and self._words) and self._numpy_is_fast()
        self._raw = layouts and self._raw_seeding_matches()

    @property
    def raw(self) -> bool:
        """Whether :meth:`seed` and :meth:`fork` take the fast path (raw copies) in this process now."""
        return self._raw and self._numpy_is_fast()

    def seed(self, key: int) -> None:
        """Seed torch's CPU RNG, numpy's global RNG and python's ``random`` from a 64-bit ``key``.

        The streams are those of ``torch.manual_seed(key >> 1)``, ``numpy.random.seed(key % 2**32)``
        and ``random.setstate`` with the words ``numpy.random.seed(key >> 32)`` would give numpy.
        """
        if self._raw and self._numpy_is_fast():
            self._seed_raw(key)
        else:
            self._seed_public(key)

    def _seed_public(self, key: int) -> None:
        self._torch_seed(key >> 1)
        self._numpy.seed(key & 0xFFFFFFFF)
        self._public_words.seed(key >> 32)
        words: Any = self._public_words.get_state()
        self._python.setstate((3, (*words[1].tolist(), _MT_WORDS), None))

    def _seed_raw(self, key: int) -> None:
        self._torch_seed(key >> 1)
        self._words_seed(key & 0xFFFFFFFF)
        self._numpy_words[:] = self._words
        self._numpy_position[:] = _SEEDED_POSITION
        self._numpy_gauss[:] = _NO_GAUSS
        self._words_seed(key >> 32)
        self._python_words[:] = self._words
        self._python_index[:] = _SEEDED_POSITION
        self._python.gauss_next = None

    def fork(self, key: int) -> Forked:
        """Save all three states, then :meth:`seed` them from ``key``; :meth:`restore` puts them back.

        The fast path copies into buffers kept by this instance (no allocation per batch); a fork
        inside a fork (a dataset that itself iterates a loader in the main process) takes the
        public path, so the outer fork's buffers are never overwritten.
        """
        python = self._python
        if (
            self._raw
            and not self._buffers_in_use
            and np.random.mtrand.get_bit_generator() is self._numpy_bit_generator
            and self._numpy_state
        ):
            self._buffers_in_use = True
            self._torch_buffer[:] = self._torch_state
            self._python_buffer[:] = self._python_state
            self._numpy_buffer[:] = self._numpy_state
            self._gauss_buffer[:] = self._numpy_gauss
            forked = Forked(None, python.gauss_next, None, None)
            self._seed_raw(key)
            return forked
        # The public path: not CPython, a fork inside a fork, or a new numpy bit generator
        # (numpy.random.set_bit_generator), which seed() checks for the next fork.
        forked = Forked(self._torch_get_state(), python.gauss_next, python.getstate(), self._numpy.get_state())
        self.seed(key)
        return forked

    def restore(self, forked: Forked) -> None:
        """Put back what :meth:`fork` saved."""
        if forked.torch is None:
            self._torch_state[:] = self._torch_buffer
            self._python_state[:] = self._python_buffer
            self._numpy_state[:] = self._numpy_buffer
            self._numpy_gauss[:] = self._gauss_buffer
            self._buffers_in_use = False
        else:
            self._torch_set_state(forked.torch)
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
            self._numpy_state = self._numpy_words = self._numpy_position = self._numpy_gauss = memoryview(b"")
            offset = _numpy_gauss_offset(self._numpy)
            if offset is not None:
                address = int(bit_generator.ctypes.state_address)
                if _numpy_words_readable(address, self._numpy):
                    self._numpy_state = _raw_view(address, _NP_STATE_BYTES)
                    self._numpy_words, self._numpy_position = self._numpy_state[:-4], self._numpy_state[-4:]
                    self._numpy_gauss = _raw_view(id(self._numpy) + offset, _NP_GAUSS_BYTES)
        return bool(self._numpy_state)

    def _raw_seeding_matches(self) -> bool:
        """Whether the fast seeding gives the public seeding's states (with caches to clear)."""
        saved = self._torch_get_state(), self._python.getstate(), self._numpy.get_state()
        try:
            states = []
            for seed in (self._seed_raw, self._seed_public):
                torch.randn(1), self._python.gauss(0.0, 1.0), self._numpy.standard_normal()
                seed(_PROBE_SEED * 2**32 + _PROBE_SEED + 1)
                numpy: Any = self._numpy.get_state()
                states.append((self._torch_get_state(), self._python.getstate(), numpy[1], numpy[2:]))
            (torch_a, python_a, *numpy_a), (torch_b, python_b, *numpy_b) = states
            return bool(
                torch.equal(torch_a, torch_b)
                and python_a == python_b
                and np.array_equal(numpy_a[0], numpy_b[0])
                and numpy_a[1] == numpy_b[1]
            )
        finally:
            self._torch_set_state(saved[0])
            self._python.setstate(saved[1])
            self._numpy.set_state(saved[2])


GLOBAL_RNGS = GlobalRngs()
