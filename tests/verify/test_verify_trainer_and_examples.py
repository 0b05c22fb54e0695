"""``verify`` PASSES on the reference trainer (0 and 2 DataLoader workers, and 2 ranks under torchrun)
and on every script in examples/: the trainer resumes from its checkpoints by itself (``--resume
auto``) and logs each step's loss with ``audit.log``; the examples run whole in each launch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_examples import EXAMPLES, example_command

from resumable_data import audit

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 240
# Tiny, with dropout on (so the RNG restore matters) and checkpoints every 5 steps (so steps replay).
TRAINER = [
    *("-m", "trainer", "train", "--run-dir", "{run_dir}", "--max-steps", "20", "--block-size", "32"),
    *("--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--batch-size", "8", "--dropout", "0.1"),
    *("--eval-every", "10", "--eval-batches", "2", "--checkpoint-every", "5", "--no-progress"),
]


def check(command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **options: object) -> None:
    monkeypatch.chdir(ROOT)  # verify puts the folder it starts from on PYTHONPATH: `-m trainer` imports
    result = audit.verify(command, timeout=LAUNCH_TIMEOUT_S, work_dir=tmp_path / "runs", echo=None, **options)  # type: ignore[arg-type]
    assert result.passed, result.report
    assert "SIGKILL" in result.report and "launches" in result.report


def test_the_trainer_resumes_exactly_after_sigkills(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check([sys.executable, *TRAINER], tmp_path, monkeypatch, kills=2)


@pytest.mark.slow
def test_the_trainer_resumes_exactly_with_2_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check([sys.executable, *TRAINER], tmp_path, monkeypatch, kills=2, workers_flag="--num-workers 2")


@pytest.mark.slow
def test_the_trainer_resumes_exactly_on_2_ranks_under_torchrun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    check([*torchrun, *TRAINER], tmp_path, monkeypatch, kills=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_passes(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check(example_command(name), tmp_path, monkeypatch, kills=2)


@pytest.mark.slow
def test_the_trainers_verify_resume_harness_runs_verify_with_random_kills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from system.cli import main as system_main

    monkeypatch.chdir(ROOT)
    argv = ["verify-resume", "--max-steps", "20", "--kill-at-step", "12", "--random-kills", "2"]
    assert system_main([*argv, "--run-dir", str(tmp_path / "runs")]) == 0
    assert (tmp_path / "runs" / "random-kills" / "interrupted").is_dir()
