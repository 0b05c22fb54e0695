"""A source state's pending records as an array: a layout change hands a slot thousands.

``ShardedIterable`` keeps the records that a stage above held at a layout change (a shuffle
buffer's, a shuffle window's not handed out yet) as ``"pending": [[shard index, offset], ...]`` in
its state. Inside, they are an ``(n, 2)`` int64 array, read-only (taking records replaces it with a
slice, so a parsed state and the live source can share one): a restore into another layout checks,
splits, deals and takes 10^4 of them with array operations, and builds the list of lists only when
a state dict is written. As lists, each of them is an object the garbage collector tracks, and a
restore that built several such lists set off a full collection (tens of milliseconds).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .base import Key

__all__ = [
    "NO_RECORDS",
    "as_records",
    "held_by",
    "int_rows",
    "keys_as_records",
    "listed_records",
    "parse_pending",
    "record_keys",
]


def as_records(array: np.ndarray) -> np.ndarray:
    """``array`` as an ``(n, 2)`` int64 array of ``[shard index, offset]`` rows, read-only."""
    records = np.ascontiguousarray(array, dtype=np.int64).reshape(-1, 2)
    records.flags.writeable = False
    return records


NO_RECORDS = as_records(np.empty((0, 2), dtype=np.int64))


def int_rows(rows: Sequence[Any], width: int) -> np.ndarray | None:
    """``rows`` as an ``(n, width)`` int64 array when each is a list or tuple of ``width`` plain ints
    that fit; else None (the caller goes row by row, to name what it refuses)."""
    if not rows:
        return np.empty((0, width), dtype=np.int64)
    if not set(map(type, rows)) <= {list, tuple} or set(map(len, rows)) != {width}:
        return None
    flat = list(itertools.chain.from_iterable(rows))
    if set(map(type, flat)) != {int}:
        return None
    try:
        return np.fromiter(flat, dtype=np.int64, count=len(flat)).reshape(-1, width)
    except OverflowError:
        return None


def parse_pending(raw: list[Any], num_shards: int, cursors: np.ndarray, no_cursor: int) -> np.ndarray | None:
    """``raw`` as records (:func:`as_records`) when every entry passes the per-entry checks of a
    source state (two plain ints, a shard below ``num_shards``, an offset read already: below the
    shard's cursor in ``cursors`` unless that is ``no_cursor``, no record twice); else None, and the
    caller's per-entry loop names the first entry to refuse (or accepts what only it accepts)."""
    entries = int_rows(raw, 2)
    if entries is None:
        return None
    index, offset = entries[:, 0], entries[:, 1]
    if not ((index >= 0) & (index < num_shards) & (offset >= 0)).all():
        return None
    cursor = cursors[index]
    if ((cursor != no_cursor) & (offset >= cursor)).any():
        return None
    ordered = entries[np.lexsort((offset, index))]
    if (ordered[1:] == ordered[:-1]).all(axis=1).any():
        return None
    return as_records(entries)


def record_keys(epoch: int, records: np.ndarray) -> list[Key]:
    """The keys ``(epoch, shard index, offset)`` of ``records`` (zip builds the tuples in C)."""
    return list(zip(itertools.repeat(epoch, len(records)), records[:, 0].tolist(), records[:, 1].tolist(), strict=True))


def held_by(identities: Mapping[int, str], records: np.ndarray) -> dict[int, str]:
    """The identities of the shards ``records`` lie in (those that have one)."""
    return {index: identities[index] for index in np.unique(records[:, 0]).tolist() if index in identities}


def keys_as_records(keys: Sequence[Key], epoch: int) -> np.ndarray | None:
    """The ``[shard index, offset]`` of ``keys`` when each is three plain ints ``(epoch, index,
    offset)`` of epoch ``epoch`` that fit in int64; else None (the caller checks key by key)."""
    array = int_rows(keys, 3)
    if array is None or not (array[:, 0] == epoch).all():
        return None
    return as_records(array[:, 1:])


def listed_records(entries: Iterable[Sequence[int]]) -> np.ndarray:
    """Records from ``[shard index, offset]`` entries already checked (ints)."""
    return as_records(np.array([[int(i), int(o)] for i, o in entries], dtype=np.int64).reshape(-1, 2))
