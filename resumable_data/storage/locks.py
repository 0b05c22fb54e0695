"""``flock`` locks on files that processes on one machine share: a lock is held through an open
file and released when that file is closed, also when its process dies, so a lock never outlives
its holder and a free lock says its holder is gone.

Locks are per open file, not per process: two threads that open the same path exclude each other
as two processes do. The process that took a lock releases it explicitly (``LOCK_UN``) before it
closes the file: a process forked while another thread held it has a copy of the descriptor, which
would otherwise keep it held as long as that process lives (and a child never releases its parent's).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


@contextlib.contextmanager
def flocked(path: str, operation: int) -> Iterator[int]:
    """Hold ``flock(operation)`` on ``path`` (created if absent) for the block; yields the descriptor."""
    fd, owner = os.open(path, os.O_RDWR | os.O_CREAT, 0o644), os.getpid()
    try:
        fcntl.flock(fd, operation)
        yield fd
    finally:
        unlock(fd, owner)


@contextlib.contextmanager
def try_exclusive(path: str) -> Iterator[bool | None]:
    """Try to lock ``path`` exclusively without waiting: yields True (held for the block), False (some
    open file holds a lock on it) or None (no such file)."""
    try:
        fd, owner = os.open(path, os.O_RDONLY), os.getpid()
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
        unlock(fd, owner)


def unlock(fd: int, owner: int) -> None:
    """Close ``fd``, first releasing its lock if this is the process ``owner`` that took it (see the
    module docstring for why)."""
    try:
        if os.getpid() == owner:
            fcntl.flock(fd, fcntl.LOCK_UN)
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
