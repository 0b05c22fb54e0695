"""Seed the three global RNGs (torch's CPU, numpy's legacy, python's ``random``) for a fetch, and put them back.

A ResumableDataLoader (and a StreamLoader) does this around every batch it fetches, so the cost is per
batch and has to be small next to the batch itself. Only public APIs are used:

- torch: ``torch.default_generator.manual_seed`` / ``get_state`` / ``set_state``;
- python: ``random.seed`` / ``getstate`` / ``setstate`` (the hidden ``random.Random`` behind the
  module functions, its Gaussian cache included);
- numpy: in the main process the global ``RandomState`` is never seeded or written in place (a
  worker's is seeded in place, like its torch and python RNGs). For the fetch it is handed
  a scratch bit generator of the same type as the user's (``numpy.random.set_bit_generator``),
  seeded from the key, and the user's own bit generator is handed back afterwards, untouched. Reading
  and writing numpy's Mersenne Twister state through ``get_state``/``set_state`` would cost more than
  the whole per-batch budget (its 624 words are copied one by one); swapping the generator
  object is a single call whatever its type. The one thing a swap does not keep is the legacy
  RandomState's cached second Gaussian (``set_bit_generator`` clears it, and only ``get_state``
  reads it): a main process that draws an odd number of ``numpy.random`` normals between two batches
  of a 0-worker loader gets a fresh pair instead of the cached one. That is deterministic (a resume
  reproduces it) but differs from a run with workers; ``tests/rng/test_global_rngs.py`` pins it.

What a key seeds (the streams are part of the product, pinned by tests):

- torch: ``torch.default_generator.manual_seed(key >> 1)``;
- numpy, MT19937 (the default): the stream of ``numpy.random.seed(key % 2**32)``;
  PCG64/PCG64DXSM, Philox, SFC64: a state built from SplitMix64 hashes of the key (``_NUMPY_STATES``);
  any other bit generator type: ``type(bg)(numpy.random.SeedSequence(key))``;
- python: ``random.seed(key)``.

Threads: a fork holds a process-wide ``threading.RLock`` until its restore, so two 0-worker loaders
in two threads fetch one at a time, each from its own seeded state, and each restore puts back what
its own fork saved (nothing is kept on the instance between the two). The lock is re-entrant (a
dataset that itself iterates a 0-worker loader forks inside a fork) and is replaced in a forked
child (``os.register_at_fork``, registered at first use, never at import), so a DataLoader worker
forked while another thread held it does not inherit it held.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from numpy.random.mtrand import get_bit_generator, set_bit_generator  # numpy.random's, as numpy's stubs export them

from ..core.hash import hash_more

__all__ = ["GLOBAL_RNGS", "GlobalRngs"]

_MASK32 = 0xFFFFFFFF
# Salts of the words of a non-MT19937 numpy state: hash_more(key, salt + i) is its i-th 64-bit word.
_NUMPY_SALT = 0x6E756D7079  # "numpy"


def _words(key: int, count: int) -> list[int]:
    """``count`` 64-bit words derived from ``key`` (SplitMix64 hashes)."""
    return [hash_more(key, _NUMPY_SALT + i) for i in range(count)]


def _pcg64_state(key: int) -> dict[str, Any]:
    a, b, c, d = _words(key, 4)
    # PCG's increment must be odd; any 128-bit state is valid.
    return {"state": {"state": (a << 64) | b, "inc": (c << 64) | d | 1}, "has_uint32": 0, "uinteger": 0}


def _philox_state(key: int) -> dict[str, Any]:
    k0, k1 = _words(key, 2)
    return {
        "state": {"counter": np.zeros(4, dtype=np.uint64), "key": np.array([k0, k1], dtype=np.uint64)},
        "buffer": np.zeros(4, dtype=np.uint64),
        "buffer_pos": 4,  # empty: the first draw computes a block
        "has_uint32": 0,
        "uinteger": 0,
    }


def _sfc64_state(key: int) -> dict[str, Any]:
    # SFC64's own seeding puts three words in a, b, c and starts its counter at 1.
    return {"state": {"state": np.array([*_words(key, 3), 1], dtype=np.uint64)}, "has_uint32": 0, "uinteger": 0}


# Bit generators whose state is built from the key directly (a few microseconds) rather than
# through a SeedSequence (20-30 microseconds): the public ``state`` dict layout of each.
_NUMPY_STATES: dict[type, Callable[[int], dict[str, Any]]] = {
    np.random.PCG64: _pcg64_state,
    np.random.PCG64DXSM: _pcg64_state,
    np.random.Philox: _philox_state,
    np.random.SFC64: _sfc64_state,
}


class GlobalRngs:
    """The process's three global RNGs: seeded from one key for a fetch, then put back.

    One instance per process (``GLOBAL_RNGS``); it does nothing until first used. Use
    :meth:`seeded` around a fetch::

        with GLOBAL_RNGS.seeded(key, restore=get_worker_info() is None) as rngs:
            samples = fetch()  # draws from the seeded global RNGs
            rngs.seed(other_key)  # re-seed inside the same fetch (one key per sample)
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._at_fork_registered = False
        # Scratch numpy bit generators, one per type and nesting depth: a fork inside a fork must
        # not re-seed the one the outer fetch is drawing from.
        self._scratch: dict[tuple[type, int], np.random.BitGenerator] = {}
        self._depth = 0  # forks open in this process (only changed under the lock)

    def seeded(self, key: int, *, restore: bool) -> _Seeded:
        """Seed all three RNGs from ``key`` for a ``with`` block (which yields this object).

        Args:
            key: a 64-bit int; the same key gives the same draws in every process.
            restore: put the three back afterwards (the main process, where the training loop
                draws from the same RNGs): numpy's global RandomState draws from a scratch bit
                generator for the block and gets the user's back, untouched. Without it (a worker,
                whose RNGs are re-seeded per iterator anyway) all three are seeded in place and
                left so; the draws are the same either way.
        """
        if not self._at_fork_registered:
            self._register_at_fork()
        return _Seeded(self, key, restore)

    def seed(self, key: int) -> None:
        """Seed the three RNGs from ``key`` (numpy's current global bit generator: inside a restoring
        :meth:`seeded`, the scratch one)."""
        self._seed(key, type(get_bit_generator()))

    def _seed(self, key: int, kind: type) -> None:
        """:meth:`seed`, with numpy's global bit generator known to be of type ``kind`` (a fork
        knows it: asking numpy again is one more call per batch)."""
        torch.default_generator.manual_seed(key >> 1)
        random.seed(key)
        if kind is np.random.MT19937:
            np.random.seed(key & _MASK32)  # also clears the legacy Gaussian cache
            return
        make = _NUMPY_STATES.get(kind)
        state = make(key) if make is not None else kind(np.random.SeedSequence(key)).state
        # Through the RandomState, so that its Gaussian cache is cleared as a seeding clears it.
        np.random.set_state({"bit_generator": kind.__name__, **state, "has_gauss": 0, "gauss": 0.0})

    def _scratch_for(self, kind: type, depth: int) -> np.random.BitGenerator:
        scratch = self._scratch.get((kind, depth))
        if scratch is None:
            # Built once per type, depth and process; seed() sets its whole state before every use.
            scratch = self._scratch[kind, depth] = kind(np.random.SeedSequence(0))
        return scratch

    def _register_at_fork(self) -> None:
        with self._lock:
            if not self._at_fork_registered:
                self._at_fork_registered = True
                os.register_at_fork(after_in_child=self._reset_lock)

    def _reset_lock(self) -> None:
        # The child has one thread: a lock another thread of the parent held is not held here.
        self._lock = threading.RLock()
        self._depth = 0


class _Seeded:
    """The ``with`` block of :meth:`GlobalRngs.seeded`: a plain class rather than a generator-based
    context manager, which would add its own overhead to every batch."""

    __slots__ = ("_key", "_numpy", "_python", "_restore", "_rngs", "_torch")

    def __init__(self, rngs: GlobalRngs, key: int, restore: bool) -> None:
        self._rngs, self._key, self._restore = rngs, key, restore

    def __enter__(self) -> GlobalRngs:
        rngs = self._rngs
        rngs._lock.acquire()
        try:
            self._numpy = saved = get_bit_generator()
            kind = type(saved)
            if self._restore:
                self._torch = torch.default_generator.get_state()
                self._python = random.getstate()
                set_bit_generator(rngs._scratch_for(kind, rngs._depth))
                rngs._depth += 1
        except BaseException:
            rngs._lock.release()
            raise
        try:
            rngs._seed(self._key, kind)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return rngs

    def __exit__(self, *exc: object) -> None:
        rngs = self._rngs
        try:
            if self._restore:
                rngs._depth -= 1
                set_bit_generator(self._numpy)
                torch.default_generator.set_state(self._torch)
                random.setstate(self._python)
        finally:
            rngs._lock.release()


GLOBAL_RNGS = GlobalRngs()
