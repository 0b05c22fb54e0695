"""The chaos harness, in small: SIGKILLs mid-write, mid-prune and at a random moment (with forked
workers alive), each followed by an immediate relaunch with ``--resume auto``; the run must end
bitwise equal to the uninterrupted one. ``python tests/system chaos --kills 100`` is the full session."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from system.chaos import PLAN, ChaosReport, chaos
from system.killpoints import KILLPOINTS

# The session runs in subprocesses with their own timeouts; this bounds the whole test.
SESSION_TIMEOUT_S = 240
# Chaos aims at checkpoint writes and prunes, and kills mid-step at random moments ("after-seconds");
# the "step" kill point (SIGKILL during a given optimizer step) is verify-resume's.
CHAOS_KILLPOINTS = set(KILLPOINTS) - {"step"}


def run_session(kills: int, run_dir: Path, seed: int) -> ChaosReport:
    result: list[ChaosReport] = []
    thread = threading.Thread(
        target=lambda: result.append(chaos(kills, run_dir, seed=seed, log=lambda _: None)), daemon=True
    )
    thread.start()
    thread.join(timeout=SESSION_TIMEOUT_S if kills <= 3 else None)
    assert result, f"the chaos session did not finish within {SESSION_TIMEOUT_S} s"
    return result[0]


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


def test_the_plan_covers_every_kill_point_but_verify_resumes() -> None:
    assert set(PLAN) == CHAOS_KILLPOINTS
    assert {PLAN[0], PLAN[1], PLAN[2]} == {"payload-half", "after-seconds", "prune-half"}


@pytest.mark.slow
def test_thirty_kills_cover_every_kill_point_with_and_without_workers(tmp_path: Path) -> None:
    report = run_session(30, tmp_path / "chaos", seed=1)
    assert report.ok, "\n".join(report.failures) + "\n" + report.table()
    assert set(report.kills) == CHAOS_KILLPOINTS
    assert 0 < report.kills_with_workers < report.total_kills
