"""``verify`` on training scripts: a correct one PASSES; each broken one FAILS at its first bad step and
names the right cause.

The scripts are in ``tests/fixtures/broken_scripts``: ``tiny_train.py`` (correct: it restores model,
optimizer, loader and RNGs, and loops from the restored epoch) and a ``broken_*.py`` for each mistake.
Each verify runs the script uninterrupted and SIGKILLed + relaunched, a few seconds in all; every
launch has its own timeout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from resumable_data import audit
from resumable_data.__main__ import main
from resumable_data.audit import compare

SCRIPTS = Path(__file__).resolve().parents[1] / "fixtures" / "broken_scripts"
LAUNCH_TIMEOUT_S = 120


def run_verify(script: str, tmp_path: Path, *, kills: int = 1, workers_flag: str | None = None) -> audit.VerifyResult:
    return audit.verify(
        [sys.executable, str(SCRIPTS / script)],
        kills=kills,
        workers_flag=workers_flag,
        timeout=LAUNCH_TIMEOUT_S,
        work_dir=tmp_path / "runs",
        echo=None,
    )


def test_a_script_that_restores_everything_passes(tmp_path: Path) -> None:
    result = run_verify("tiny_train.py", tmp_path, kills=2)
    assert result.passed, result.report
    assert result.report.splitlines()[-1].startswith("PASS: every step of the interrupted run equals")
    # The series was really interrupted twice: the kills landed before the run's end.
    assert "interrupted: 2 SIGKILLs" in result.report


@pytest.mark.slow
def test_a_script_that_restores_everything_passes_with_workers_too(tmp_path: Path) -> None:
    result = run_verify("tiny_train.py", tmp_path, kills=2, workers_flag="--num-workers 2")
    assert result.passed, result.report
    assert result.report.splitlines()[-1].startswith("PASS: every step of the interrupted runs equals")
    assert "interrupted: 2 SIGKILLs" in result.report and "interrupted with workers: 2 SIGKILLs" in result.report


@pytest.mark.parametrize(
    ("script", "cause", "what"),
    [
        ("broken_loader_not_restored.py", compare.LOADER_NOT_RESTORED, "the reference read these samples at step"),
        ("broken_rng_not_restored.py", compare.RNG_NOT_RESTORED, "same batches"),
        ("broken_augment_rng.py", compare.RNG_NOT_RESTORED, "same samples, different bytes (augmentation)"),
        ("broken_epoch_restart.py", compare.EPOCH_RESTARTED, "interrupted read: loader 0 epoch 0 position 0"),
        ("broken_plain_dataloader.py", compare.PLAIN_LOADER, "no batch records"),
    ],
)
def test_a_broken_resume_fails_at_its_first_bad_step_naming_the_cause(
    script: str, cause: str, what: str, tmp_path: Path
) -> None:
    result = run_verify(script, tmp_path)
    assert not result.passed, result.report
    finding = result.finding
    assert finding is not None, result.report
    assert finding.cause == cause, result.report
    assert any(what in line for line in finding.what), result.report
    # The first bad step is one the relaunch ran (the script checkpoints every 3 steps): after the
    # checkpoint it resumed from, before or at the kill.
    killed_after = int(result.report.split("killed after step ")[1].split(")")[0])
    step = int(finding.where.split()[1])
    assert killed_after - 3 < step <= killed_after + 1, result.report
    assert f"likely cause: {cause}" in result.report


def test_the_command_line_exits_1_on_a_failure_and_2_on_a_bad_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A command that reads through no resumable loader and logs nothing: there is nothing to compare.
    argv = ["verify", "--timeout", "60", "--work-dir", str(tmp_path / "runs"), "--", sys.executable, "-c", "pass"]
    assert main(argv) == 1
    assert "FAIL: the uninterrupted run left no audit records" in capsys.readouterr().out
    assert main(["verify", "--"]) == 2
    assert "verify needs a command" in capsys.readouterr().out
    (tmp_path / "runs" / "keep.txt").write_text("a user's file")
    assert main(argv) == 2  # the work dir now holds files: refused, and nothing in it is touched
    assert "work_dir should be empty or new" in capsys.readouterr().out
    assert (tmp_path / "runs" / "keep.txt").read_text() == "a user's file"


def test_a_script_that_logs_nothing_is_lined_up_by_its_loader_and_passes(tmp_path: Path) -> None:
    result = audit.verify(
        [sys.executable, str(SCRIPTS / "tiny_train.py"), "--no-log"],
        kills=1,
        timeout=LAUNCH_TIMEOUT_S,
        work_dir=tmp_path / "runs",
        echo=None,
    )
    assert result.passed, result.report
    assert "35 batches on rank 0" in result.report and "interrupted: 1 SIGKILL " in result.report


def batch(epoch: int, position: int, digest: str = "d") -> compare.Batch:
    return compare.Batch(0, 0, epoch, position, (position,), digest)


def test_a_relaunch_is_lined_up_by_its_first_batch_and_one_the_reference_never_read_fails() -> None:
    reference = compare.Launch(streams={(0, 0): [batch(0, p) for p in range(0, 40, 4)]})
    killed = compare.Launch(streams={(0, 0): [batch(0, p) for p in range(0, 20, 4)]})
    resumed = compare.Launch(streams={(0, 0): [batch(0, p) for p in range(12, 40, 4)]})
    assert compare.compare(reference, [killed, resumed]) is None
    # The same steps, one with other bytes: the first such step is named, with the cause.
    changed = compare.Launch(streams={(0, 0): [batch(0, 12), batch(0, 16, "other"), *resumed.streams[(0, 0)][2:]]})
    finding = compare.compare(reference, [killed, changed])
    assert finding is not None and finding.where.startswith("batch 5 of loader 0") and "launch 2" in finding.where
    assert finding.cause == compare.RNG_NOT_RESTORED
    # A relaunch that starts where the reference never was.
    elsewhere = compare.Launch(streams={(0, 0): [batch(0, 13), batch(0, 17)]})
    finding = compare.compare(reference, [killed, elsewhere])
    assert finding is not None and finding.cause == compare.OTHER_POSITION
    # A series that stops early misses steps.
    finding = compare.compare(reference, [killed])
    assert finding is not None and finding.cause == compare.MISSING and finding.where.startswith("batch 6 ")
