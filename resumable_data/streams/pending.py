"""A source state's pending records checked in bulk: a layout change hands a slot thousands.

``ShardedIterable`` keeps the records that a stage above held at a layout change (a shuffle
buffer's, a shuffle window's not handed out yet) as ``"pending": [[shard index, offset], ...]``. A
restore parses a slot's state several times (its check, the slots it was saved for, the state at
an open window's start), so a per-entry loop over 10^4 of them cost tens of milliseconds each time;
the same checks over arrays cost a fraction of one.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

__all__ = ["parse_pending"]


def parse_pending(raw: list[Any], num_shards: int, cursors: np.ndarray, no_cursor: int) -> list[list[int]] | None:
    """``raw`` as ``[[shard index, offset], ...]`` when every entry passes the per-entry checks of a
    source state (two plain ints, a shard below ``num_shards``, an offset read already: below the
    shard's cursor in ``cursors`` unless that is ``no_cursor``, no record twice); else None, and the
    caller's per-entry loop names the first entry to refuse (or accepts what only it accepts)."""
    if not raw:
        return []
    if not set(map(type, raw)) <= {list, tuple} or set(map(len, raw)) != {2}:
        return None
    flat = list(itertools.chain.from_iterable(raw))
    if set(map(type, flat)) != {int}:
        return None
    try:
        entries = np.fromiter(flat, dtype=np.int64, count=len(flat)).reshape(-1, 2)
    except OverflowError:
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
    pending: list[list[int]] = entries.tolist()
    return pending
