"""``flock`` locks on files that processes on one machine share: a lock is held through an open
file and released when that file is closed, also when its process dies, so a lock never outlives
its holder and a free lock says its holder is gone.

Locks are per open file, not per process: two threads that open the same path exclude each other
as two processes do.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


@contextlib.contextmanager
def flocked(path: str, operation: int) -> Iterator[int]:
    """Hold ``flock(operation)`` on ``path`` (created if absent) for the block; yields the descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, operation)
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def try_exclusive(path: str) -> Iterator[bool | None]:
    """Try to lock ``path`` exclusively without waiting: yields True (held for the block), False (some
    open file holds a lock on it) or None (no such file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
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
        os.close(fd)


def held(path: str) -> bool:
    """Whether some open file holds a lock on ``path`` (another process's, or another of ours)."""
    with try_exclusive(path) as taken:
        return taken is False


def remove(path: str) -> None:
    """Delete ``path`` if it is there (another process may have deleted it first)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
