"""The run-folder lock: one writer per folder, held by the process that took it and by no other.

The lock is a ``flock`` on ``DIRECTORY/.lock``. The kernel drops it when the last descriptor of that
open file goes away, so a crashed or SIGKILLed holder never leaves a stale lock: there is no pid to
check, no timeout to guess, no takeover race. What could keep it alive is a *child*: a forked process
inherits the descriptor, and DataLoader workers (forked, and only noticing their parent's death a few
seconds later) then held the lock of a dead trainer, so a relaunch at once was refused. Two measures
make sure no child keeps it:

- the descriptor is opened ``O_CLOEXEC``: a child that execs (subprocess, spawn, forkserver) drops it;
- an ``os.register_at_fork(after_in_child=...)`` hook (registered when the first lock is taken)
  closes it in every child forked from Python (multiprocessing's fork start method, DataLoader
  workers). Closing a duplicate never unlocks: the
  flock stays with the parent's descriptor, and dies with it.

A child forked by C code that bypasses Python's fork hooks would still inherit it; nothing in PyTorch
or the standard library does that. A Python child holds the duplicate only from ``fork()`` until the
hook runs, its first step before any of its own code: a holder SIGKILLed in that instant and a
relaunch within it are refused once, and the lock is free a moment later. POSIX record locks (``lockf``) are not inherited by children, but
they are released when *any* descriptor of the file is closed in the holder, so a second manager on the
same folder in the same process would silently unlock the first; ``flock`` has no such trap.

The file's content (pid, host, start time) only lets the error say who holds the lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from ..errors import ResumeError

__all__ = ["LOCK_NAME", "CheckpointLockedError", "RunLock"]

LOCK_NAME = ".lock"
_HOLDER_BYTES = 4096
# Holder record keys, declared once.
PID = "pid"
HOST = "host"
SINCE = "since"


class CheckpointLockedError(ResumeError):
    """Another live process (or another manager in this process) owns the run folder."""


class RunLock:
    """An exclusive, non-blocking lock on a folder, released on :meth:`release` or when this process dies.

    Args:
        directory: The folder to lock; ``directory/.lock`` is created if missing.

    Raises:
        CheckpointLockedError: Another open lock (this process or another) holds the folder.
        OSError: The lock file cannot be created or locked for another reason.

    Example::

        lock = RunLock(Path("runs/exp1"))
        try:
            ...  # write checkpoints
        finally:
            lock.release()
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointLockedError(
                    f"checkpoint folder {directory} is locked by pid {holder.get(PID, '?')} on host "
                    f"{holder.get(HOST, '?')} (lock file {self.path}); stop that job, close its "
                    f"CheckpointManager or DcpStore, or use another folder"
                ) from e
            raise
        self._fd: int | None = fd
        _hold(self)
        record = {PID: os.getpid(), HOST: socket.gethostname(), SINCE: time.time()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        except OSError:  # e.g. a full disk: the flock is what locks; the record only names the holder
            pass

    @property
    def held(self) -> bool:
        """Whether this object holds the lock (False after release, and in a forked child)."""
        return self._fd is not None

    def release(self) -> None:
        """Unlock and close. Safe to call twice; a no-op in a forked child, which never held it."""
        fd, self._fd = self._fd, None
        _HELD.discard(self)
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @staticmethod
    def _forget_all_in_child() -> None:
        """``os.register_at_fork`` hook: every lock held in the parent is forgotten in the child."""
        for lock in list(_HELD):
            lock._forget_in_child()  # a RunLock calling its own class's private method
        _HELD.clear()

    def _forget_in_child(self) -> None:
        """In a freshly forked child: close the inherited duplicate *without* unlocking (that would
        unlock the parent's lock too), so the lock lives exactly as long as the parent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            # OSError: already closed by the child's own fd cleanup; nothing held either way.
            with contextlib.suppress(OSError):
                os.close(fd)


_HELD: weakref.WeakSet[RunLock] = weakref.WeakSet()
_FORK_HOOK = threading.Lock()
_fork_hook_registered = False  # registered when the first lock is taken, never at import


def _hold(lock: RunLock) -> None:
    global _fork_hook_registered
    with _FORK_HOOK:
        if not _fork_hook_registered:
            os.register_at_fork(after_in_child=RunLock._forget_all_in_child)
            _fork_hook_registered = True
    _HELD.add(lock)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(fd, _HOLDER_BYTES, 0) or b"{}")
    except ValueError:  # the holder may be between truncate and write, or the file is not ours
        return {}
    return holder if isinstance(holder, dict) else {}
