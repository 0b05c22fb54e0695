"""File locks and fork: a child forked while a thread of its parent holds a lock does not keep it.

Specification: a thread holds an exclusive lock while the main thread forks; once the parent's
thread has released it, the lock is free in the child (which inherited a copy of the parent's lock
file descriptor and closed it) as in the parent: the child can take it at once.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from resumable_data.storage.locks import flocked, held, try_exclusive

CHILD_TIMEOUT_S = 30


def test_a_lock_held_by_a_thread_at_fork_is_free_in_the_child_once_the_parent_releases_it(tmp_path: Path) -> None:
    path = str(tmp_path / "lock")
    taken, release = threading.Event(), threading.Event()

    def holder() -> None:
        with flocked(path, fcntl.LOCK_EX):
            taken.set()
            release.wait(CHILD_TIMEOUT_S)

    thread = threading.Thread(target=holder)
    thread.start()
    assert taken.wait(CHILD_TIMEOUT_S)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: wait for the parent's release, then try the lock without waiting
        code = 2
        try:
            os.close(write)
            os.read(read, 1)
            with try_exclusive(path) as free:
                code = 0 if free else 1
        finally:
            os._exit(code)
    os.close(read)
    release.set()
    thread.join(CHILD_TIMEOUT_S)
    os.write(write, b"x")
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child found the lock still held by its inherited copy"
    assert not held(path)
