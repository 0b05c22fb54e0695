"""verify-resume: prove on this machine that a killed and resumed run equals an uninterrupted one.

Three processes train the same configuration: one straight through; one that kills itself with
SIGKILL (no handler runs, nothing is flushed or saved) during step k; and one that resumes the
killed run from its newest checkpoint. The per-step losses of every attempt and the final weights
and optimizer state must be bitwise equal.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from resumable_data import CheckpointManager

from .train import CHECKPOINT_FOLDER, MODEL, OPTIMIZER, TrainConfig, read_metrics

__all__ = ["child_env", "config_to_argv", "first_difference", "verify_resume"]


def config_to_argv(config: TrainConfig) -> list[str]:
    """The ``python -m trainer train`` flags that reproduce ``config``."""
    argv = []
    for f in fields(config):
        value = getattr(config, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """Where two state dicts first differ (tensors compared bitwise), or None if they are equal."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        # Compare the bytes, so NaNs in the same places count as equal and -0.0 != 0.0.
        same = torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8))
        return None if same else f"{where}: values differ (max abs diff {(a.double() - b.double()).abs().max().item():.3e})"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys differ ({sorted(map(str, a.keys() ^ b.keys()))})"
        for key in a:
            diff = first_difference(a[key], b[key], f"{where}[{key!r}]")
            if diff is not None:
                return diff
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            diff = first_difference(x, y, f"{where}[{i}]")
            if diff is not None:
                return diff
        return None
    return None if a == b else f"{where}: {a!r} vs {b!r}"


def child_env() -> dict[str, str]:
    """The environment for a trainer subprocess: it must import this very trainer and library,
    installed or not."""
    source_root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")]))}


def _run(config: TrainConfig, label: str) -> int:
    """Train ``config`` in a fresh Python process; its output goes to ``RUN_DIR/LABEL.log``."""
    command = [sys.executable, "-m", "trainer", "train", *config_to_argv(config)]
    log = Path(config.run_dir) / f"{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"  {label}: {' '.join(command[1:])}", flush=True)
    with open(log, "w") as out:
        return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=child_env(), check=False).returncode


def _final_state(run_dir: Path) -> dict[str, Any]:
    with CheckpointManager(run_dir / CHECKPOINT_FOLDER, lock=False) as manager:
        return manager.load()


def verify_resume(config: TrainConfig, kill_at_step: int) -> bool:
    """Run the three processes under ``config.run_dir`` and print the comparison.

    Args:
        config: the training run to check (``run_dir`` is the parent of the two runs' folders).
        kill_at_step: the step during which the second run is killed.

    Returns:
        True when every step's loss and the final model and optimizer states are bitwise equal.

    Raises:
        ValueError: ``kill_at_step`` is not within the run.
    """
    if not 1 <= kill_at_step <= config.max_steps:
        raise ValueError(f"--kill-at-step should be between 1 and --max-steps {config.max_steps}, got {kill_at_step}")
    base = Path(config.run_dir)
    straight = replace(config, run_dir=str(base / "uninterrupted"), resume="never", progress=False)
    killed = replace(straight, run_dir=str(base / "interrupted"), crash_at_step=kill_at_step)
    for folder in (straight.run_dir, killed.run_dir):
        shutil.rmtree(folder, ignore_errors=True)  # both runs must start from nothing

    print(f"verify-resume: {config.max_steps} steps, killed with SIGKILL during step {kill_at_step}", flush=True)
    codes = {
        "uninterrupted": _run(straight, "uninterrupted"),
        "killed": _run(killed, "killed"),
        "resumed": _run(replace(killed, resume="auto", crash_at_step=None), "resumed"),
    }
    expected = {"uninterrupted": 0, "killed": -signal.SIGKILL, "resumed": 0}
    if codes != expected:
        print(f"FAIL: exit codes {codes}, expected {expected}; see the *.log files under {base}")
        return False

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
    print(f"resumed from {origin}; steps {restart + 1}..{kill_at_step - 1} ran twice")
    print(f"{'step':>6}  {'uninterrupted':>14}  {'killed / resumed':>34}  same")
    all_same = True
    for step in range(1, config.max_steps + 1):
        got = attempts.get(step, [])
        same = bool(got) and all(loss == reference.get(step) for loss in got)
        all_same &= same
        shown = " / ".join(f"{loss:.10f}" for loss in got) or "missing"
        print(f"{step:>6}  {reference.get(step, float('nan')):>14.10f}  {shown:>34}  {'yes' if same else 'NO'}")

    final_a, final_b = _final_state(Path(straight.run_dir)), _final_state(Path(killed.run_dir))
    for key in (MODEL, OPTIMIZER):
        diff = first_difference(final_a[key], final_b[key], key)
        print(f"final {key} state: {'bitwise identical' if diff is None else 'DIFFERS at ' + diff}")
        all_same &= diff is None
    print("PASS: the resumed run is identical to the uninterrupted one" if all_same else "FAIL: the runs differ")
    return all_same
