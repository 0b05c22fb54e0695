"""SIGKILL a command's whole process tree: torchrun starts its ranks in sessions of their own, so a
signal to the command's process group alone would leave them running (and writing checkpoints)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["kill_tree"]

_GONE_WAIT_S = 30.0  # how long a SIGKILLed process may take to disappear (a stuck D-state read)


def _children() -> dict[int, list[int]]:
    """Every process's children, from ``/proc`` (empty where there is none: not Linux)."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (name) state ppid ...": the name may hold spaces and parentheses; split after the last ")".
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it exited while we read
        tree.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie has finished: it only waits for its parent to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``process``, its process group and every descendant; return once they are all gone."""
    victims = _descendants(process.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):  # gone already
        os.killpg(process.pid, signal.SIGKILL)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + _GONE_WAIT_S
    # A rank still alive could write one more checkpoint after the relaunch read the folder.
    while any(_alive(p) for p in victims) and time.monotonic() < deadline:
        time.sleep(0.005)
