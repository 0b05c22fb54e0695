"""Runs a user's training script, SIGKILLs it mid-epoch, resumes it, and compares with an uninterrupted run.

The scripts live in tests/user_scripts/ and share ``toy.py`` (model, data, loss log). A script run with
``--kill-at K`` SIGKILLs itself after step K; run again with ``--reference DIR`` it resumes from its
last checkpoint, finishes, then trains uninterrupted in DIR in the same process. Every loss the
resumed run logged (the last one logged for each step) and the final weights must equal the
reference's bitwise.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from script_runner import run_script

USER_SCRIPTS = Path(__file__).parent / "user_scripts"
sys.path.insert(0, str(USER_SCRIPTS))

from toy import read_losses  # noqa: E402  # user_scripts/ is not a package

_TIMEOUT_S = 600


def _command(script: str, processes: int, port: int) -> list[str]:
    path = str(USER_SCRIPTS / script)
    if processes == 1:
        return [sys.executable, path]
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}"]
    return [*torchrun, f"--master_port={port}", path]


def kill_and_resume(
    script: str,
    tmp_path: Path,
    kill_at: int,
    *args: str,
    processes: int = 1,
    ranks: int | None = None,
    timeout: float = _TIMEOUT_S,
) -> None:
    """SIGKILL ``script`` after step ``kill_at``, resume it, and compare every rank with an uninterrupted run.

    ``processes`` > 1 runs the script under torchrun; ``ranks`` is how many ranks log losses
    (``processes`` unless the script launches its own, as Lightning's ddp does). Each of the two runs
    gets ``timeout`` seconds.
    """
    run, reference = tmp_path / "run", tmp_path / "reference"
    port = 29400 + os.getpid() % 500
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = _command(script, processes, port)
    code, output = run_script(
        [*command, "--run-dir", str(run), "--kill-at", str(kill_at), *args],
        tmp_path / "killed.log",
        timeout=timeout,
        env=env,
    )
    # One process dies of the signal; torchrun reports a child killed by it as a failure.
    assert code == (-signal.SIGKILL if processes == 1 else 1), output[-3000:]
    before = len(read_losses(run))
    code, output = run_script(
        [*command, "--run-dir", str(run), "--reference", str(reference), *args],
        tmp_path / "resumed.log",
        timeout=timeout,
        env=env,
    )
    assert code == 0, output[-3000:]
    for rank in range(ranks or processes):
        got, want = read_losses(run, rank), read_losses(reference, rank)
        assert len(want) > before > 0, "the kill must fall inside the run"
        assert got == want, f"rank {rank}: first different step {min(s for s in want if got.get(s) != want[s])}"
    weights = torch.load(run / "weights.pt", weights_only=True)
    expected_weights = torch.load(reference / "weights.pt", weights_only=True)
    assert all(torch.equal(weights[name], expected_weights[name]) for name in expected_weights)
