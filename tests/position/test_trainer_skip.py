"""The reference trainer's ``--skip-batches N``: the same move as ``python -m resumable_data skip``.

Resuming from step 4 with ``--skip-batches 3`` and resuming from the checkpoint ``skip --batches 3``
published train the same steps on the same data, bitwise (weights, optimizer, data state), and the
data state says which batches were skipped. Without a checkpoint the flag is refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers.trainer_runs import final_checkpoint, tiny
from resumable_data import ResumeError
from resumable_data.__main__ import main as resumable_data_main
from resumable_data.testing import assert_same
from trainer.checkpointing import CHECKPOINT_FOLDER
from trainer.train import train

BATCH = 4  # TINY's batch size, one rank, no gradient accumulation: a step is a batch of 4 windows


def test_skip_batches_on_resume_is_the_skip_command_on_the_checkpoint(tmp_path: Path) -> None:
    train(tiny(tmp_path, "first", stop_at=4))
    shutil.copytree(tmp_path / "first", tmp_path / "flag")
    shutil.copytree(tmp_path / "first", tmp_path / "command")
    train(tiny(tmp_path, "flag", stop_at=8, skip_batches=3))
    step_4 = tmp_path / "command" / CHECKPOINT_FOLDER / "step-00000004"
    assert resumable_data_main(["skip", str(step_4), "--batches", "3"]) == 0
    train(tiny(tmp_path, "command", stop_at=8))
    by_flag, by_command = final_checkpoint(tmp_path / "flag"), final_checkpoint(tmp_path / "command")
    assert by_flag["train_state"]["step"] == by_command["train_state"]["step"] == 8
    for key in ("model", "optimizer", "dataloader", "lr_scheduler"):
        assert_same(by_flag[key], by_command[key], f"{key} after --skip-batches vs after the skip command")
    data = by_flag["dataloader"]
    # 4 batches read, 3 skipped, 4 read: the skipped range is the 5th to 7th batch's positions.
    assert data["skipped"] == [[4 * BATCH, 7 * BATCH]] and data["position"] == 11 * BATCH


def test_skip_batches_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ResumeError, match="--skip-batches 2: no checkpoint to resume from"):
        train(tiny(tmp_path, "fresh", skip_batches=2))
