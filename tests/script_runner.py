"""Runs a user's training script in a subprocess and waits for that process alone, not for its children.

A script that SIGKILLs itself with DataLoader workers running leaves them orphaned: PyTorch's worker
notices its parent is gone only at its next status check, and one blocked on a queue whose reader
died may never exit. Waiting on pipes (``subprocess.run(capture_output=True)``) waits for every
process holding them, so one stuck orphan turns a passed kill into a timeout. Here the script's
output goes to a file, only the script's own exit is awaited, and whatever it leaves behind in its
process group is killed afterwards. A script that overruns gets SIGABRT first, so faulthandler
(on through ``PYTHONFAULTHANDLER``) writes every process's and thread's stack to the output: a hang
says where it hung.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

_DUMP_S = 10  # how long an overrun script gets to write its stacks


def run_script(
    command: Sequence[str], log: Path, *, timeout: float, env: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """Run ``command`` with its output in ``log``; return its exit code (negative: the signal) and output.

    Raises:
        AssertionError: the script did not exit within ``timeout`` seconds (the output's tail says where
            it was).
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        process = subprocess.Popen(
            list(command),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"},
            start_new_session=True,
        )
        try:
            code: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGABRT)  # stacks into the log
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=_DUMP_S)
        finally:
            with contextlib.suppress(ProcessLookupError):  # nothing is left in the group
                os.killpg(process.pid, signal.SIGKILL)  # the script if it overran, and its orphans
            process.wait()
    output = log.read_text(errors="replace")
    assert code is not None, f"{' '.join(command)} did not exit within {timeout} s:\n{output[-3000:]}"
    return code, output
