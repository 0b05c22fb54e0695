"""Key checks: refuse a record key (buffered, pending, held by a stage above) that a state has not read.

What a state has read is its epoch, an array of cursors by shard index (``NO_CURSOR`` for the shards
it does not read any more, or has not started) and its pending records. A record of a shard still
being read lies before that shard's cursor; whether a finished shard has it only a read can tell.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ...core.state import brief
from ...errors import ResumeError
from ..base import MAX_COUNT, Key, PlainKeys
from ..pending import int_rows
from .keys import WHAT
from .layout import NO_CURSOR

__all__ = ["Reads", "check_record", "key_check", "keys_check"]


class Reads(NamedTuple):
    """What a state has read: its epoch (None: no state), cursors by shard index, pending records."""

    epoch: int | None
    cursors: np.ndarray
    pending: set[tuple[int, int]]


def key_check(reads: Reads) -> Callable[[Key], None]:
    """A check of one record key against ``reads``, raising a ResumeError that names the key."""
    epoch, cursors, pending = reads

    def check(key: Key) -> None:
        if len(key) != 3:
            raise ResumeError(f"{WHAT}: a record key is [epoch, shard index, offset], but got {brief(list(key))}")
        key_epoch, index, offset = key
        if epoch is not None and key_epoch != epoch:
            raise ResumeError(
                f"{WHAT}: record key {brief(list(key))} is from epoch {brief(key_epoch)}, but the state is in "
                f"epoch {epoch}; pass a state_dict() of this pipeline unchanged"
            )
        check_record(index, offset, cursors, lambda: f"record key {brief(list(key))}")
        if (index, offset) in pending:
            raise ResumeError(
                f"{WHAT}: record key {brief(list(key))} is also a pending record, so it would be read twice"
            )

    return check


def keys_check(reads: Reads) -> Callable[[Sequence[Key]], None]:
    """A check of many keys at once: a few vector comparisons, and :func:`key_check` to name a bad one."""
    check = key_check(reads)
    epoch, cursors, pending = reads
    cursor_of = np.where(cursors == NO_CURSOR, np.iinfo(np.int64).max, cursors)  # no cursor: any offset

    def check_all(keys: Sequence[Key]) -> None:
        # The keys as one array, checked with a few vector comparisons; anything unusual (a key of
        # another shape or type, an int beyond int64, a refusal) goes key by key through ``check``,
        # which decides and names the first bad key.
        array = _as_array(keys)
        if array is None or not _plausible(array, epoch, cursor_of, pending):
            for key in keys:
                check(key)

    return check_all


def _as_array(keys: Sequence[Key]) -> np.ndarray | None:
    """``keys`` as an ``(n, 3)`` int64 array, or None unless every key is three plain ints that fit."""
    if isinstance(keys, PlainKeys) and keys.width == 3:  # the types checked by the stage that parsed them
        flat = itertools.chain.from_iterable(keys)
        try:
            return np.fromiter(flat, dtype=np.int64, count=3 * len(keys)).reshape(-1, 3)
        except OverflowError:
            return None
    return int_rows(keys, 3)


def _plausible(keys: np.ndarray, epoch: int | None, cursor_of: np.ndarray, pending: set[tuple[int, int]]) -> bool:
    """Whether every ``[epoch, shard, offset]`` row of ``keys`` passes the checks of :func:`key_check`."""
    if not len(keys):
        return True
    epochs, index, offset = keys[:, 0], keys[:, 1], keys[:, 2]
    if epoch is not None and not (epochs == epoch).all():
        return False
    if not ((index >= 0) & (index < len(cursor_of)) & (offset >= 0)).all():
        return False
    if not (offset < cursor_of[index]).all():
        return False
    return not pending or pending.isdisjoint(zip(index.tolist(), offset.tolist(), strict=True))


def check_record(index: int, offset: int, cursors: np.ndarray, what: Callable[[], str], n: int | None = None) -> None:
    """Refuse a record (already read: buffered or pending) that cannot exist or was not read yet;
    ``cursors`` is a cursor by shard index, and ``n`` the shards a record may name (all of them).

    ``what`` names the record for the message; it is called only on a refusal, because a restore
    checks a whole shuffle buffer of keys and formatting each one would cost more than the check.
    """
    n = len(cursors) if n is None else n
    if not 0 <= index < n:
        raise ResumeError(f"{WHAT} state: {what()} names shard {brief(index)}, but there are {n} shards (0..{n - 1})")
    if not 0 <= offset <= MAX_COUNT:
        raise ResumeError(f"{WHAT} state: {what()} has an offset {brief(offset)} outside [0, 2**63) in shard {index}")
    whole = int(index)  # a key may hold any number equal to a shard index (1.0, True), as a dict lookup took it
    cursor = int(cursors[whole]) if whole == index else NO_CURSOR
    if cursor != NO_CURSOR and offset >= cursor:
        raise ResumeError(
            f"{WHAT} state: {what()} is at offset {brief(offset)} of shard {index}, which is read only up to its "
            f"cursor {cursor}: that record was not read yet; pass a state_dict() of this pipeline unchanged"
        )
