"""chaos --nproc N: SIGKILL ranks and the torchrun agent of a DCP run again and again, relaunch, compare.

The distributed counterpart of :mod:`system.chaos`. A tiny model trains once under ``torchrun``
straight through (the reference, every checkpoint kept). Then runs of the same configuration are
killed again and again and relaunched *at once* with ``--resume auto``, as a cluster requeues a
job, until each finishes. A kill is one of, in turn:

- a rank (by start order: any of them) or the torchrun agent SIGKILLed at a random moment of the
  run; an agent's ranks must exit by themselves (:func:`resumable_data.torchrun.watch_parent`);
- rank 0 SIGKILLed at an aimed moment of a checkpoint write (:mod:`system.killpoints`): mid
  ``trainer.pt``, just after it is synced, manifest synced, just before and after the publishing
  rename, a step folder moved aside or half deleted by pruning.

Launches alternate ``--num-workers`` 0 and 2. Checked, as in the single-process harness: every
relaunch starts (none refused by a lock); no checkpoint lost (after each kill the newest valid
checkpoint is at least the newest one the killed job had finished); every checkpoint that verifies
holds exactly the reference's state for its step (its DCP shards, converted with DCP's public
``dcp_to_torch_save``, and its ``trainer.pt``), and the relaunch resumes from the newest of them;
every logged loss and the final state equal the uninterrupted run's, bitwise.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from helpers.trainer_runs import text_corpus, tiny
from resumable_data import ResumeError
from resumable_data.checkpoint import DcpStore
from resumable_data.checkpoint.manifest import dcp_checkpoint_problem
from trainer.checkpointing import DCP_FOLDER
from trainer.config import TrainConfig
from trainer.dcp_store import EXTRAS_NAME
from trainer.metrics import read_metrics

from .chaos import (
    CHAOS_RUN,
    CORPUS_BYTES,
    ChaosReport,
    Checkpoints,
    Launch,
    run_session,
    start_logged,
    wait_for,
)
from .killpoints import ENTRY
from .verify import config_to_argv

__all__ = ["DISTRIBUTED_PLAN", "chaos_distributed"]

# Kill points in turn: random moments (any rank, the agent) between aimed moments of a DCP write.
DISTRIBUTED_PLAN = (
    *("rank-at-seconds", "payload-half", "agent-at-seconds", "prune-half", "rank-at-seconds", "manifest-synced"),
    *("before-publish", "agent-at-seconds", "after-publish", "rank-at-seconds", "prune-aside", "payload-synced"),
)
LAUNCH_TIMEOUT_S = 400
# How long the ranks of a killed agent may outlive it.
ORPHAN_GRACE_S = 15
NO_KILL = "none"


def chaos_distributed(
    kills: int,
    run_dir: str | Path = "runs/chaos-dcp",
    *,
    nproc: int = 2,
    checkpoint_format: str = "dcp",
    seed: int = 0,
    log: Any = print,
) -> ChaosReport:
    """Kill, relaunch and compare until ``kills`` SIGKILLs have landed; see the module docstring.

    Args:
        kills: how many SIGKILLs to inject.
        run_dir: parent folder of the reference and the chaos runs (emptied first).
        nproc: ranks per job.
        checkpoint_format: ``dcp`` or ``dcp-async``.
        seed: fixes the kill moments and targets, so a failing session can be replayed.
        log: where progress lines go.

    Returns:
        The report; ``report.ok`` is False if any check failed.

    Raises:
        ValueError: ``kills`` < 1, ``nproc`` < 2 or a format other than DCP's.
    """
    if kills < 1 or nproc < 2 or checkpoint_format not in ("dcp", "dcp-async"):
        raise ValueError(
            f"chaos --nproc needs --kills >= 1, --nproc >= 2 and --checkpoint-format dcp or dcp-async, "
            f"but got --kills {kills} --nproc {nproc} --checkpoint-format {checkpoint_format}"
        )
    started = time.perf_counter()
    base = Path(run_dir)
    config, expected_losses, train_s = _reference_run(base, checkpoint_format, nproc, log)
    relaunch = lambda run, rng, report: _launch_until_finished(run, base, kills, train_s, nproc, rng, report)
    return run_session(kills, config, expected_losses, relaunch, DCP_CHECKPOINTS, seed=seed, log=log, started=started)


def _reference_run(
    base: Path, checkpoint_format: str, nproc: int, log: Any
) -> tuple[TrainConfig, dict[int, float], float]:
    """Empty ``base``, train the uninterrupted reference; its config, losses and training time."""
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    corpus = text_corpus(base, CORPUS_BYTES)
    config = tiny(base, "reference", data=corpus, checkpoint_format=checkpoint_format, **CHAOS_RUN)
    reference = replace(config, resume="never", keep_last=10**6)
    code = _torchrun(reference, Launch(NO_KILL, "0", 0, async_save=False), nproc).wait(timeout=LAUNCH_TIMEOUT_S)
    if code != 0:
        raise RuntimeError(f"the reference run failed with exit code {code}; see {base / 'reference' / 'launches.log'}")
    events = read_metrics(reference.run_dir)
    times = [e["time"] for e in events if e["event"] in ("start", "end")]
    train_s = times[-1] - times[0]
    log(f"chaos: {nproc}-rank {checkpoint_format} reference of {config.max_steps} steps trained in {train_s:.2f} s")
    return config, {e["step"]: e["loss"] for e in events if e["event"] == "step"}, train_s


def _launch_until_finished(
    run: TrainConfig, base: Path, kills: int, train_s: float, nproc: int, rng: random.Random, report: ChaosReport
) -> list[Launch]:
    """Launch ``run`` again and again, each launch armed with the plan's next kill, until one ends
    unkilled (or fails); every landed kill's checkpoint folder is kept as a snapshot."""
    launches: list[Launch] = []
    while True:
        attempt = report.total_kills
        if attempt < kills:
            point = DISTRIBUTED_PLAN[attempt % len(DISTRIBUTED_PLAN)]
            count = f"{rng.uniform(0.0, train_s):.3f}" if point.endswith("at-seconds") else str(rng.randint(1, 2))
        else:
            point, count = NO_KILL, "0"
        launch = Launch(point, count, num_workers=2 * (attempt % 2), async_save=run.checkpoint_format == "dcp-async")
        report.launches += 1
        launch.first_event = len(_events(run.run_dir))
        _run_launch(run, launch, nproc, rng, report)
        launches.append(launch)
        if not _killed_as_planned(run, base, launch, len(launches), report):
            return launches


def _run_launch(run: TrainConfig, launch: Launch, nproc: int, rng: random.Random, report: ChaosReport) -> None:
    """Start one launch, kill it at its random moment if it has one, and wait for its exit code."""
    process = _torchrun(replace(run, num_workers=launch.num_workers), launch, nproc)
    if launch.killpoint.endswith("at-seconds"):
        launch.killed = _kill_later(process, run.run_dir, launch, rng, nproc)
    wait_for(process, launch, run.run_dir, LAUNCH_TIMEOUT_S, report)


def _killed_as_planned(run: TrainConfig, base: Path, launch: Launch, number: int, report: ChaosReport) -> bool:
    """Whether the launch died of its kill (then snapshot its checkpoints: the run goes on); a
    launch that finished, failed or left orphans ends the run (failures are recorded)."""
    aimed = launch.killpoint != NO_KILL and not launch.killpoint.endswith("at-seconds")
    landed = launch.killed != "" or (aimed and _rank_sigkilled(run.run_dir))
    if launch.orphans:
        report.failures.append(
            f"{run.run_dir}: ranks {launch.orphans} outlived their killed agent by {ORPHAN_GRACE_S} s"
        )
        return False
    if landed and launch.exit_code != 0:
        report.kills[launch.killpoint] += 1
        report.kills_with_workers += launch.num_workers > 0
        launch.snapshot = base / "snapshots" / f"{Path(run.run_dir).name}-{number:02d}"
        if (Path(run.run_dir) / DCP_FOLDER).is_dir():
            shutil.copytree(Path(run.run_dir) / DCP_FOLDER, launch.snapshot, symlinks=True)
        else:  # killed before its first save
            launch.snapshot.mkdir(parents=True)
        return True
    if launch.exit_code != 0:
        output = (Path(run.run_dir) / "launches.log").read_text(errors="replace")
        if "locked by pid" in output:
            report.relaunches_refused += 1
        report.failures.append(f"{run.run_dir}: launch {number} exited with {launch.exit_code}; see launches.log")
    return False


def _torchrun(config: TrainConfig, launch: Launch, nproc: int) -> subprocess.Popen[bytes]:
    """``torchrun`` (c10d rendezvous, no restarts: the harness relaunches) of the trainer, armed
    on rank 0 with a kill point unless it is a random-moment kill or none."""
    train_argv = ["train", *config_to_argv(config)]
    aimed = launch.killpoint != NO_KILL and not launch.killpoint.endswith("at-seconds")
    entry = [*ENTRY, launch.killpoint, launch.count] if aimed else ["-m", "trainer"]
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--max-restarts=0"]
    command = [sys.executable, *launcher, "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", *entry, *train_argv]
    return start_logged(command, config.run_dir, f"{launch.killpoint} {launch.count} workers={launch.num_workers}")


def _kill_later(process: subprocess.Popen[bytes], run_dir: str, launch: Launch, rng: random.Random, nproc: int) -> str:
    """Once the launch has started training, wait ``launch.count`` seconds and SIGKILL a rank or the
    agent. Returns what was killed, or "" if the launch ended first."""
    starts = sum(e["event"] == "start" for e in _events(run_dir)[: launch.first_event])
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while process.poll() is None and time.monotonic() < deadline:
        if sum(e["event"] == "start" for e in _events(run_dir)) > starts:
            break
        time.sleep(0.02)
    time.sleep(float(launch.count))
    if process.poll() is not None:
        return ""
    if launch.killpoint == "agent-at-seconds":
        ranks = children(process.pid)
        process.send_signal(signal.SIGKILL)
        # Its ranks exit by themselves (their watchdog); the folder is judged once they are gone.
        deadline = time.monotonic() + ORPHAN_GRACE_S
        while time.monotonic() < deadline and any(alive(pid) for pid in ranks):
            time.sleep(0.05)
        launch.orphans = [pid for pid in ranks if alive(pid)]
        return "agent"
    ranks = sorted(children(process.pid))
    if not ranks:
        return ""
    target = rng.randrange(min(nproc, len(ranks)))
    try:
        os.kill(ranks[target], signal.SIGKILL)
    except ProcessLookupError:
        return ""
    return f"rank {target}"


def _rank_sigkilled(run_dir: str) -> bool:
    """Whether torchrun reported a rank killed by SIGKILL in the last launch's log."""
    text = (Path(run_dir) / "launches.log").read_text(errors="replace")
    return "(exitcode: -9)" in text.rsplit("\n$ ", 1)[-1]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs or still holds its files. A zombie whose threads have all exited counts
    as gone; a leader that is a zombie while another of its threads is still exiting does not: the
    threads share the file table, so its descriptors (and a lock on one) live until the last exits."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z" or len(list(Path(f"/proc/{pid}/task").iterdir())) > 1
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """The child processes of every thread of ``pid`` (Linux ``/proc``)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _events(run_dir: str) -> list[dict[str, Any]]:
    return read_metrics(run_dir) if (Path(run_dir) / "metrics.jsonl").is_file() else []


def _verified(snapshot: Path) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """Each DCP checkpoint of ``snapshot`` that verifies, with its step and whole state."""
    for folder in DcpStore(snapshot).checkpoints():
        if dcp_checkpoint_problem(folder, verify=True) is None:
            yield folder, int(folder.name.split("-")[1]), _state(folder)


def _newest_valid(folder: Path) -> int | None:
    """The step of the newest checkpoint in ``folder`` that verifies, as ``--resume auto`` picks it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        newest = DcpStore(folder).latest()
    return None if newest is None else int(newest.name.split("-")[1])


def _state(folder: Path) -> dict[str, Any]:
    """A verified checkpoint's whole state: its DCP shards (through DCP's own converter) and
    ``trainer.pt``. The shards unpickle: only the harness's own files are read here."""
    try:
        extras = DcpStore(folder.parent).load_payload(folder, EXTRAS_NAME)
    except ResumeError as e:
        return {"unreadable": str(e)}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(folder, Path(tmp) / "full.pt")
        shards = torch.load(Path(tmp) / "full.pt", weights_only=False)
    return {"shards": shards, "extras": extras}


DCP_CHECKPOINTS = Checkpoints(DCP_FOLDER, _state, _newest_valid, _verified)
