"""Lightning with ResumeCallback over the settings users combine: a fit SIGKILLed at a chosen point and
resumed with ``ckpt_path="last"`` logs every training loss and validation loss of an uninterrupted fit
and ends with its weights, bitwise.

The settings are validation cadence (``val_check_interval`` None / batches / a fraction), the validation
loader (none, a shuffled ``DataLoader`` that draws from the global RNGs, a ``ResumableDataLoader``),
``ModelCheckpoint`` (``every_n_train_steps``, ``every_n_epochs``, ``save_last`` alone),
``limit_train_batches``, ``max_epochs`` or ``max_steps``, accumulation, workers, and where the kill falls
(mid-epoch, after an epoch's last step, inside a validation). Their full product is thousands of fits
of several seconds each; the cases are an all-pairs cover of it (every value of every setting meets
every value of every other in some case), built greedily and deterministically. The first three run
in the default suite, the rest with ``--runslow``.
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
from lightning_train import CHECKPOINTS, read_validation

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
_DEFAULT_CASES = 3  # subprocess fits take seconds each: the default suite runs this many


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
