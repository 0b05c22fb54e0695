"""Lightning with ResumeCallback over the settings users combine: a fit SIGKILLed at a chosen point and
resumed with ``ckpt_path="last"`` logs every training loss and validation loss of an uninterrupted fit
and ends with its weights, bitwise.

The settings are validation cadence (``val_check_interval`` None / batches / a fraction), the validation
loader (none, a shuffled ``DataLoader`` that draws from the global RNGs, a ``ResumableDataLoader``),
``ModelCheckpoint`` (``every_n_train_steps``, ``every_n_epochs``, ``save_last`` alone),
``limit_train_batches``, ``max_epochs`` or ``max_steps``, accumulation, workers, and where the kill falls
(mid-epoch, after an epoch's last step, inside a validation). Their full product is thousands of fits
of several seconds each; the cases are an all-pairs cover of it (every value of every setting meets
every value of every other in some case), built greedily and deterministically. All of them run
with ``--runslow``: the default suite keeps the SIGKILLed subprocess fit of the window matrix below,
and tests/integrations/test_lightning.py fits each kill point of this one in-process (mid-epoch, an
epoch's end, a validation right after the checkpoint) in well under a second each.

The accumulation phase of the save point has its own matrix: ``trainer.save_checkpoint`` at every
micro-batch of a gradient-accumulation window (from ``on_train_batch_end``, or from a signal handler
that lands in the micro-batch's training step, as a preemption notice does), in the middle of an epoch
and in an epoch's first window, SIGKILL right after the save, resume from it. One case runs in the
default suite, the rest and two on two ddp processes with ``--runslow``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from integrations_harness import kill_and_resume  # first: makes torchvision importable

pytest.importorskip("lightning", reason="the [lightning] extra is not installed")

# isort: split
from lightning_train import CHECKPOINTS, SAVES, read_validation

# The values of each setting, the most telling first (the cover's first cases take them).
AXES: dict[str, tuple[Any, ...]] = {
    "validation": ("plain", "resumable", "none"),
    "val_check_interval": (4, 0.5, None),
    "checkpoint": CHECKPOINTS,
    "limit_train_batches": (5, None, 0.75),
    "stop": ("max_epochs", "max_steps"),
    "accumulation": (2, 1),
    "workers": (0, 2),
    "kill": ("epoch-end", "validation", "mid-epoch"),
}
_BATCHES = 12  # lightning_train.py: 48 samples in batches of 4
_DEFAULT_CASES = 0  # subprocess fits take 12 s each on CI's 2 cores: the default suite runs the window case only


def _valid(case: dict[str, Any]) -> bool:
    """Without validation there is no cadence to set and no validation to kill."""
    return case["validation"] != "none" or (case["val_check_interval"] is None and case["kill"] != "validation")


def _pairs(case: dict[str, Any]) -> set[tuple[tuple[str, Any], tuple[str, Any]]]:
    return set(itertools.combinations(case.items(), 2))


def _all_pairs_cover() -> list[dict[str, Any]]:
    """Cases such that every pair of values that some valid case combines is in at least one of them."""
    product = [dict(zip(AXES, values, strict=True)) for values in itertools.product(*AXES.values())]
    product = [case for case in product if _valid(case)]
    uncovered = set().union(*map(_pairs, product))
    cover = []
    while uncovered:
        best = max(product, key=lambda case: len(_pairs(case) & uncovered))  # the first of the best: stable
        uncovered -= _pairs(best)
        cover.append(best)
    return cover


def _arguments(case: dict[str, Any]) -> tuple[int, list[str]]:
    """``lightning_train.py``'s kill step and flags for ``case``."""
    limit = case["limit_train_batches"]
    batches = _BATCHES if limit is None else limit if isinstance(limit, int) else int(_BATCHES * limit)
    steps = math.ceil(batches / case["accumulation"])  # optimizer steps an epoch (its last batch steps)
    # Every kill falls in the second epoch, after a checkpoint of every kind has been written.
    kill_at = {"epoch-end": 2 * steps, "validation": steps + 1, "mid-epoch": steps + math.ceil(steps / 2)}[case["kill"]]
    stop = (
        ["--max-epochs", "3"]
        if case["stop"] == "max_epochs"
        else ["--max-epochs", "-1", "--max-steps", str(2 * steps + 1)]
    )
    flags = [
        *stop,
        *("--validation", case["validation"], "--checkpoint", case["checkpoint"], "--save-every", "2"),
        *("--val-check-interval", str(case["val_check_interval"]).lower()),
        *("--limit-train-batches", str(limit).lower()),
        *("--accumulation", str(case["accumulation"]), "--workers", str(case["workers"])),
        *("--kill-in", "validation" if case["kill"] == "validation" else "train"),
    ]
    return kill_at, flags


def _id(case: dict[str, Any]) -> str:
    return "-".join(f"{name}={value}" for name, value in case.items())


def _params() -> Iterator[Any]:
    defaults = 0
    for case in _all_pairs_cover():
        marks = []
        if defaults == _DEFAULT_CASES:
            marks.append(pytest.mark.slow)
        else:
            defaults += 1
        yield pytest.param(case, marks=marks, id=_id(case))


def _assert_same_validations(run: Path, reference: Path) -> None:
    """Every validation loss the resumed fit logged is the uninterrupted fit's, and only one validation is
    missing at most: Lightning does not repeat the one due right after the checkpoint it resumes from
    (``_TrainingEpochLoop.advance`` fast-forwards past it), although the uninterrupted fit ran it."""
    got, want = read_validation(run), read_validation(reference)
    assert {key: want.get(key) for key in got} == got
    assert len({step for step, _ in want.keys() - got.keys()}) <= 1, sorted(want.keys() - got.keys())


@pytest.mark.parametrize("case", list(_params()))
def test_a_killed_fit_resumes_to_the_uninterrupted_losses_validations_and_weights(
    tmp_path: Path, case: dict[str, Any]
) -> None:
    kill_at, flags = _arguments(case)
    kill_and_resume("lightning_train.py", tmp_path, kill_at, *flags)
    _assert_same_validations(tmp_path / "run", tmp_path / "reference")


def _phase_cases() -> Iterator[dict[str, Any]]:
    """Every micro-batch of a window for each accumulation, save route, window and workers.

    ``phase``: micro-batches of the window trained when a save from ``on_train_batch_end`` is written
    (0: the previous window's last, right after its optimizer step), or the micro-batch in whose training
    step the signal lands (1 to ``accumulation``; the last is inside the optimizer step's closure).
    """
    for accumulation in (2, 3):
        for save in SAVES:
            phases = range(accumulation) if save == "batch-end" else range(1, accumulation + 1)
            for phase, window, workers in itertools.product(phases, ("mid-epoch", "epoch-start"), (0, 2)):
                yield {"accumulation": accumulation, "save": save, "phase": phase, "window": window, "workers": workers}


_DEFAULT_PHASE_CASE = {"accumulation": 3, "save": "signal", "phase": 2, "window": "mid-epoch", "workers": 0}
_DDP_PHASE_CASES = [
    {"accumulation": 2, "save": "batch-end", "phase": 1, "window": "mid-epoch", "workers": 0},
    {"accumulation": 3, "save": "signal", "phase": 3, "window": "epoch-start", "workers": 0},
]


def _phase_params() -> Iterator[Any]:
    for case in _phase_cases():
        marks = [] if case == _DEFAULT_PHASE_CASE else [pytest.mark.slow]
        yield pytest.param(case, 1, marks=marks, id=_id(case))
    for case in _DDP_PHASE_CASES:
        yield pytest.param(case, 2, marks=[pytest.mark.slow], id=f"ddp-{_id(case)}")


@pytest.mark.parametrize(("case", "devices"), list(_phase_params()))
def test_a_fit_killed_after_a_save_inside_an_accumulation_window_resumes_bitwise(
    tmp_path: Path, case: dict[str, Any], devices: int
) -> None:
    accumulation = case["accumulation"]
    batches = _BATCHES // devices  # per rank: the ResumableDataLoader shards by rank
    # Windows start at multiples of the accumulation in each epoch; the second epoch's windows here.
    start = batches + (accumulation if case["window"] == "mid-epoch" else 0)
    save_at = start + case["phase"] - 1  # the fit's micro-batch (counted over epochs, from 0)
    flags = ["--max-epochs", "2", "--accumulation", str(accumulation), "--workers", str(case["workers"])]
    flags += ["--save-at", str(save_at), "--save-in", case["save"], "--devices", str(devices)]
    kill_and_resume("lightning_train.py", tmp_path, 0, *flags, ranks=devices)
