"""File locks shared by the processes of a machine (``resumable_data.storage.locks``).

Specification: a lock its holder has released is free, also when a process forked while it was
held (a DataLoader worker forked while a download thread held a cache lock) still has a copy of the
descriptor; and that child, closing its copy, does not release a lock its parent still holds.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from resumable_data.storage.cache import RemoteShard, ShardCache
from resumable_data.storage.locks import flocked, held

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def forked(after_fork: Callable[[], object] | None = None) -> int:
    """A child that runs ``after_fork()`` (if given) and then waits to be killed."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            if after_fork is not None:
                after_fork()
            time.sleep(30)
        finally:
            os._exit(0)
    return pid


def reap(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_a_released_lock_is_free_though_a_child_forked_while_it_was_held_has_its_descriptor(tmp_path: Path) -> None:
    path = str(tmp_path / "lock")
    with flocked(path, fcntl.LOCK_EX):
        child = forked()
    try:
        assert not held(path)  # before the fix, the child's copy kept it held until the child died
    finally:
        reap(child)


def test_a_child_closing_its_copy_does_not_release_its_parents_lock(tmp_path: Path) -> None:
    path = str(tmp_path / "lock")
    with flocked(path, fcntl.LOCK_EX) as fd:
        child = forked(lambda: os.close(fd))
        try:
            time.sleep(0.2)
            assert held(path)
        finally:
            reap(child)


def test_a_cached_shard_released_in_the_parent_can_be_evicted_while_a_forked_child_lives(tmp_path: Path) -> None:
    def download(url: str, dest: str) -> str:
        Path(dest).write_bytes(b"x" * 8)
        return "8:tag"

    cache = ShardCache(tmp_path / "cache", None, download=download)
    shard = RemoteShard("s3://b/x.bin", 8, "8:tag")
    handle = cache.use(shard)
    child = forked()
    try:
        handle.close()
        assert not held(handle.path)
    finally:
        reap(child)
        cache.close()
