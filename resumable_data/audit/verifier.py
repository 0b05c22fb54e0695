"""``verify``: run a training command uninterrupted, then SIGKILLed and relaunched, and compare.

The command runs once straight through in a fresh folder, then as an interrupted series in another:
launched, SIGKILLed (the whole process group: torchrun's ranks and DataLoader workers too) once its
audit records reach a step drawn in advance, relaunched with the same command (the script resumes by
itself), ``kills`` times, then run to its end. Every launch records what each step consumed through
``RESUMABLE_DATA_AUDIT`` (no user code; :mod:`resumable_data.audit.records`) and whatever the script
logs with :func:`resumable_data.audit.log`; :mod:`resumable_data.audit.compare` compares them step by
step, bitwise, and names the first difference and its likely cause. A launch that fails after a
resume is reported with its exit code and with the first difference its records already show.
"""

from __future__ import annotations

import os
import random
import shlex
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .compare import Finding, Launch, compare, read_launch, reference_units
from .processes import kill_tree
from .records import AUDIT_ENV, LOG
from .tail import Point, Watch

__all__ = ["RUN_DIR", "VerifyResult", "verify"]

RUN_DIR = "{run_dir}"
"""In ``verify``'s command, replaced by the run's fresh folder (also its working directory)."""
_POLL_S = 0.002  # how often a launch's audit records are read while it runs: kills land close to their step


@dataclass
class VerifyResult:
    """What :func:`verify` found: ``passed``, the report it printed, the first difference if any."""

    passed: bool
    lines: list[str] = field(default_factory=list)
    finding: Finding | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of "reference" and of each series

    @property
    def report(self) -> str:
        return "\n".join(self.lines)


class _Failed(Exception):
    """A launch that did not do what the check needs (a crash, a timeout): the check fails with it,
    and with the first difference its records already show (``finding``), if any."""

    def __init__(self, message: str, finding: Finding | None = None) -> None:
        super().__init__(message)
        self.finding = finding


def verify(
    command: Sequence[str],
    *,
    kills: int = 3,
    seed: int = 0,
    workers_flag: str | None = None,
    timeout: float = 600.0,
    work_dir: str | os.PathLike[str] | None = None,
    echo: Callable[[str], None] | None = print,
) -> VerifyResult:
    """Check that ``command`` resumes exactly after SIGKILLs: PASS, or the first step that differs.

    Args:
        command: the training command; ``{run_dir}`` in it is replaced by the run's folder, which
            is also its working directory. It must resume by itself when relaunched (``--resume
            auto``). Arguments naming an existing file here are made absolute, and this folder is
            put first on ``PYTHONPATH``, so ``python train.py`` or ``python -m pkg`` run as from here.
        kills: SIGKILLs in the interrupted series, at steps drawn with ``seed`` from the
            reference run's steps.
        seed: chooses the kill steps.
        workers_flag: arguments that turn DataLoader workers on (``"--num-workers 2"``): a second
            reference and interrupted series run with them (workers may change which process's
            RNG dropout draws from, so they are compared with each other).
        timeout: seconds each launch may take.
        work_dir: an empty or new folder for the runs; a fresh temporary one when None.
        echo: where progress lines and the report go (None: nowhere).

    Returns:
        A :class:`VerifyResult`; ``passed`` is False on a difference or a failed launch (``finding``:
        the first difference, also the one a launch that failed after a resume had recorded).

    Raises:
        ValueError: an empty command, ``kills`` < 0, or a ``work_dir`` that is not empty.
    """
    if not command:
        raise ValueError("verify needs a command to run, e.g. verify(['python', 'train.py', '--resume', 'auto'])")
    if kills < 0:
        raise ValueError(f"kills should be a non-negative integer, but got kills={kills}")
    base = _work_dir(work_dir)
    result = VerifyResult(False)
    say = _printer(result, echo)
    argv = _absolute(list(command))
    say(f"verify: {shlex.join(argv)}")
    rng = random.Random(seed)
    # Workers change which process draws from the global RNGs (dropout may draw other numbers), so
    # the series with workers is compared with a reference run with workers.
    series: list[tuple[str, list[str]]] = [("", [])] + (
        [(" with workers", shlex.split(workers_flag))] if workers_flag else []
    )
    try:
        for label, extra in series:
            reference, points = _reference([*argv, *extra], base, label, timeout, say, result)
            steps = sorted(rng.sample(range(1, len(points)), min(kills, len(points) - 1)))
            launches = _series(
                f"interrupted{label}", [*argv, *extra], base, reference, points, steps, timeout, say, result
            )
            finding = compare(reference, launches)
            if finding is not None:
                result.finding = finding
                for line in finding.lines():
                    say(line)
                return result
    except _Failed as e:
        say(f"FAIL: {e}")
        if e.finding is not None:
            result.finding = e.finding
            say("the records written before it already differ from the uninterrupted run:")
            for line in e.finding.lines():
                say(line)
        return result
    result.passed = True
    what = "batches (sample indices and bytes)" if reference.has_batches else "no batches"
    logged = " and the logged values" if any(u.values is not None for u in reference.units.values()) else ""
    say(
        f"PASS: every step of the interrupted run{'s' if workers_flag else ''} equals the uninterrupted run, bitwise ({what}{logged})"
    )
    return result


def _printer(result: VerifyResult, echo: Callable[[str], None] | None) -> Callable[[str], None]:
    def say(line: str) -> None:
        result.lines.append(line)
        if echo is not None:
            echo(line)

    return say


def _work_dir(work_dir: str | os.PathLike[str] | None) -> Path:
    if work_dir is None:
        return Path(tempfile.mkdtemp(prefix="resumable-verify-"))
    base = Path(work_dir)
    if base.exists() and any(base.iterdir()):
        raise ValueError(
            f"work_dir should be empty or new (verify starts every run from nothing), but {base} holds files"
        )
    base.mkdir(parents=True, exist_ok=True)
    return base


def _absolute(argv: list[str]) -> list[str]:
    """``argv`` with arguments that name an existing file here made absolute (the runs start elsewhere)."""
    out = []
    for i, arg in enumerate(argv):
        module = i > 0 and argv[i - 1] == "-m"
        out.append(str(Path(arg).absolute()) if not module and RUN_DIR not in arg and Path(arg).is_file() else arg)
    return out


def _reference(
    argv: list[str], base: Path, label: str, timeout: float, say: Callable[[str], None], result: VerifyResult
) -> tuple[Launch, list[Point]]:
    """Run the uninterrupted reference; its records, and its steps (where kills may land)."""
    started, name = time.monotonic(), f"reference{label}"
    folder = name.replace(" ", "-")
    run_dir, audit, log = base / folder, base / "audit" / folder, base / f"{folder}.log"
    code = _launch(argv, run_dir, audit, log, timeout, None)
    result.seconds[name] = time.monotonic() - started
    if code != 0:
        raise _Failed(f"the uninterrupted run{label} exited with code {code}; see {log}")
    reference = read_launch(audit)
    points = Watch.points(reference)
    if not points:
        raise _Failed(
            f"the uninterrupted run left no audit records in {audit}: it reads through neither ResumableDataLoader "
            "nor StreamLoader and calls no resumable_data.audit.log(step, loss=...); nothing to compare"
        )
    kind = "logged steps" if points[0][0] == LOG else "batches"
    units = len(reference_units(reference))
    say(f"{name}: {len(points)} {kind} on rank 0, {units} units in all, {result.seconds[name]:.1f} s, in {run_dir}")
    if len(points) < 2:
        raise _Failed("the uninterrupted run recorded a single step: there is no point to interrupt it at")
    return reference, points


def _series(
    label: str,
    argv: list[str],
    base: Path,
    reference: Launch,
    points: list[Point],
    steps: list[int],
    timeout: float,
    say: Callable[[str], None],
    result: VerifyResult,
) -> list[Launch]:
    """The interrupted series: a launch killed at each of ``steps``, then one to the end; each one's records."""
    started = time.monotonic()
    name = label.replace(" ", "-")
    run_dir = base / name
    launches: list[Launch] = []
    done = []
    for number, step in enumerate([*steps, None], start=1):
        audit = base / "audit" / name / f"launch-{number}"
        watch = None if step is None else Watch(audit, points, step)
        code = _launch(argv, run_dir, audit, base / f"{name}-{number}.log", timeout, watch)
        launches.append(read_launch(audit))
        if watch is not None and watch.killed:
            done.append(f"killed after {watch.reached}")
            continue
        if code != 0:
            # A launch that fails after a resume (DDP's ranks out of step) may show why in its records:
            # the steps the series ran are compared, and the first difference is named with the exit code.
            finding = compare(reference, launches, complete=False) if number > 1 else None
            raise _Failed(
                f"{label}: launch {number} exited with code {code}; see {base / f'{name}-{number}.log'}", finding
            )
        if step is not None:
            done.append(f"launch {number} ended before its kill point")
        break
    result.seconds[label] = time.monotonic() - started
    kills = sum("killed" in d for d in done)
    say(
        f"{label}: {kills} SIGKILL{'s' if kills != 1 else ''} ({'; '.join(done) or 'none'}), "
        f"{len(launches)} launches, {result.seconds[label]:.1f} s, in {run_dir}"
    )
    return launches


def _launch(argv: list[str], run_dir: Path, audit: Path, log: Path, timeout: float, watch: Watch | None) -> int:
    """Run ``argv`` in ``run_dir`` with records to ``audit``; SIGKILL its process group when ``watch`` says.

    Returns:
        The exit code (negative: the signal that ended it).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    here = os.getcwd()
    env = {
        **os.environ,
        AUDIT_ENV: str(audit),
        "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
    }
    command = [arg.replace(RUN_DIR, str(run_dir)) for arg in argv]
    deadline = time.monotonic() + timeout
    with open(log, "w") as out:
        # A session of its own: the kill reaches every process the command started (torchrun's ranks).
        process = subprocess.Popen(
            command, cwd=run_dir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while process.poll() is None:
                if time.monotonic() > deadline:
                    raise _Failed(f"{shlex.join(command)} ran past the {timeout:.0f} s timeout; see {log}")
                if watch is not None and watch.reached_target():
                    watch.killed = True
                    break
                time.sleep(_POLL_S)
        finally:
            kill_tree(process)
            if watch is not None:
                watch.finish()
    return process.returncode
