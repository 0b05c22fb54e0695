"""``verify`` on training scripts: a correct one PASSES; each broken one FAILS at its first bad step and
names the right cause.

The scripts are in ``tests/fixtures/broken_scripts``: ``tiny_train.py`` (correct: it restores model,
optimizer, loader and RNGs, and loops from the restored epoch) and a ``broken_*.py`` for each mistake.
Each verify runs the script uninterrupted and SIGKILLed + relaunched, a few seconds in all; every
launch has its own timeout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from resumable_data import audit
from resumable_data.__main__ import main
from resumable_data.audit import compare
from resumable_data.errors import ResumeError

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


@pytest.mark.slow  # the default suite's PASS case is verify over the trainer (test_verify_trainer_and_examples.py)
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
        # Each verify run is a reference and a few SIGKILLed launches (about 10 s of CI's 2 cores): the
        # default suite keeps the README's case; the causes' rules are all covered in the default suite by
        # test_the_cause_is_read_off_the_first_resumed_steps_records over hand-written records.
        pytest.param("broken_rng_not_restored.py", compare.RNG_OR_WEIGHTS, "same batches", marks=pytest.mark.slow),
        pytest.param(
            "broken_augment_rng.py",
            compare.RNG_NOT_RESTORED,
            "same samples, different bytes (augmentation)",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "broken_epoch_restart.py",
            compare.EPOCH_RESTARTED,
            "interrupted read: loader 0 epoch 0 position 0",
            marks=pytest.mark.slow,
        ),
        pytest.param("broken_plain_dataloader.py", compare.PLAIN_LOADER, "no batch records", marks=pytest.mark.slow),
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


def first_resumed_step(result: audit.VerifyResult, tmp_path: Path, rank: int = 0) -> int:
    """The first step the series' second launch logged on ``rank``, read from its audit records."""
    units = compare.read_launch(tmp_path / "runs" / "audit" / "interrupted" / "launch-2").units
    return min(step for step, unit_rank, _, _ in units if unit_rank == rank)


@pytest.mark.parametrize(
    ("script", "flags", "cause", "offset"),
    [
        # AdamW's moments restarted: the first resumed loss is the reference's (restored weights and RNG,
        # computed before the optimizer acts), the second is not, and the logged lr is the reference's.
        ("broken_optimizer_not_restored.py", [], "the optimizer's state was not restored", 1),
        # The schedule restarted: the first resumed step logs another learning rate (named before too).
        pytest.param(
            "broken_scheduler_not_restored.py",
            [],
            "the learning-rate schedule was not restored",
            0,
            marks=pytest.mark.slow,
        ),
        # The same without lr in the records: the losses alone cannot tell the optimizer from the
        # schedule (the optimizer holds the learning rate); the report says so and how to tell.
        pytest.param(
            "broken_scheduler_not_restored.py",
            ["--no-lr"],
            "the optimizer's state or the learning-rate schedule was not restored",
            2,
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_resume_fault_after_the_data_is_told_apart_by_the_first_resumed_steps_loss_and_lr(
    script: str, flags: list[str], cause: str, offset: int, tmp_path: Path
) -> None:
    result = audit.verify(
        [sys.executable, str(SCRIPTS / script), *flags],
        kills=1,
        timeout=LAUNCH_TIMEOUT_S,
        work_dir=tmp_path / "runs",
        echo=None,
    )
    assert not result.passed and result.finding is not None, result.report
    assert cause in result.finding.cause, result.report
    first = first_resumed_step(result, tmp_path)
    assert first > 1, result.report  # the relaunch resumed from a checkpoint
    assert result.finding.where.startswith(f"step {first + offset} (rank 0), launch 2"), result.report
    if offset:  # the steps before it, from the first resumed one, were equal: the report says so
        steps = f"steps {first} to {first + offset - 1} equal" if offset > 1 else f"step {first} equals"
        assert any(f"the first resumed {steps} the reference bitwise" in line for line in result.finding.what), (
            result.report
        )


@pytest.mark.slow  # its rule is covered by test_the_cause_is_read_off_the_first_resumed_steps_records
def test_a_step_counter_that_starts_again_is_named_not_the_loader(tmp_path: Path) -> None:
    result = run_verify("broken_step_counter_not_restored.py", tmp_path)
    assert not result.passed and result.finding is not None, result.report
    assert "the step counter was not restored" in result.finding.cause, result.report
    assert result.finding.where.startswith("step 1 (rank 0), launch 2"), result.report
    # What the relaunch logged as step 1 is, batches, loss and lr alike, what the reference ran later.
    assert any("the reference ran exactly this as step" in line for line in result.finding.what), result.report


@pytest.mark.slow
def test_a_checkpoint_written_before_the_optimizer_step_is_named_with_its_step(tmp_path: Path) -> None:
    result = run_verify("broken_saved_before_optimizer_step.py", tmp_path)
    assert not result.passed and result.finding is not None, result.report
    first = first_resumed_step(result, tmp_path)
    assert result.finding.where.startswith(f"step {first} (rank 0), launch 2"), result.report
    assert f"the checkpoint was written before the optimizer step of step {first - 1}" in result.finding.cause, (
        result.report
    )


@pytest.mark.slow
def test_under_torchrun_the_rank_whose_loader_was_not_restored_is_named_with_the_crash(tmp_path: Path) -> None:
    # Only rank 0 restores its loader: rank 1 reads its epoch's first batches again, its ranks' collectives
    # stop matching, and the relaunch fails. The report gives the exit code and the first difference.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = audit.verify(
        [*torchrun, str(SCRIPTS / "broken_rank1_loader_not_restored.py")],
        kills=1,
        timeout=LAUNCH_TIMEOUT_S,
        work_dir=tmp_path / "runs",
        echo=None,
    )
    assert not result.passed and result.finding is not None, result.report
    assert "FAIL: interrupted: launch 2 exited with code 1" in result.report
    first = first_resumed_step(result, tmp_path, rank=1)
    assert result.finding.where.startswith(f"step {first} (rank 1), launch 2"), result.report
    assert result.finding.cause == compare.rank_loader_not_restored(1, [0]), result.report


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


@pytest.mark.slow  # a verify run (10 s of CI's 2 cores); the lining-up rule is tested on records below
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


def test_compare_launches_refuses_folders_that_do_not_exist_and_a_reference_without_records(tmp_path: Path) -> None:
    # A harness that points at the wrong folders must not get a pass: a comparison of nothing proves nothing.
    with pytest.raises(ResumeError, match=r"no such audit folder: .*reference.*launch-1"):
        audit.compare_launches(tmp_path / "reference", [tmp_path / "launch-1"])
    (tmp_path / "reference").mkdir()
    (tmp_path / "launch-1").mkdir()
    with pytest.raises(ResumeError, match=r"no such audit folder: .*launch-2"):
        audit.compare_launches(tmp_path / "reference", [tmp_path / "launch-1", tmp_path / "launch-2"])
    with pytest.raises(ResumeError, match=r"reference folder .*reference holds no audit records"):
        audit.compare_launches(tmp_path / "reference", [tmp_path / "launch-1"])
    # A reference with records, and launches that recorded nothing: every step is missing, not passed.
    line = {"kind": "log", "rank": 0, "step": 1, "values": {"loss": {"hex": (0.5).hex()}}}
    (tmp_path / "reference" / "rank0-1-1.jsonl").write_text(json.dumps(line) + "\n")
    finding = audit.compare_launches(tmp_path / "reference", [tmp_path / "launch-1"])
    assert finding is not None and finding.cause == compare.MISSING and finding.where == "step 1 (rank 0)"


def step(number: int, rank: int, position: int, loss: float, lr: float = 0.1, epoch: int = 0) -> tuple:
    """A logged step's unit: one batch at ``position`` and the loss and lr logged for it."""
    values = {"loss": {"hex": loss.hex()}, "lr": {"hex": lr.hex()}}
    batch = compare.Batch(0, rank, epoch, position, (position,), f"bytes of {rank} {position}")
    return (number, rank, -1, "step"), compare.Unit([batch], values)


def test_the_cause_is_read_off_the_first_resumed_steps_records() -> None:
    """The rules of the diagnosis on records written by hand: the scripts above show them on real runs."""
    reference = compare.Launch(units=dict(step(n, 0, 4 * n, loss=1.0 / n, lr=0.1 * 0.9**n) for n in range(1, 9)))
    killed = compare.Launch(units={k: u for k, u in reference.units.items() if k[0] <= 5})
    resumed = {k: u for k, u in reference.units.items() if k[0] >= 4}  # resumed from the checkpoint of step 3

    def diagnose(units: dict) -> compare.Finding:
        finding = compare.compare(reference, [killed, compare.Launch(units=units)])
        assert finding is not None
        return finding

    # The resumed run repeats step 3 (batch, loss and lr) as step 4: written before step 3's update.
    repeated = {**resumed, (4, 0, -1, "step"): reference.units[(3, 0, -1, "step")]}
    assert diagnose(repeated).cause == compare.saved_before_optimizer_step(3)
    # It runs step 6's batch as step 5: what it trains is the reference's, only the numbers moved.
    ahead = {**resumed, (5, 0, -1, "step"): step(5, 0, 24, loss=0.3)[1]}
    finding = diagnose(ahead)
    assert finding.cause == compare.STEP_COUNTER_NOT_RESTORED and "at step 6 (rank 0), after this step" in (
        "; ".join(finding.what)
    )
    # The first resumed step right, the second's loss not, its lr right: the optimizer's state.
    drifted = {**resumed, (5, 0, -1, "step"): step(5, 0, 20, loss=0.3, lr=0.1 * 0.9**5)[1]}
    finding = diagnose(drifted)
    assert finding.cause == compare.OPTIMIZER_NOT_RESTORED and finding.where.startswith("step 5 (rank 0), launch 2")
    assert "the first resumed step 4 equals the reference bitwise (batches, loss and lr)" in finding.what
    # The first resumed step's lr that of step 3, and its loss another: written before step 3's update.
    stale = {**resumed, (4, 0, -1, "step"): step(4, 0, 16, loss=0.3, lr=0.1 * 0.9**3)[1]}
    assert diagnose(stale).cause == compare.saved_before_optimizer_step(3)
    # The same when the kill landed after that checkpoint and before step 3's log: step 3 has no record.
    unlogged = compare.Launch(units={k: u for k, u in killed.units.items() if k[0] <= 2})
    finding = compare.compare(reference, [unlogged, compare.Launch(units=stale)])
    assert finding is not None and finding.cause == compare.saved_before_optimizer_step(3)
    assert finding.where.startswith("step 4 (rank 0), launch 2") and "step 3 has no record" in finding.what[0]
    # The first resumed step's lr that of step 1, its loss right: the schedule started again.
    restarted = {**resumed, (4, 0, -1, "step"): step(4, 0, 16, loss=0.25, lr=0.1 * 0.9)[1]}
    finding = diagnose(restarted)
    assert finding.cause == compare.SCHEDULER_NOT_RESTORED and "the lr is the reference's of step 1" in finding.what


def test_of_two_ranks_the_one_whose_loader_restarted_is_named() -> None:
    units = dict(u for n in range(1, 9) for r in (0, 1) for u in [step(n, r, 8 * n + 4 * r, loss=1.0 / n + r)])
    reference = compare.Launch(units=units)
    killed = compare.Launch(units={k: u for k, u in units.items() if k[0] <= 5})
    resumed = {k: u for k, u in units.items() if k[0] >= 4}
    # Rank 1 reads its epoch's first batch again (and its loss differs); rank 0 reads the right one.
    resumed[(4, 1, -1, "step")] = step(4, 1, 12, loss=9.0)[1]
    finding = compare.compare(reference, [killed, compare.Launch(units=resumed)])
    assert finding is not None and finding.where.startswith("step 4 (rank 1), launch 2")
    assert finding.cause == compare.rank_loader_not_restored(1, [0])
    assert "the reference read these samples at step 1 (rank 1), before this step" in finding.what
