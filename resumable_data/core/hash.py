"""Counter-based 64-bit hashing: the one source of randomness behind orders and per-sample RNGs.

SplitMix64's finalizer is a bijective mixer with full avalanche; chaining it over the inputs gives
keys that are pure functions of their arguments, stable across numpy/torch releases and platforms.
"""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_GOLDEN_U64, _M1_U64, _M2_U64 = np.uint64(_GOLDEN), np.uint64(_M1), np.uint64(_M2)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def hash_ints(*values: int) -> int:
    """A 64-bit key that is a pure function of a sequence of (possibly negative) ints."""
    return hash_more(0x6A09E667F3BCC909, *values)


def hash_more(h: int, *values: int) -> int:
    """``hash_ints(*prefix, *values)`` given ``h = hash_ints(*prefix)``: many keys sharing a prefix
    cost one mixing step per extra value instead of re-hashing the prefix each time."""
    for v in values:  # SplitMix64's finalizer on h ^ (v + golden), inlined: it runs once per batch
        x = h ^ ((v + _GOLDEN) & _MASK64)
        x = ((x ^ (x >> 30)) * _M1) & _MASK64
        x = ((x ^ (x >> 27)) * _M2) & _MASK64
        h = x ^ (x >> 31)
    return h


def hash_more_array(h: int, values: np.ndarray, *tail: int) -> np.ndarray:
    """``hash_more(h, v, *tail)`` for every non-negative ``v`` in ``values``, as a uint64 array:
    the same steps in numpy's wrapping uint64 arithmetic, for keys needed in bulk."""
    x = np.full(len(values), h, dtype=np.uint64)
    x ^= values.astype(np.uint64) + _GOLDEN_U64
    _finalize(x)
    for v in tail:
        x ^= np.uint64((v + _GOLDEN) & _MASK64)
        _finalize(x)
    return x


def _finalize(x: np.ndarray) -> None:
    """SplitMix64's finalizer, in place."""
    x ^= x >> _S30
    x *= _M1_U64
    x ^= x >> _S27
    x *= _M2_U64
    x ^= x >> _S31


def draw_hash_array(seed: int, epoch: int, start: int, stop: int) -> np.ndarray:
    """``hash_ints(seed, epoch, d)`` for draws ``d`` in ``[start, stop)`` (non-negative), as uint64.

    The draws are counted in uint64: a state may hold any int64 count, and the draws after one
    near ``2**63 - 1`` lie beyond int64 (``hash_ints`` takes them as they are)."""
    return hash_more_array(hash_ints(seed, epoch), np.arange(start, max(start, stop), dtype=np.uint64))


DRAW_CHUNK = 256  # draws whose hashes are computed together: a few batches' worth


class DrawHashes:
    """``hash_ints(seed, epoch, d)`` of draw ``d``, from a chunk of draws hashed together in numpy:
    per draw a list lookup instead of a chain of Python-int mixing. A stage drawing once per record
    (a shuffle buffer's slot, a mix's source) keeps one; the values are the same numbers."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._epoch, self._first, self._hashes = -1, 0, list[int]()

    def between(self, epoch: int, start: int, stop: int) -> list[int]:
        """The hashes of draws ``start`` to ``stop - 1`` of ``epoch``."""
        first, hashes = self._first, self._hashes
        if epoch != self._epoch or start < first or stop > first + len(hashes):
            first, hashes = start, draw_hash_array(self.seed, epoch, start, max(stop, start + DRAW_CHUNK)).tolist()
            self._epoch, self._first, self._hashes = epoch, first, hashes
        return hashes[start - first : stop - first]

    def at(self, epoch: int, draw: int) -> int:
        """The hash of draw ``draw`` of ``epoch``."""
        if epoch != self._epoch or not 0 <= draw - self._first < len(self._hashes):
            self.between(epoch, draw, draw + 1)
        return self._hashes[draw - self._first]
