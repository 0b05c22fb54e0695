"""``--grad-accum``: a SIGKILL or a SIGTERM between two micro-batches of a window changes nothing.

The trainer checkpoints on optimizer-step boundaries only. A SIGKILL inside a window loses the
gradient its first micro-batches accumulated (it was never saved); the relaunch resumes from the
last checkpoint, trains those micro-batches again, and must end bitwise equal to a run never
interrupted: every step's loss, the final checkpoint (model, optimizer, scheduler, loader position,
RNG states, train state) and the final weights. A SIGTERM inside a window (a graceful stop) lets the
window finish: the trainer steps, saves on that boundary and exits, and the relaunch continues from
there. The signals come from the ``micro`` and ``micro-sigterm`` kill points
(:mod:`system.killpoints`), which fire at the forward of a chosen micro-batch, outside the trainer.

Every phase of a window (after its micro-batch 0, ..., GA-2) for ``--grad-accum`` 2 and 3, with 0 and
2 DataLoader workers, runs under ``--runslow``; the default suite samples one SIGKILL and one SIGTERM.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.trainer_runs import end_weights, final_checkpoint, losses, text_corpus, tiny
from resumable_data import CheckpointManager
from resumable_data.testing import assert_same
from system.killpoints import ENTRY
from system.verify import child_env, config_to_argv
from trainer.__main__ import DEFAULT_THREADS
from trainer.config import TrainConfig
from trainer.metrics import read_metrics
from trainer.train import TrainResult, train

# Checkpoints at steps 3, 6 (an evaluation) and 8; the signal arrives inside the window of step 5,
# so a SIGKILL resumes from step 3 and trains steps 4 and 5 again.
RUN = dict(max_steps=8, checkpoint_every=3, eval_every=6)
WINDOW = 5
LAUNCH_TIMEOUT_S = 120  # one tiny trainer launch takes seconds; a hung one must not hang the suite

# (grad_accum, micro-batches of the window trained before the signal, num_workers): every phase.
PHASES = [(ga, trained, workers) for ga in (2, 3) for trained in range(1, ga) for workers in (0, 2)]
SAMPLED_KILL, SAMPLED_TERM = (3, 2, 2), (3, 1, 0)


def sampled(default: tuple[int, int, int]) -> list[Any]:
    """Every phase; all but ``default`` only with ``--runslow``."""
    return [
        pytest.param(
            *phase, id="ga{}-after{}-workers{}".format(*phase), marks=() if phase == default else pytest.mark.slow
        )
        for phase in PHASES
    ]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The in-process runs compute with the launched trainer's thread count (its ``--threads`` default)."""
    before = torch.get_num_threads()
    torch.set_num_threads(DEFAULT_THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("corpus"), 1000)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Callable[[int], TrainResult]:
    """The uninterrupted run for a ``grad_accum``, trained once per module (workers change no batch)."""
    base, runs = tmp_path_factory.mktemp("reference"), {}

    def run(grad_accum: int) -> TrainResult:
        if grad_accum not in runs:
            runs[grad_accum] = train(tiny(base, f"ga{grad_accum}", data=corpus, grad_accum=grad_accum, **RUN))
        return runs[grad_accum]

    return run


def launch_signalled(config: TrainConfig, point: str, micro_batches: int) -> subprocess.CompletedProcess[str]:
    """``python -m trainer train`` that signals itself when micro-batch ``micro_batches + 1`` begins."""
    command = [sys.executable, *ENTRY, point, str(micro_batches), "train", *config_to_argv(config)]
    return subprocess.run(
        command, env=child_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, check=False
    )


def assert_same_run(reference: TrainResult, interrupted: Path, resumed: TrainResult) -> None:
    """Every step's loss, every attempt of a step run twice included, and the end state, bitwise."""
    attempts = [(e["step"], e["loss"]) for e in read_metrics(interrupted) if e["event"] == "step"]
    assert_same(reference.losses, {**losses(interrupted), **resumed.losses}, "losses")
    for step, loss in attempts:  # a step trained before the signal and again after the resume
        assert_same(reference.losses[step], loss, f"loss of step {step} before the signal")
    assert_same(final_checkpoint(reference.run_dir), final_checkpoint(interrupted), "final checkpoint")
    assert end_weights(interrupted) == end_weights(reference.run_dir)


@pytest.mark.parametrize(("grad_accum", "trained", "workers"), sampled(SAMPLED_KILL))
def test_sigkill_between_micro_batches_resumes_to_the_uninterrupted_run(
    tmp_path: Path, corpus: Path, reference: Callable[[int], TrainResult], grad_accum: int, trained: int, workers: int
) -> None:
    config = tiny(tmp_path, "run", data=corpus, grad_accum=grad_accum, num_workers=workers, **RUN)
    killed = launch_signalled(config, "micro", (WINDOW - 1) * grad_accum + trained)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    # It died inside the window of step WINDOW: the step before it was the last one taken.
    assert max(losses(config.run_dir)) == WINDOW - 1, killed.stdout + killed.stderr

    resumed = train(config)
    assert resumed.resumed_from is not None and CheckpointManager.step_of(resumed.resumed_from) == 3
    assert_same_run(reference(grad_accum), Path(config.run_dir), resumed)


@pytest.mark.parametrize(("grad_accum", "trained", "workers"), sampled(SAMPLED_TERM))
def test_sigterm_between_micro_batches_finishes_the_window_and_saves_on_its_boundary(
    tmp_path: Path, corpus: Path, reference: Callable[[int], TrainResult], grad_accum: int, trained: int, workers: int
) -> None:
    config = tiny(tmp_path, "run", data=corpus, grad_accum=grad_accum, num_workers=workers, **RUN)
    stopped = launch_signalled(config, "micro-sigterm", (WINDOW - 1) * grad_accum + trained)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "stopped by SIGTERM" in stopped.stdout
    # The window the signal arrived in was trained to its end, stepped and saved; nothing after it.
    assert max(losses(config.run_dir)) == WINDOW
    stops = [e for e in read_metrics(config.run_dir) if e["event"] == "stop"]
    assert [e["step"] for e in stops] == [WINDOW]

    resumed = train(config)
    assert resumed.resumed_from is not None and CheckpointManager.step_of(resumed.resumed_from) == WINDOW
    assert_same_run(reference(grad_accum), Path(config.run_dir), resumed)
