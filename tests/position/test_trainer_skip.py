"""The reference trainer's ``--skip-batches N``: the same move as ``python -m resumable_data skip``.

Resuming from step 4 with ``--skip-batches 3`` and resuming from the checkpoint ``skip --batches 3``
published train the same steps on the same data, bitwise (weights, optimizer, data state), and the
data state says which batches were skipped: over a text corpus (a map-style loader) and over token
shards (a StreamLoader, moved with its pipeline). Over documents (JSONL read by byte cursors, a shuffle
buffer, packing) the flag is refused, saying why; without a checkpoint too.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers.trainer_runs import final_checkpoint, tiny
from resumable_data import ResumeError
from resumable_data.__main__ import main as resumable_data_main
from resumable_data.position import skip
from resumable_data.streams import write_token_shards
from resumable_data.testing import assert_same
from trainer.checkpointing import CHECKPOINT_FOLDER
from trainer.shards import shard_index, shard_windows
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


def test_over_token_shards_the_flag_is_the_skip_of_the_stream_state(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    write_token_shards([np.arange(3000) % 251], tokens, shard_tokens=600, dtype=np.uint8)
    config = tiny(tmp_path, "first", data=tokens, stop_at=4)
    train(config)
    shutil.copytree(tmp_path / "first", tmp_path / "flag")
    shutil.copytree(tmp_path / "first", tmp_path / "command")
    train(tiny(tmp_path, "flag", data=tokens, stop_at=8, skip_batches=3))
    # The training script's stream, built as the trainer builds it: every shard but the validation one.
    index = shard_index(str(tokens))
    assert index is not None
    train_shards = dataclasses.replace(index, shards=index.shards[:-1])
    pipeline = shard_windows(train_shards, config.block_size, config)
    step_4 = tmp_path / "command" / CHECKPOINT_FOLDER / "step-00000004"
    skip(step_4, batches=3, pipeline=pipeline, batch_size=BATCH, drop_last=True)
    train(tiny(tmp_path, "command", data=tokens, stop_at=8))
    by_flag, by_command = final_checkpoint(tmp_path / "flag"), final_checkpoint(tmp_path / "command")
    for key in ("model", "optimizer", "dataloader", "lr_scheduler"):
        assert_same(by_flag[key], by_command[key], f"{key} after --skip-batches vs after skip")
    assert by_flag["dataloader"]["skipped"] == {"0": [[4, 7]]}
    assert by_flag["dataloader"]["batches"] == {"0": 11}


def test_over_documents_the_flag_is_refused_saying_why(tmp_path: Path) -> None:
    documents = tmp_path / "docs"
    documents.mkdir()
    for i in range(2):
        (documents / f"part-{i}.jsonl").write_text("".join(f'{{"text": "document {i} {j} " }}\n' for j in range(300)))
    train(tiny(tmp_path, "first", data=documents, stop_at=4))
    with pytest.raises(ResumeError, match=r"skip: ShardedIterable reads by per-shard cursors.*\.filter"):
        train(tiny(tmp_path, "first", data=documents, stop_at=8, skip_batches=1))
