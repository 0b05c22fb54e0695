"""Counter-based 64-bit hashing: the one source of randomness behind orders and per-sample RNGs.

SplitMix64's finalizer is a bijective mixer with full avalanche; chaining it over the inputs gives
keys that are pure functions of their arguments, stable across numpy/torch releases and platforms.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


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
