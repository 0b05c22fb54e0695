"""The HF Trainer settings users combine, each SIGKILLed and resumed: every training loss and every
evaluation loss logged after the resume, and the final weights, equal an uninterrupted run's bitwise.

The matrix is the product of: when Trainer saves (every few steps, on each epoch's last step, per
epoch) and evaluates (never, on the save steps, on other steps, per epoch); gradient accumulation 1
or 3 (11 micro-batches an epoch: with 3, the epoch ends in a group of 2); where the kill falls
(mid-epoch, on an epoch's last step before its save, right after a save and the evaluation that
follows it, in the middle of Trainer writing a checkpoint); and the DataLoader's workers with
``save_total_limit`` (0 workers and every checkpoint kept, or 2 workers and only the newest kept:
the rotation then runs on every save after the resume). A sampled handful runs in the default
suite, the rest with ``--runslow``.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the [transformers] extra is not installed")

from integrations_harness import kill_and_resume

_MICRO_BATCHES = 11  # 44 samples in batches of 4
_EPOCHS = 3


@dataclass(frozen=True)
class _Case:
    save: str  # "steps" (every few steps), "epoch-end" (steps: each epoch's last step), "epoch"
    evaluate: str  # "no", "on-save", "off-save", "epoch"
    accumulation: int
    kill: str  # "mid-epoch", "epoch-end", "after-save", "in-save"
    workers: int
    save_total_limit: int | None

    @property
    def steps_per_epoch(self) -> int:
        return -(-_MICRO_BATCHES // self.accumulation)

    @property
    def save_steps(self) -> int:
        return {1: 4, 3: 3}[self.accumulation] if self.save == "steps" else self.steps_per_epoch

    def saved_at(self) -> list[int]:
        return list(range(self.save_steps, _EPOCHS * self.steps_per_epoch + 1, self.save_steps))

    def kill_at(self) -> int:
        """A step of the second epoch, after at least one checkpoint."""
        epoch = self.steps_per_epoch
        if self.kill == "mid-epoch":
            return min(k for k in range(epoch + 2, 2 * epoch) if k not in self.saved_at())
        if self.kill == "epoch-end":
            return 2 * epoch
        return max(k for k in self.saved_at() if k <= 2 * epoch)  # after-save, in-save

    def flags(self) -> list[str]:
        save_strategy = "epoch" if self.save == "epoch" else "steps"
        off_save = {1: 3, 3: 2}[self.accumulation]
        eval_strategy, eval_steps = {
            "no": ("no", None),
            "on-save": (save_strategy, self.save_steps),
            "off-save": ("steps", off_save),
            "epoch": ("epoch", None),
        }[self.evaluate]
        flags = [
            *("--accumulation", str(self.accumulation)),
            *("--workers", str(self.workers)),
            *("--save-strategy", save_strategy, "--save-steps", str(self.save_steps)),
            *("--eval-strategy", eval_strategy),
            *("--kill-when", "step-end" if self.kill in ("mid-epoch", "epoch-end") else self.kill),
        ]
        if eval_steps is not None:
            flags += ["--eval-steps", str(eval_steps)]
        if self.save_total_limit is not None:
            flags += ["--save-total-limit", str(self.save_total_limit)]
        return flags

    def __str__(self) -> str:
        limit = f"-limit{self.save_total_limit}" if self.save_total_limit else ""
        return f"save-{self.save}-eval-{self.evaluate}-acc{self.accumulation}-kill-{self.kill}-w{self.workers}{limit}"


_CADENCES = [
    (save, evaluate)
    for save in ("steps", "epoch-end", "epoch")
    for evaluate in ("no", "on-save", "off-save", "epoch")
    if not (save == "epoch" and evaluate == "on-save")  # that is "epoch"
]
_CASES = [
    _Case(save, evaluate, accumulation, kill, workers, limit)
    for (save, evaluate), accumulation, kill, (workers, limit) in itertools.product(
        _CADENCES, (1, 3), ("mid-epoch", "epoch-end", "after-save", "in-save"), ((0, None), (2, 1))
    )
]


# All with --runslow: the accumulation-window case below is the default suite's (CI's 5 minutes). Two of
# these failed on main when they were found: an evaluation after a checkpoint on an epoch's last step
# (save-epoch-end-eval-epoch-acc3-kill-mid-epoch-w0) and a kill in the middle of Trainer's checkpoint
# write (save-steps-eval-off-save-acc3-kill-in-save-w2-limit1).
@pytest.mark.slow
@pytest.mark.parametrize("case", _CASES, ids=str)
def test_a_killed_trainer_run_resumes_bitwise_in_every_configuration(tmp_path: Path, case: _Case) -> None:
    kill_and_resume("hf_trainer_train.py", tmp_path, case.kill_at(), *case.flags())


# -- the accumulation phase of the kill -----------------------------------------------------------
# With gradient accumulation 3 and 11 micro-batches a process and epoch, every epoch has 4 steps of
# 3, 3, 3 and 2 micro-batches; a save every 3 steps puts checkpoint-6 in the second epoch. The kill
# lands inside the window of step 7 (after its micro-batch 0, 1 or 2: the last one after its backward,
# before the optimizer step) or of step 8, the epoch's short last window (after micro-batch 0 or 1).
# Trainer saves only after optimizer steps, so the resume starts from checkpoint-6 and computes the
# killed window's gradient again from its first micro-batch. Two processes get 88 samples: the same
# 11 micro-batches each.
@dataclass(frozen=True)
class _Phase:
    step: int  # the optimizer step whose window the kill lands in
    phase: int  # the micro-batch of that window after which the run is killed
    workers: int
    processes: int

    def flags(self) -> list[str]:
        return [
            *("--accumulation", "3", "--save-steps", "3", "--workers", str(self.workers)),
            *("--length", str(44 * self.processes), "--kill-when", "micro", "--kill-phase", str(self.phase)),
        ]

    def __str__(self) -> str:
        return f"step{self.step}-micro{self.phase}-w{self.workers}-p{self.processes}"


_PHASES = [
    _Phase(step, phase, workers, processes)
    for (step, phase), workers, processes in itertools.product(((7, 0), (7, 1), (7, 2), (8, 0), (8, 1)), (0, 2), (1, 2))
]
_PHASE_SAMPLED = random.Random(45).choice([case for case in _PHASES if case.processes == 1 and case.workers == 0])


@pytest.mark.parametrize(
    "case",
    [case if case == _PHASE_SAMPLED else pytest.param(case, marks=pytest.mark.slow) for case in _PHASES],
    ids=str,
)
def test_a_trainer_run_killed_inside_an_accumulation_window_resumes_bitwise(tmp_path: Path, case: _Phase) -> None:
    kill_and_resume("hf_trainer_train.py", tmp_path, case.step, *case.flags(), processes=case.processes, timeout=300)
    # Where the kill landed and where the resume began: the log is the killed run's, then the resumed
    # run's, whose micro-batches are numbered step * 100 + i from checkpoint-6 on; the resumed run
    # begins at the first number that does not exceed the one before it.
    for log in (tmp_path / "run").glob("losses*.jsonl"):
        steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
        killed = next(i for i in range(len(steps) - 1) if steps[i + 1] <= steps[i])
        assert (steps[killed], steps[killed + 1]) == ((case.step - 1) * 100 + case.phase, 600), log.name
