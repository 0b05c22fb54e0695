"""A SIGKILL at any moment of ``skip`` leaves the old checkpoint selected and loadable, byte for byte.

``skip`` publishes through CheckpointManager's atomic write (temp folder, fsync, rename), so a kill
before the rename leaves ``step-N`` the latest (and a ``.tmp-*`` leftover the next save removes), and
a kill after it leaves the complete ``step-(N+1)``; ``step-N`` itself is never written. Each kill point
(every fsync and rename of the write, see ``skip_killed.py``) and a few random moments are tried.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from resumable_data import CheckpointManager, ResumableDataLoader

KILLED = Path(__file__).with_name("skip_killed.py")
TIMEOUT = 60


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    loader = ResumableDataLoader(torch.arange(64), batch_size=4, seed=1)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    run = tmp_path_factory.mktemp("original") / "run"
    with CheckpointManager(run) as manager:
        manager.save(3, {"model": {"w": torch.randn(256, 256)}, "dataloader": loader.state_dict()})
    return run


def check_after_kill(run: Path, before: dict[str, str]) -> str:
    """The old checkpoint is intact; latest() is it or the complete new one. Returns which."""
    old = run / "step-00000003"
    assert digests(old) == before, "the old checkpoint changed"
    with CheckpointManager(run, lock=False) as manager:
        latest = manager.latest()
        assert latest in (old, run / "step-00000004")
        state = manager.load(latest)
    assert state["dataloader"]["position"] == (12 if latest == old else 20)
    return latest.name


# ~20 processes (30 s on 2 cores). The kill points are CheckpointManager's write, swept for the
# trainer in tests/system; the random moments below keep skip's own SIGKILL in the default suite.
@pytest.mark.slow
def test_a_kill_at_any_durable_operation_of_skip_leaves_the_old_checkpoint_selected_or_the_new_one_complete(
    original: Path, tmp_path: Path
) -> None:
    before = digests(original / "step-00000003")
    outcomes = []
    for n in range(1, 20):
        run = tmp_path / f"run-{n}"
        shutil.copytree(original, run)
        command = [sys.executable, str(KILLED), str(n), "skip", str(run / "step-00000003"), "--batches", "2"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, check=False)
        outcomes.append(check_after_kill(run, before))
        if result.returncode == 0:  # no kill point left: the write completed
            assert outcomes[-1] == "step-00000004"
            break
        assert result.returncode == -signal.SIGKILL, result.stderr
    else:
        pytest.fail("skip never completed: more kill points than expected")
    assert "step-00000003" in outcomes and len(outcomes) >= 4, f"the kills fell at too few moments: {outcomes}"


def test_a_kill_at_a_random_moment_of_skip_leaves_a_loadable_latest(original: Path, tmp_path: Path) -> None:
    before = digests(original / "step-00000003")
    rng = random.Random(0)
    for attempt in range(2):
        run = tmp_path / f"run-{attempt}"
        shutil.copytree(original, run)
        command = [sys.executable, "-m", "resumable_data", "skip", str(run / "step-00000003"), "--batches", "2"]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 3.0))
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=TIMEOUT)
        check_after_kill(run, before)
        # The next skip (or save) cleans up whatever the kill left and works.
        if not (run / "step-00000004").exists():
            subprocess.run(command, check=True, timeout=TIMEOUT, capture_output=True)
            assert check_after_kill(run, before) == "step-00000004"
