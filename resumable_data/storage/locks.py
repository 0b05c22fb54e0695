"""``flock`` locks on files that processes on one machine share: a lock is held through an open
file and released when that file is closed, also when its process dies, so a lock never outlives
its holder and a free lock says its holder is gone.

Locks are per open file, not per process: two threads that open the same path exclude each other
as two processes do.

Fork. A child forked while another thread holds a lock (a cache's background download, when a
DataLoader starts its workers) inherits that open file, and with it the lock, which would then
stay held for the child's life although no thread of the child holds it: every process waiting
for it would wait forever. So the child closes its copies of the files other threads hold locks
through (the parent's thread closes its own), and of the shards in use (:func:`open_shared`): it
holds them for the parent, which may release them at any time. And the process that took a lock
releases it explicitly (``LOCK_UN``, :func:`unlock`) before closing the file, so that no copy keeps
it: not one the forking thread's own child holds, nor one a child has not closed yet.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import weakref
from collections.abc import Iterator
from typing import BinaryIO

_OPEN: dict[int, int] = {}  # descriptor -> the thread holding (or taking) a lock through it
_GUARD = threading.Lock()  # held while a descriptor opens or closes, and across a fork
_SHARED: weakref.WeakKeyDictionary[BinaryIO, int] = weakref.WeakKeyDictionary()  # open_shared() file -> pid
_WATCHING = False  # whether the fork hooks are registered


def _close_inherited() -> None:
    """In a forked child: close the descriptors of locks that threads of the parent held (see above)."""
    forking = threading.get_ident()
    for fd, thread in list(_OPEN.items()):
        if thread != forking:
            del _OPEN[fd]
            os.close(fd)
    for file in list(_SHARED):
        file.close()
        _SHARED.pop(file, None)
    _GUARD.release()


def _watch_forks() -> None:
    """Register the fork hooks, once, at the first lock (under ``_GUARD``): importing registers nothing."""
    global _WATCHING
    if not _WATCHING:
        os.register_at_fork(before=_GUARD.acquire, after_in_parent=_GUARD.release, after_in_child=_close_inherited)
        _WATCHING = True


@contextlib.contextmanager
def _lock_file(path: str, flags: int) -> Iterator[int]:
    """``os.open(path, flags)`` for the block, noted as this thread's, so that a fork can tell."""
    with _GUARD:
        _watch_forks()
        fd, owner = os.open(path, flags, 0o644), os.getpid()
        _OPEN[fd] = threading.get_ident()
    try:
        yield fd
    finally:
        with _GUARD:
            del _OPEN[fd]
            unlock(fd, owner)


def unlock(fd: int, owner: int) -> None:
    """Close ``fd``, first releasing its lock (``LOCK_UN``) if this is the process ``owner`` that took it:
    a process forked meanwhile has a copy of the descriptor, and closing ours alone would leave the
    lock held by that copy for the child's life (a child never releases its parent's lock)."""
    try:
        if os.getpid() == owner:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def release(file: BinaryIO) -> None:
    """Close a file of :func:`open_shared`, releasing its lock first in the process that took it."""
    if not file.closed:
        unlock(os.dup(file.fileno()), _SHARED.pop(file, -1))
    file.close()


def open_shared(path: str) -> BinaryIO:
    """``open(path, "rb")`` with a shared lock on it until the file is closed (in this process only:
    a forked child closes its copy)."""
    with _GUARD:
        _watch_forks()
        file = open(path, "rb")  # noqa: SIM115 -- the caller releases it (release())
        _SHARED[file] = os.getpid()
    fcntl.flock(file.fileno(), fcntl.LOCK_SH)
    return file


@contextlib.contextmanager
def flocked(path: str, operation: int) -> Iterator[int]:
    """Hold ``flock(operation)`` on ``path`` (created if absent) for the block; yields the descriptor."""
    with _lock_file(path, os.O_RDWR | os.O_CREAT) as fd:
        fcntl.flock(fd, operation)
        yield fd


@contextlib.contextmanager
def try_exclusive(path: str) -> Iterator[bool | None]:
    """Try to lock ``path`` exclusively without waiting: yields True (held for the block), False (some
    open file holds a lock on it) or None (no such file)."""
    with contextlib.ExitStack() as stack:
        try:
            fd = stack.enter_context(_lock_file(path, os.O_RDONLY))
        except FileNotFoundError:
            yield None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
        else:
            yield True


def held(path: str) -> bool:
    """Whether some open file holds a lock on ``path`` (another process's, or another of ours)."""
    with try_exclusive(path) as taken:
        return taken is False


def remove(path: str) -> None:
    """Delete ``path`` if it is there (another process may have deleted it first)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
