"""The runner every SIGKILL test launches its user script with (tests/script_runner.py).

Specification: a script that kills itself is reported as killed as soon as it dies, even when a child
it leaves behind (an orphaned DataLoader worker) holds its output open and never exits; the child is
gone afterwards; a script that overruns its timeout fails with its output and its stack, and is gone too.
"""

from __future__ import annotations

import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from script_runner import run_script

# Forks a child that inherits stdout and outlives its parent by far, then SIGKILLs itself.
_LEAVES_AN_ORPHAN = textwrap.dedent(
    """
    import os, signal, sys, time
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    print("child", pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _gone(pid: int) -> bool:
    """Dead: no such process, or a zombie its new parent has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_a_killed_script_is_reported_at_once_and_its_orphan_killed(tmp_path: Path) -> None:
    # Waiting on the orphan's copy of stdout, as subprocess.run(capture_output=True) does, would overrun.
    code, output = run_script([sys.executable, "-c", _LEAVES_AN_ORPHAN], tmp_path / "out.log", timeout=30)
    assert code == -signal.SIGKILL
    orphan = int(output.split()[1])
    deadline = time.monotonic() + 10  # killed after its parent's exit; give the signal a moment
    while not _gone(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(orphan)


def test_a_script_past_its_timeout_fails_with_its_output_and_where_it_hung(tmp_path: Path) -> None:
    script = "import time; print('still here', flush=True); time.sleep(600)"
    with pytest.raises(AssertionError, match=r"did not exit within 1 s:\nstill here") as failure:
        run_script([sys.executable, "-c", script], tmp_path / "out.log", timeout=1)
    assert 'File "<string>", line 1 in <module>' in str(failure.value)  # faulthandler's dump
