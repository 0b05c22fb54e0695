"""On CUDA: the trainer under torchrun with NCCL (DDP), and FSDP2 (``fully_shard``) with DCP.

One rank per GPU (NCCL refuses two ranks on one device), up to 2. With ``--deterministic`` a run
stopped and resumed equals the uninterrupted one bitwise, as on CPU.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_ddp_trainer import torchrun

from helpers.trainer_runs import end_weights, losses, tiny
from trainer.checkpointing import DCP_FOLDER

pytestmark = pytest.mark.gpu


def nproc() -> int:
    return max(1, min(2, torch.cuda.device_count()))


@pytest.mark.parametrize(
    "options",
    [
        {"checkpoint_format": "file"},  # DDP over NCCL, rank 0 writes a weights_only file
        {"checkpoint_format": "dcp", "fsdp": True},  # FSDP2 shards, each rank writes its own
    ],
    ids=["ddp-nccl-file", "fsdp2-dcp"],
)
def test_cuda_run_stopped_and_resumed_equals_uninterrupted(tmp_path: Path, options: dict) -> None:
    n = nproc()
    config = tiny(tmp_path, "straight", device="cuda", deterministic=True, **options)
    assert torchrun(config, n) == 0
    weights = end_weights(config.run_dir)
    assert len(weights) == n and len(set(weights)) == 1  # every rank ends with the same weights

    stopped = replace(config, run_dir=str(tmp_path / "stopped"))
    assert torchrun(replace(stopped, stop_at=9), n) == 0
    if options["checkpoint_format"] == "dcp":
        assert (Path(stopped.run_dir) / DCP_FOLDER / "step-00000009" / ".metadata").is_file()
    assert torchrun(stopped, n) == 0
    assert losses(stopped.run_dir) == losses(config.run_dir)
    assert end_weights(stopped.run_dir) == weights
