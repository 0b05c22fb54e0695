"""Reading schedules that end with a scope: a pass that reads only its first batch in this process.

A StreamLoader with workers makes a pass's first batch in the main process (the warm start) and
hands the slot to a worker, which reads on from there. The main process's pipeline reads nothing
more that pass, but a source that told a node-local cache its schedule (see
:mod:`.sharded.plans`) left that schedule live, its cursor never moving: the cache then kept the
schedule's first shards as needed now for the whole pass, and with the cache bounded below the
working set, shards that workers needed were read by ranged requests instead (issue 48: 16 shards
of 16-byte records, cache D/2, 2 workers: 4.6 D over three epochs in about half the runs).
:func:`withdrawn_after` withdraws every schedule sent inside it when it ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

__all__ = ["note_sent", "withdrawn_after"]

# The withdrawals owed by the innermost open scope of this thread (None: no scope open).
_OPEN: ContextVar[dict[object, Callable[[], None]] | None] = ContextVar("resumable_data_plan_scope", default=None)


@contextlib.contextmanager
def withdrawn_after() -> Iterator[None]:
    """Withdraw, on leaving, each schedule sent in this thread inside the block (see :func:`note_sent`)."""
    owed: dict[object, Callable[[], None]] = {}
    token = _OPEN.set(owed)
    try:
        yield
    finally:
        _OPEN.reset(token)
        for withdraw in owed.values():  # once each sender, in the order they first sent
            withdraw()


def note_sent(sender: object, withdraw: Callable[[], None]) -> None:
    """Called by whatever sends a schedule: ``withdraw()`` (the last one ``sender`` gave) runs when
    the open scope ends; with no scope open, nothing."""
    owed = _OPEN.get()
    if owed is not None:
        owed[sender] = withdraw
