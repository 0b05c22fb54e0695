"""The chaos harness, in small: SIGKILLs mid-write, mid-prune and at a random moment (with forked
workers alive), each followed by an immediate relaunch with ``--resume auto``; the run must end
bitwise equal to the uninterrupted one. ``python tests/system chaos --kills 100`` is the full session."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from resumable_data.audit import AUDIT_ENV
from system.chaos import PLAN, ChaosReport, audit_folders, chaos, check_consumed
from system.killpoints import KILLPOINTS

# The session runs in subprocesses with their own timeouts; this bounds the whole test.
SESSION_TIMEOUT_S = 240
# Chaos aims at checkpoint writes and prunes, and kills mid-step at random moments ("after-seconds");
# the "step" kill point (SIGKILL during a given optimizer step) is verify-resume's, "micro" and
# "micro-sigterm" (a signal between two micro-batches) tests/trainer/test_trainer_grad_accum.py's.
CHAOS_KILLPOINTS = set(KILLPOINTS) - {"step", "micro", "micro-sigterm"}


def run_session(kills: int, run_dir: Path, seed: int) -> ChaosReport:
    result: list[ChaosReport] = []
    thread = threading.Thread(
        target=lambda: result.append(chaos(kills, run_dir, seed=seed, log=lambda _: None)), daemon=True
    )
    thread.start()
    thread.join(timeout=SESSION_TIMEOUT_S if kills <= 3 else None)
    assert result, f"the chaos session did not finish within {SESSION_TIMEOUT_S} s"
    return result[0]


@pytest.mark.slow  # 20 s of CI's 2 cores; the default suite keeps the SIGKILLs of test_trainer*.py
def test_three_kills_mid_write_mid_prune_and_with_workers_change_nothing(tmp_path: Path) -> None:
    report = run_session(3, tmp_path / "chaos", seed=0)
    assert report.ok, "\n".join(report.failures) + "\n" + report.table()
    assert report.total_kills == 3
    # The plan aims the first three kills at a payload write, a random moment (with 2 workers) and a
    # prune (with async saves).
    assert report.kills == {"payload-half": 1, "after-seconds": 1, "prune-half": 1}
    assert report.kills_with_workers == 1 and report.kills_with_async == 1
    assert report.relaunches_refused == report.checkpoints_lost == report.corrupt_selected == 0
    assert report.loss_mismatches == report.final_mismatches == 0 and report.losses_compared >= 24
    assert report.runs_completed >= 1 and report.checkpoints_checked >= 1
    assert report.runs_audited == report.runs_completed and report.audit_mismatches == 0


def test_the_plan_covers_every_kill_point_but_verify_resumes() -> None:
    assert set(PLAN) == CHAOS_KILLPOINTS
    assert {PLAN[0], PLAN[1], PLAN[2]} == {"payload-half", "after-seconds", "prune-half"}


@pytest.mark.slow
def test_thirty_kills_cover_every_kill_point_with_and_without_workers(tmp_path: Path) -> None:
    report = run_session(30, tmp_path / "chaos", seed=1)
    assert report.ok, "\n".join(report.failures) + "\n" + report.table()
    assert set(report.kills) == CHAOS_KILLPOINTS
    assert 0 < report.kills_with_workers < report.total_kills


RECORDED = """
import sys, torch
from resumable_data import ResumableDataLoader, audit
loader = ResumableDataLoader(list(range(40)), batch_size=4, seed=int(sys.argv[1]))
for step, batch in zip(range(5), loader):
    audit.log(step, loss=float(torch.as_tensor(batch).sum()))
"""


@pytest.mark.parametrize(("seed", "differs"), [pytest.param(0, False, marks=pytest.mark.slow), (1, True)])
def test_the_audit_check_names_a_run_whose_steps_consumed_other_batches(
    tmp_path: Path, seed: int, differs: bool
) -> None:
    # The check the chaos runs go through, on two recorded runs: the same script and seed pass; another
    # seed (other samples in every batch) fails, naming the first step.
    script = tmp_path / "recorded.py"
    script.write_text(RECORDED)
    for run, run_seed in (("reference", 0), ("run-001", seed)):
        folder = audit_folders(tmp_path / run) / "launch-001"
        env = {**os.environ, AUDIT_ENV: str(folder), "PYTHONPATH": str(Path.cwd())}
        subprocess.run([sys.executable, str(script), str(run_seed)], env=env, check=True, timeout=120)
    report = ChaosReport()
    check_consumed("run-001", str(tmp_path / "run-001"), tmp_path / "reference", report)
    assert report.runs_audited == 1
    assert report.audit_mismatches == int(differs)
    if differs:
        assert "FAIL at" in report.failures[0] and "step 0" in report.failures[0], report.failures
