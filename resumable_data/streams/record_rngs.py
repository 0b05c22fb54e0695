"""The global RNGs seeded per record: what makes a seedless ``map``/``filter`` below a re-reading stage exact.

A :class:`StreamLoader` seeds the global RNGs before each batch, so a function drawing from them
(``torch.rand``, ``numpy.random``, ``random``) draws what its position in the batch gives it. A
stage that reads records again (``pack``, ``shuffle_buffer``, ``batch_by_tokens``, ``shuffle_window``)
does so in a later batch after a restore, at another position: the record would be mapped under
other draws. Below such a stage, a seedless ``map`` (or ``filter``) therefore calls its function
with the global RNGs seeded from the record's key, as ``map(fn, seed=...)`` seeds its generator,
and puts them back afterwards, so that the draws of stages above it (a map after the shuffle) stay
those of the batch. A function that draws nothing from them (a tokenizer) is built with
``global_rng=None``, the user's promise, and skips that cost (``benchmarks/bench_record_rngs.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.hash import hash_ints, hash_more
from ..errors import ResumeError
from ..rng.global_rngs import GLOBAL_RNGS
from .base import Key

__all__ = ["RECORD", "check_record_rng", "per_record_salt", "seeded_call"]

RECORD = "record"  # global_rng= of map/filter: the global RNGs seeded per record where a stage re-reads


def check_record_rng(what: str, global_rng: Any) -> str | None:
    """Validate the ``global_rng`` argument of ``map``/``filter`` (named like the loaders' own)."""
    if global_rng not in (RECORD, None):
        raise ResumeError(
            f"{what}(global_rng=...) should be {RECORD!r} or None (the function draws nothing from the global "
            f"RNGs), but got global_rng={global_rng!r}"
        )
    return global_rng


_SALT = 0x7265636F7264  # "record": these keys must not coincide with the loader's per-batch keys


def per_record_salt(depth: int, branch: tuple[int, ...] = ()) -> int:
    """The prefix of a stage's per-record keys: its depth and its ``mix`` branch tell two stages apart."""
    return hash_ints(_SALT, depth, *branch)


def seeded_call(salt: int, key: Key, fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn(value)`` with the three global RNGs seeded from ``key`` (and put back afterwards)."""
    with GLOBAL_RNGS.seeded(hash_more(salt, *key), restore=True):
        return fn(value)
