"""``flock`` locks on files that processes on one machine share: a lock is held through an open
file and released when that file is closed, also when its process dies, so a lock never outlives
its holder and a free lock says its holder is gone.

Locks are per open file, not per process: two threads that open the same path exclude each other
as two processes do.

Fork. A process forked while one of its threads holds a lock (a DataLoader worker started while a
background download holds the cache's accounting lock) inherits a copy of that open file, and the
lock lasts until every copy is closed: the child, which never closes its copy, would wait forever
for a lock that only it keeps. So every descriptor opened here is noted while it is open, and a
forked child closes its copies at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator

# Descriptors of lock files open in this process. The guard is held while one is opened and noted,
# or closed and forgotten (never while waiting for a lock), and across a fork, so that a child's
# set names every lock file descriptor it inherits.
_OPEN: set[int] = set()
_GUARD = threading.Lock()


def _close_inherited() -> None:
    """In a forked child: close the copies of the parent's lock file descriptors."""
    global _GUARD
    for fd in _OPEN:
        os.close(fd)
    _OPEN.clear()
    _GUARD = threading.Lock()  # the parent's, held across the fork, stays held in the child's copy


def _hold_guard() -> None:
    _GUARD.acquire()


def _release_guard() -> None:
    _GUARD.release()


_HOOKED: list[bool] = []  # whether the fork hooks are registered (on first use, not at import)


def _open(path: str, flags: int) -> int:
    if not _HOOKED:
        with _GUARD:
            if not _HOOKED:
                os.register_at_fork(before=_hold_guard, after_in_parent=_release_guard, after_in_child=_close_inherited)
                _HOOKED.append(True)
    with _GUARD:
        fd = os.open(path, flags, 0o644)
        _OPEN.add(fd)
    return fd


def _close(fd: int) -> None:
    with _GUARD:
        _OPEN.discard(fd)
        os.close(fd)


@contextlib.contextmanager
def flocked(path: str, operation: int) -> Iterator[int]:
    """Hold ``flock(operation)`` on ``path`` (created if absent) for the block; yields the descriptor."""
    fd = _open(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, operation)
        yield fd
    finally:
        _close(fd)


@contextlib.contextmanager
def try_exclusive(path: str) -> Iterator[bool | None]:
    """Try to lock ``path`` exclusively without waiting: yields True (held for the block), False (some
    open file holds a lock on it) or None (no such file)."""
    try:
        fd = _open(path, os.O_RDONLY)
    except FileNotFoundError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
        else:
            yield True
    finally:
        _close(fd)


def held(path: str) -> bool:
    """Whether some open file holds a lock on ``path`` (another process's, or another of ours)."""
    with try_exclusive(path) as taken:
        return taken is False


def remove(path: str) -> None:
    """Delete ``path`` if it is there (another process may have deleted it first)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
