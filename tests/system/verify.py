"""verify-resume: prove on this machine that a killed and resumed run equals an uninterrupted one.

Three jobs train the same configuration: one straight through; one that kills itself with
SIGKILL (no handler runs, nothing is flushed or saved) during step k, armed from outside the
trainer by the ``step`` kill point of :mod:`system.killpoints`; and one that resumes the killed
run from its newest checkpoint. The per-step losses of every attempt and the final weights
and optimizer state must be bitwise equal.

With ``--nproc N`` each job is a ``torchrun`` job of N ranks (rank 0 is the one killed; torchrun
then stops the others), every rank must end with the same weights, and two elastic resumes of the
killed run follow: on one rank (``--elastic global-batch``: gradient accumulation doubles) and on
N + 1 ranks (``--elastic per-rank-batch``). Their batch indices, logged by every rank
(:mod:`system.index_log`), must read the rest of the interrupted epoch exactly once.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from resumable_data import CheckpointManager, audit
from resumable_data.testing import first_difference
from trainer.checkpointing import CHECKPOINT_FOLDER, MODEL, OPTIMIZER
from trainer.config import TrainConfig, flag
from trainer.data import TokenWindows, default_cache_dir, prepare_data
from trainer.documents import document_files
from trainer.metrics import read_metrics
from trainer.model import ModelConfig

from . import index_log
from .killpoints import ENTRY

__all__ = ["VERIFY_DEFAULTS", "VERIFY_KILL_AT", "child_env", "config_to_argv", "verify_random_kills", "verify_resume"]

# verify-resume's defaults: small enough for a few minutes on 2 CPU cores, with dropout on so the
# RNG restore matters, and checkpoints that do not fall on the kill step so steps get replayed.
VERIFY_DEFAULTS = {
    "run_dir": "runs/verify-resume",
    "max_steps": 60,
    "block_size": 64,
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 64,
    "dropout": 0.1,
    "batch_size": 8,
    "warmup_steps": 10,
    "eval_every": 20,
    "eval_batches": 4,
    "checkpoint_every": 10,
}
VERIFY_KILL_AT = 37


def config_to_argv(config: TrainConfig) -> list[str]:
    """The ``python -m trainer train`` flags that reproduce ``config``."""
    argv = []
    for f in fields(config):
        value = getattr(config, f.name)
        name = flag(f.name)
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        elif value is not None:
            argv += [name, str(value)]
    return argv


# A torchrun job that hangs (a rank stuck in a collective) must not hang verify-resume.
JOB_TIMEOUT_S = 900


def child_env() -> dict[str, str]:
    """The environment for a trainer subprocess: it must import this very trainer and library,
    installed or not, and these checks (``system.killpoints``)."""
    tests = Path(__file__).resolve().parents[1]
    paths = [str(tests.parent), str(tests), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}


def _run(config: TrainConfig, label: str, nproc: int | None = None, *, kill_at: int | None = None) -> int:
    """Train ``config`` in fresh processes (``torchrun`` with ``nproc`` ranks when given); the
    output goes to ``RUN_DIR/LABEL.log``.

    Under torchrun every rank logs its batch indices (:mod:`system.index_log`) for the elastic
    checks; ``kill_at`` SIGKILLs (rank 0) during that step (:mod:`system.killpoints`).
    """
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc
        else [sys.executable]
    )
    instrumented = nproc is not None or kill_at is not None
    kill = ["step", str(kill_at)] if kill_at is not None else []
    entry = [*ENTRY, *kill] if instrumented else ["-m", "trainer"]
    command = [*launcher, *entry, "train", *config_to_argv(config)]
    env = child_env()
    if nproc is not None:
        env[index_log.ENV] = config.run_dir
    log = Path(config.run_dir) / f"{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"  {label}: {' '.join(command[1:])}", flush=True)
    with open(log, "w") as out:
        try:
            return subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, check=False, timeout=JOB_TIMEOUT_S
            ).returncode
        except subprocess.TimeoutExpired:
            print(f"  {label}: no result after {JOB_TIMEOUT_S} s; killed", flush=True)
            return -1


def _final_state(run_dir: Path) -> dict[str, Any]:
    with CheckpointManager(run_dir / CHECKPOINT_FOLDER, lock=False) as manager:
        return manager.load()


def verify_resume(config: TrainConfig, kill_at_step: int, nproc: int | None = None, random_kills: int = 0) -> bool:
    """Run the three jobs under ``config.run_dir`` and print the comparison.

    Args:
        config: the training run to check (``run_dir`` is the parent of the runs' folders).
        kill_at_step: the step during which the second run is killed.
        nproc: run each job under ``torchrun`` with this many ranks, and add the elastic checks.
        random_kills: then also run the library's ``verify`` with this many SIGKILLs at random
            steps (:func:`verify_random_kills`).

    Returns:
        True when every step's loss and the final model and optimizer states are bitwise equal.

    Raises:
        ValueError: ``kill_at_step`` is not within the run.
    """
    if not 1 <= kill_at_step <= config.max_steps:
        raise ValueError(f"--kill-at-step should be between 1 and --max-steps {config.max_steps}, got {kill_at_step}")
    base = Path(config.run_dir)
    straight = replace(config, run_dir=str(base / "uninterrupted"), resume="never", progress=False)
    killed = replace(straight, run_dir=str(base / "interrupted"))
    elastic = {
        1: replace(killed, run_dir=str(base / "elastic-1"), resume="auto", elastic="global-batch"),
        (nproc or 1) + 1: replace(killed, run_dir=str(base / f"elastic-{(nproc or 1) + 1}"), resume="auto"),
    }
    for folder in (straight.run_dir, killed.run_dir, *(e.run_dir for e in elastic.values())):
        shutil.rmtree(folder, ignore_errors=True)  # every run must start from nothing
    ranks = f" on {nproc} ranks (torchrun)" if nproc else ""
    print(f"verify-resume: {config.max_steps} steps{ranks}, killed with SIGKILL during step {kill_at_step}", flush=True)
    # The elastic resumes start from copies of the killed run's folder, as it was left.
    if not _run_jobs(straight, killed, kill_at_step, nproc, [e.run_dir for e in elastic.values()] if nproc else []):
        return False
    all_same = _compare_losses(straight, killed, kill_at_step) & _compare_final(straight, killed)
    print("PASS: the resumed run is identical to the uninterrupted one" if all_same else "FAIL: the runs differ")
    if nproc:
        for world, target in elastic.items():
            all_same &= _verify_elastic(target, nproc, world)
    if random_kills:
        all_same &= verify_random_kills(config, random_kills, nproc)
    return all_same


def verify_random_kills(config: TrainConfig, kills: int, nproc: int | None = None) -> bool:
    """``python -m resumable_data verify`` on ``config``: ``kills`` SIGKILLs from outside at random
    steps, each launch resuming with ``--resume auto``, every step's batches and loss compared.

    The runs go under ``RUN_DIR/random-kills``; the trainer must import from the working directory
    (the checkout's root), which ``verify`` puts on ``PYTHONPATH``.
    """
    launcher = [
        sys.executable,
        *(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []),
    ]
    run = replace(config, run_dir=audit.RUN_DIR, resume="auto", progress=False)
    work = Path(config.run_dir) / "random-kills"
    shutil.rmtree(work, ignore_errors=True)
    print(f"random kills: resumable_data verify with {kills} SIGKILLs, in {work}", flush=True)
    command = [*launcher, "-m", "trainer", "train", *config_to_argv(run)]
    return audit.verify(command, kills=kills, work_dir=work, timeout=JOB_TIMEOUT_S).passed


def _run_jobs(straight: TrainConfig, killed: TrainConfig, kill_at: int, nproc: int | None, copies: list[str]) -> bool:
    """Train uninterrupted; train killed during step ``kill_at``, copy its folder to each of
    ``copies``, and resume it. True when each exited as it should."""
    codes = {
        "uninterrupted": _run(straight, "uninterrupted", nproc),
        "killed": _run(killed, "killed", nproc, kill_at=kill_at),
    }
    for copy in copies:
        shutil.copytree(killed.run_dir, copy)
    codes["resumed"] = _run(replace(killed, resume="auto"), "resumed", nproc)
    # torchrun reports a rank killed by a signal as its own exit code 1.
    expected = {"uninterrupted": 0, "killed": 1 if nproc else -signal.SIGKILL, "resumed": 0}
    if codes != expected:
        print(f"FAIL: exit codes {codes}, expected {expected}; see the *.log files under {Path(killed.run_dir).parent}")
    return codes == expected


def _compare_losses(straight: TrainConfig, killed: TrainConfig, kill_at: int) -> bool:
    """Print every step's loss of both runs (each attempt of a step run twice); True when all are equal."""
    reference = {e["step"]: e["loss"] for e in read_metrics(straight.run_dir) if e["event"] == "step"}
    attempts: dict[int, list[float]] = {}
    resumed_at = []
    for event in read_metrics(killed.run_dir):
        if event["event"] == "step":
            attempts.setdefault(event["step"], []).append(event["loss"])
        elif event["event"] == "resume":
            resumed_at.append(event["step"])
    # Without a checkpoint before the kill, the second launch simply started again from scratch.
    restart = resumed_at[0] if resumed_at else 0
    origin = f"step {restart}" if resumed_at else "scratch (no checkpoint yet)"
    print(f"resumed from {origin}; steps {restart + 1}..{kill_at - 1} ran twice")
    print(f"{'step':>6}  {'uninterrupted':>14}  {'killed / resumed':>34}  same")
    all_same = True
    for step in range(1, straight.max_steps + 1):
        got = attempts.get(step, [])
        same = bool(got) and all(loss == reference.get(step) for loss in got)
        all_same &= same
        shown = " / ".join(f"{loss:.10f}" for loss in got) or "missing"
        print(f"{step:>6}  {reference.get(step, float('nan')):>14.10f}  {shown:>34}  {'yes' if same else 'NO'}")
    return all_same


def _compare_final(straight: TrainConfig, resumed: TrainConfig) -> bool:
    """The final model and optimizer states (file format) and every rank's final weights, compared."""
    all_same = True
    if straight.checkpoint_format == "file":
        final_a, final_b = _final_state(Path(straight.run_dir)), _final_state(Path(resumed.run_dir))
        for key in (MODEL, OPTIMIZER):
            diff = first_difference(final_a[key], final_b[key], key)
            print(f"final {key} state: {'bitwise identical' if diff is None else 'DIFFERS at ' + diff}")
            all_same &= diff is None
    digests = {
        name: _end_event(run)["rank_weights"] for name, run in (("uninterrupted", straight), ("resumed", resumed))
    }
    same_weights = len({d for ds in digests.values() for d in ds}) == 1
    print(
        f"final weights of every rank of both runs: {'identical' if same_weights else 'DIFFER: ' + json.dumps(digests)}"
    )
    return all_same and same_weights


def _end_event(config: TrainConfig) -> dict[str, Any]:
    ends = [e for e in read_metrics(config.run_dir) if e["event"] == "end"]
    return ends[-1] if ends else {"rank_weights": ["(no end event)"]}


def _verify_elastic(config: TrainConfig, old_world: int, world: int) -> bool:
    """Resume the killed run's copy on ``world`` ranks; check that no sample is read twice in an
    epoch and that an epoch completed across the resume misses only its trimmed tail."""
    label = f"elastic {old_world}->{world} ({config.elastic})"
    code = _run(config, f"elastic-{world}", world)
    if code != 0:
        print(f"FAIL: {label}: exit code {code}; see {config.run_dir}/elastic-{world}.log")
        return False
    resumes = [e for e in read_metrics(config.run_dir) if e["event"] == "resume"]
    step = resumes[-1]["step"]
    print(f"{label}: resumed at step {step}; the log says {resumes[-1]['changes']}, rng: {resumes[-1]['rng']}")
    if document_files(config.data):  # the index log records dataset indices, which a stream has not
        print(f"{label}: resumed and finished; reading each document at most once is not checked for streams")
        return True
    per_epoch: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for path in Path(config.run_dir).glob(index_log.FILE_NAME.format(rank="*")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            before = record["step"] <= step and record["world_size"] == old_world
            after = record["step"] > step and record["world_size"] == world
            if before or after:
                per_epoch[record["epoch"]].update(record["indices"])
    data = prepare_data(config.data, Path(config.cache_dir) if config.cache_dir else default_cache_dir())
    length = len(TokenWindows(data.train, config.block_size or ModelConfig().block_size))
    # drop_last trims less than one batch (plus the uneven remainder) per rank from an epoch's end.
    tail = max(old_world, world) * (config.batch_size + 1)
    ok, completed = True, False
    for epoch, counts in sorted(per_epoch.items()):
        twice = sorted(i for i, n in counts.items() if n > 1)
        complete = epoch + 1 in per_epoch
        completed |= complete
        missing = length - len(counts)
        good = not twice and (not complete or missing < tail)
        ok &= good
        state = "complete" if complete else "partial"
        print(
            f"  epoch {epoch} ({state}): {len(counts)} of {length} samples, read twice: {twice or 'none'}, "
            f"missing: {missing if complete else '-'}  {'ok' if good else 'FAIL'}"
        )
    print(
        f"{'PASS' if ok else 'FAIL'}: {label} reads every sample of the interrupted epoch at most once"
        + (" and completes the epoch (but its trimmed tail)" if ok and completed else "")
    )
    return ok
