"""chaos: SIGKILL the trainer over and over, relaunch it at once, and prove that nothing was lost.

The way storage engines are tested. A tiny model trains once straight through (the reference, every
checkpoint kept). Then runs of the same configuration are killed with SIGKILL again and again and
relaunched *at once* with ``--resume auto`` until each finishes. Kills land at random moments and at
aimed ones (:mod:`system.killpoints`): mid payload write, between payload and manifest, just before
and after the publishing rename, mid prune; launches alternate ``--num-workers`` 0 and 2 (forked
workers outlive a killed trainer for a few seconds) and sync and async saves. Checked:

- every relaunch starts: none is refused by a lock left by the killed trainer or its workers;
- no checkpoint lost: after each kill the newest valid checkpoint is at least the newest one the
  killed process had finished saving (for async saves, the one before the last submitted);
- no corrupt checkpoint selected: every checkpoint that verifies after a kill holds exactly the
  reference's state for its step, and the relaunch resumes from the newest of them;
- every logged loss of every launch and the final state equal the uninterrupted run's, bitwise;
- what every step consumed equals the uninterrupted run's: each launch runs with
  ``RESUMABLE_DATA_AUDIT`` set to a folder of its own (the loaders record each batch's fingerprint,
  the trainer logs loss and lr through ``resumable_data.audit.log``), and the series is compared
  with the reference by ``resumable_data.audit.compare_launches``, the comparison ``python -m
  resumable_data verify`` reports.
"""

from __future__ import annotations

import collections
import itertools
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from helpers.trainer_runs import text_corpus, tiny
from resumable_data import CheckpointManager, ResumeError, audit
from resumable_data.testing import first_difference
from trainer.checkpointing import CHECKPOINT_FOLDER
from trainer.config import TrainConfig
from trainer.metrics import read_metrics

from .killpoints import ENTRY, KILLPOINTS
from .verify import child_env, config_to_argv

__all__ = ["CHAOS_RUN", "ChaosReport", "chaos"]

# The tests' TINY run: a launch is mostly Python start-up, so many kills per minute on 2 cores. A
# checkpoint every 2 steps, so kills often land in writes and prunes.
CHAOS_RUN: dict[str, Any] = dict(max_steps=24, eval_every=8, checkpoint_every=2, keep_last=2)
CORPUS_BYTES = 4000
# Kill points in turn: any 3 kills in a row include a checkpoint write, a random moment and a prune;
# with workers and async alternating on periods 2 and 4, every point meets every combination
# within 44 kills.
PLAN = (
    "payload-half",
    "after-seconds",
    "prune-half",
    "manifest-synced",
    "after-seconds",
    "prune-aside",
    "before-publish",
    "after-seconds",
    "payload-synced",
    "after-publish",
    "after-seconds",
)
LAUNCH_TIMEOUT_S = 300
NO_KILL = "none"


@dataclass
class Launch:
    """One process of a chaos run."""

    killpoint: str
    count: str
    num_workers: int
    async_save: bool
    exit_code: int | None = None
    first_event: int = 0  # index of its first event in the run's metrics log
    snapshot: Path | None = None  # the checkpoint folder as the kill left it
    killed: str = ""  # under torchrun, what a random-moment kill hit ("rank 1", "agent")
    orphans: list[int] = field(default_factory=list)  # ranks that outlived their killed agent

    def __str__(self) -> str:
        return f"{self.killpoint} {self.killed}".strip()


@dataclass(frozen=True)
class Checkpoints:
    """How the checks read a checkpoint format: the file format here, DCP in :mod:`system.chaos_distributed`."""

    folder: str  # the run folder's checkpoint folder
    load: Callable[[Path], dict[str, Any]]  # a step folder's whole state
    newest_valid: Callable[[Path], int | None]  # of a checkpoint folder, as ``--resume auto`` picks it
    verified: Callable[[Path], Iterable[tuple[Path, int, dict[str, Any]]]]  # (folder, step, state) that verify


@dataclass
class ChaosReport:
    """What a chaos session did and found; :attr:`ok` when every check passed."""

    kills: collections.Counter[str] = field(default_factory=collections.Counter)
    kills_with_workers: int = 0
    kills_with_async: int = 0
    runs_completed: int = 0
    launches: int = 0
    relaunches_refused: int = 0
    checkpoints_lost: int = 0
    checkpoints_checked: int = 0
    corrupt_selected: int = 0
    corrupt_valid: int = 0
    wrong_resume_point: int = 0
    losses_compared: int = 0
    loss_mismatches: int = 0
    final_mismatches: int = 0
    runs_audited: int = 0
    audit_mismatches: int = 0
    wall_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def total_kills(self) -> int:
        return sum(self.kills.values())

    @property
    def ok(self) -> bool:
        return not self.failures

    def table(self) -> str:
        """The results as a markdown table, then the kills per kill point."""
        rows = [
            (
                "SIGKILLs injected",
                f"{self.total_kills} ({self.kills_with_workers} with 2 workers, {self.kills_with_async} during async saving runs)",
            ),
            ("launches / runs completed", f"{self.launches} / {self.runs_completed}"),
            ("relaunches refused (stale lock)", self.relaunches_refused),
            ("checkpoints lost", self.checkpoints_lost),
            ("corrupt checkpoints selected", self.corrupt_selected),
            (
                "valid-looking checkpoints that differ from the reference",
                f"{self.corrupt_valid} of {self.checkpoints_checked} checked",
            ),
            ("resumed from another than the newest valid checkpoint", self.wrong_resume_point),
            ("logged losses different from the uninterrupted run", f"{self.loss_mismatches} of {self.losses_compared}"),
            ("final states different from the uninterrupted run", f"{self.final_mismatches} of {self.runs_completed}"),
            (
                "runs whose steps consumed other batches (audit)",
                f"{self.audit_mismatches} of {self.runs_audited}",
            ),
            ("wall time", f"{self.wall_s:.0f} s"),
        ]
        lines = ["| check | result |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]
        lines += ["", "| kill point | kills |", "|---|---|"]
        points = [*KILLPOINTS, *sorted(set(self.kills) - set(KILLPOINTS))]  # the distributed harness adds its own
        lines += [f"| {point} | {self.kills[point]} |" for point in points if self.kills[point]]
        return "\n".join(lines)


def chaos(kills: int, run_dir: str | Path = "runs/chaos", *, seed: int = 0, log: Any = print) -> ChaosReport:
    """Kill, relaunch and compare until ``kills`` SIGKILLs have landed; see the module docstring.

    Args:
        kills: how many SIGKILLs to inject (runs are repeated until this many landed).
        run_dir: parent folder of the reference and the chaos runs (emptied first).
        seed: fixes the kill moments and counts, so a failing session can be replayed.
        log: where progress lines go.

    Returns:
        The report; ``report.ok`` is False if any check failed (``report.failures`` says which).
    """
    if kills < 1:
        raise ValueError(f"--kills should be >= 1, but got {kills}")
    started = time.perf_counter()
    base = Path(run_dir)
    config, expected_losses, train_s = _reference_run(base)
    log(f"chaos: reference run of {config.max_steps} steps trained in {train_s:.2f} s; now {kills} kills")
    relaunch = lambda run, rng, report: _kill_until_finished(run, kills, rng, train_s, report, base / "snapshots")
    return run_session(kills, config, expected_losses, relaunch, FILE_CHECKPOINTS, seed=seed, log=log, started=started)


def run_session(
    kills: int,
    config: TrainConfig,
    expected_losses: dict[int, float],
    relaunch: Callable[[TrainConfig, random.Random, ChaosReport], list[Launch]],
    checkpoints: Checkpoints,
    *,
    seed: int,
    log: Any,
    started: float,
) -> ChaosReport:
    """Runs of the reference's ``config`` (in folders beside it), each killed and relaunched by
    ``relaunch`` until it finishes, then compared with the reference; until ``kills`` SIGKILLs landed
    or a check failed. ``started``: the session's ``time.perf_counter()`` start, for its wall time."""
    base = Path(config.run_dir).parent
    report = ChaosReport()
    rng = random.Random(seed)
    references: dict[int, dict[str, Any]] = {}
    for run_number in itertools.count(1):
        if report.total_kills >= kills or report.failures:
            break
        run = replace(config, run_dir=str(base / f"run-{run_number:03d}"), resume="auto")
        launches = relaunch(run, rng, report)
        if not report.failures:
            report.runs_completed += 1
            check_run(run, launches, expected_losses, Path(config.run_dir), checkpoints, report, references)
        status = "" if report.ok else " FAILED: " + report.failures[-1]
        log(f"  {Path(run.run_dir).name}: {len(launches)} launches, kills so far {report.total_kills}/{kills}{status}")
    report.wall_s = time.perf_counter() - started
    return report


def _reference_run(base: Path) -> tuple[TrainConfig, dict[int, float], float]:
    """Empty ``base``, write the corpus and train the reference straight through, keeping every
    checkpoint (so each one a chaos run writes can be compared). Returns its configuration, its
    loss at every step and how long its training took (the range of the random kill moments)."""
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    config = tiny(base, "reference", data=text_corpus(base, CORPUS_BYTES), **CHAOS_RUN)
    reference = replace(config, resume="never", keep_last=10**6)
    code = _launch(reference, Launch(NO_KILL, "0", 0, False)).wait(timeout=LAUNCH_TIMEOUT_S)
    if code != 0:
        raise RuntimeError(f"the reference run failed with exit code {code}; see {base / 'reference' / 'launches.log'}")
    events = read_metrics(reference.run_dir)
    times = [e["time"] for e in events if e["event"] in ("start", "end")]
    return config, {e["step"]: e["loss"] for e in events if e["event"] == "step"}, times[-1] - times[0]


def _next_launch(attempt: int, kills: int, rng: random.Random, train_s: float) -> Launch:
    """The launch after ``attempt`` kills: the plan's next kill point (none once ``kills`` landed),
    with 2 workers every other kill and async saves every other pair. The plan moves on only when a
    kill lands (a launch may finish first), so the first K kills are exactly the plan's first K."""
    if attempt >= kills:
        return Launch(NO_KILL, "0", num_workers=0, async_save=False)
    point = PLAN[attempt % len(PLAN)]
    count = f"{rng.uniform(0.0, train_s):.3f}" if point == "after-seconds" else str(rng.randint(1, 2))
    return Launch(point, count, num_workers=2 * (attempt % 2), async_save=(attempt // 2) % 2 == 1)


def _kill_until_finished(
    run: TrainConfig, kills: int, rng: random.Random, train_s: float, report: ChaosReport, snapshots: Path
) -> list[Launch]:
    """Launch ``run`` again and again, at once after each SIGKILL, until a launch exits by itself."""
    launches: list[Launch] = []
    while True:
        launch = _next_launch(report.total_kills, kills, rng, train_s)
        report.launches += 1
        launch.first_event = len(_events(run.run_dir))
        process = _launch(replace(run, num_workers=launch.num_workers, async_save=launch.async_save), launch)
        wait_for(process, launch, run.run_dir, LAUNCH_TIMEOUT_S, report)
        launches.append(launch)
        if launch.exit_code != -signal.SIGKILL:
            break
        report.kills[launch.killpoint] += 1
        report.kills_with_workers += launch.num_workers > 0
        report.kills_with_async += launch.async_save
        # The folder exactly as the kill left it (a few ms); the relaunch follows at once.
        launch.snapshot = snapshots / f"{Path(run.run_dir).name}-{len(launches):02d}"
        shutil.copytree(Path(run.run_dir) / CHECKPOINT_FOLDER, launch.snapshot, symlinks=True)
    if launch.exit_code != 0:
        output = (Path(run.run_dir) / "launches.log").read_text(errors="replace")
        report.relaunches_refused += "locked by pid" in output
        report.failures.append(
            f"{run.run_dir}: launch {len(launches)} exited with {launch.exit_code}; see launches.log"
        )
    return launches


def _launch(config: TrainConfig, launch: Launch) -> subprocess.Popen[bytes]:
    """Start the trainer (armed with a kill point unless ``none``), appending to RUN_DIR/launches.log."""
    train_argv = ["train", *config_to_argv(config)]
    if launch.killpoint == NO_KILL:
        command = [sys.executable, "-m", "trainer", *train_argv]
    else:
        command = [sys.executable, *ENTRY, launch.killpoint, launch.count, *train_argv]
    header = f"{launch.killpoint} {launch.count} workers={launch.num_workers} async={launch.async_save}"
    return start_logged(command, config.run_dir, header)


def wait_for(
    process: subprocess.Popen[bytes], launch: Launch, run_dir: str, timeout: float, report: ChaosReport
) -> None:
    """Wait for a launch's exit code; one that runs over ``timeout`` seconds is stopped and fails the run."""
    try:
        launch.exit_code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        launch.exit_code = process.wait()
        report.failures.append(f"{run_dir}: a launch ran over {timeout} s and was stopped")


def start_logged(command: list[str], run_dir: str, header: str) -> subprocess.Popen[bytes]:
    """Start ``command`` (a trainer launch), its output appended to RUN_DIR/launches.log after ``$ header``."""
    log_path = Path(run_dir) / "launches.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as out:
        out.write(f"\n$ {header}\n")
        out.flush()
        # One thread per process: a launch is tiny, and contention on a shared machine only slows it.
        records = audit_folders(run_dir)
        records.mkdir(exist_ok=True)
        launch = records / f"launch-{len(list(records.iterdir())) + 1:03d}"
        launch.mkdir()  # now: a launch killed before its first record still has its number
        env = {**child_env(), "OMP_NUM_THREADS": "1", audit.AUDIT_ENV: str(launch)}
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


def _events(run_dir: str) -> list[dict[str, Any]]:
    return read_metrics(run_dir) if (Path(run_dir) / "metrics.jsonl").is_file() else []


def check_losses(name: str, events: list[dict[str, Any]], expected: dict[int, float], report: ChaosReport) -> None:
    """Every step's loss equals the uninterrupted run's, and no step is missing."""
    for event in events:
        if event["event"] == "step":
            report.losses_compared += 1
            if event["loss"] != expected.get(event["step"]):
                report.loss_mismatches += 1
                report.failures.append(
                    f"{name}: step {event['step']} loss {event['loss']!r}, uninterrupted {expected.get(event['step'])!r}"
                )
    missing = set(expected) - {e["step"] for e in events if e["event"] == "step"}
    if missing:
        report.failures.append(f"{name}: steps {sorted(missing)} were never logged")


def check_run(
    run: TrainConfig,
    launches: list[Launch],
    expected_losses: dict[int, float],
    reference_dir: Path,
    checkpoints: Checkpoints,
    report: ChaosReport,
    reference_states: dict[int, dict[str, Any]],
) -> None:
    """Compare one finished chaos run with the reference; count and describe every difference.

    ``reference_states`` caches the reference's states by step across the runs of a session."""
    name = Path(run.run_dir).name
    events = _events(run.run_dir)

    def reference_state(step: int) -> dict[str, Any]:
        if step not in reference_states:
            reference_states[step] = checkpoints.load(reference_dir / checkpoints.folder / f"step-{step:08d}")
        return reference_states[step]

    floor = 0  # the newest checkpoint known to be durable so far
    for i, launch in enumerate(launches):
        own = events[launch.first_event : launches[i + 1].first_event if i + 1 < len(launches) else len(events)]
        if i > 0:
            killed = launches[i - 1].snapshot
            expected = (killed and checkpoints.newest_valid(killed)) or 0
            check_resume_point(f"{name}: launch {i + 1}", own, expected, report)
        if launch.snapshot is not None:
            newest = checkpoints.newest_valid(launch.snapshot) or 0
            kill = f"{name}: after kill {i + 1} ({launch})"
            floor = check_kill(kill, own, floor, launch.async_save, newest, report)
            check_states(name, checkpoints.verified(launch.snapshot), newest, reference_state, report)
    check_losses(name, events, expected_losses, report)
    check_consumed(name, run.run_dir, reference_dir, report)
    final = checkpoints.load(Path(run.run_dir) / checkpoints.folder / f"step-{run.max_steps:08d}")
    check_final(name, reference_state(run.max_steps), final, report)


def audit_folders(run_dir: str | Path) -> Path:
    """Where the launches of ``run_dir`` record what they consume, a folder each (beside the run)."""
    return Path(f"{run_dir}.audit")


def check_consumed(name: str, run_dir: str, reference_dir: Path, report: ChaosReport) -> None:
    """Every step of the run's launches consumed the reference's batches and logged its loss and lr."""
    (reference,) = sorted(audit_folders(reference_dir).iterdir())
    finding = audit.compare_launches(reference, sorted(audit_folders(run_dir).iterdir()))
    report.runs_audited += 1
    if finding is not None:
        report.audit_mismatches += 1
        report.failures.append(f"{name}: " + " / ".join(finding.lines()))


def check_resume_point(launch: str, own: list[dict[str, Any]], expected: int, report: ChaosReport) -> None:
    """A launch (its events ``own``) that started resumed from ``expected``, the newest checkpoint
    that verified after the kill before it (0: none, it starts from scratch)."""
    resumed = [e["step"] for e in own if e["event"] == "resume"]
    if any(e["event"] == "start" for e in own) and (resumed[0] if resumed else 0) != expected:
        report.wrong_resume_point += 1
        report.failures.append(f"{launch} resumed from {resumed[0] if resumed else 0}, newest valid was {expected}")


def check_kill(
    kill: str, own: list[dict[str, Any]], floor: int, async_save: bool, newest: int, report: ChaosReport
) -> int:
    """No checkpoint the killed launch (its events ``own``) had saved before is lost: the newest
    valid one after the kill, ``newest``, is at least the newest durable one. Returns the new floor."""
    saved = [e["step"] for e in own if e["event"] == "checkpoint"]
    durable = saved[:-1] if async_save else saved  # an async save is durable once the next one starts
    floor = max([floor, *durable])
    if newest < floor:
        report.checkpoints_lost += 1
        report.failures.append(f"{kill} the newest valid checkpoint is {newest}, but {floor} had been saved")
    return newest


def check_states(
    name: str,
    verified: Iterable[tuple[Path, int, dict[str, Any]]],
    newest: int,
    reference_state: Callable[[int], dict[str, Any]],
    report: ChaosReport,
) -> None:
    """Every checkpoint that verifies after a kill (folder, step, state) holds the reference's state:
    incomplete or corrupt ones are never selected (:func:`check_resume_point` proves it)."""
    for folder, step, state in verified:
        report.checkpoints_checked += 1
        difference = first_difference(reference_state(step), state)
        if difference is not None:
            report.corrupt_valid += 1
            report.corrupt_selected += step == newest
            report.failures.append(
                f"{name}: checkpoint {folder} verifies but differs from the reference at {difference}"
            )


def check_final(name: str, reference: dict[str, Any], final: dict[str, Any], report: ChaosReport) -> None:
    """A finished run's final state is the uninterrupted run's."""
    difference = first_difference(reference, final)
    if difference is not None:
        report.final_mismatches += 1
        report.failures.append(f"{name}: final state differs from the uninterrupted run at {difference}")


def _newest_valid(folder: Path) -> int | None:
    """The step of the newest checkpoint in ``folder`` that verifies, as ``--resume auto`` picks it."""
    with warnings.catch_warnings(), CheckpointManager(folder, lock=False) as manager:
        warnings.simplefilter("ignore")
        newest = manager.latest()
    return None if newest is None else CheckpointManager.step_of(newest)


def _verified(snapshot: Path) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """Each checkpoint of ``snapshot`` whose manifest and checksum verify, with its step and state."""
    for folder in sorted(snapshot.glob("step-*")):
        try:
            state = _load(folder)
        except ResumeError:
            continue
        yield folder, CheckpointManager.step_of(folder), state


def _load(folder: Path) -> dict[str, Any]:
    with CheckpointManager(folder.parent, lock=False) as manager:
        return manager.load(folder)


FILE_CHECKPOINTS = Checkpoints(CHECKPOINT_FOLDER, _load, _newest_valid, _verified)
