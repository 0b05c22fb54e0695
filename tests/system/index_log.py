"""A log of the dataset indices each rank trained on, at each step: test instrumentation.

``verify-resume --nproc N`` and the torchrun tests check that an elastic resume reads every sample
of the interrupted epoch exactly once, which needs the indices of every micro-batch of every step
on every rank. The trainer does not log them itself; :func:`install`, called before the trainer
starts (``TRAINER_INDEX_LOG=FOLDER python -m system.killpoints train ...``), observes it from the
outside through public hooks:

- each batch a ``ResumableDataLoader`` yields is preceded by ``peek_indices(1)`` (which changes
  nothing), and its epoch read after it;
- the records are written when the optimizer step that used them begins (a global optimizer step
  pre-hook), numbered by the optimizer's own step count, which a resume restores. Batches of a
  step that never ran (the process died first) are not written.

Each rank appends JSON lines ``{"step", "epoch", "world_size", "indices"}`` to
``FOLDER/indices.rankR.jsonl``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from resumable_data import ResumableDataLoader

__all__ = ["ENV", "FILE_NAME", "install"]

ENV = "TRAINER_INDEX_LOG"
FILE_NAME = "indices.rank{rank}.jsonl"  # FILE_NAME.format(rank="*") globs every rank's


def _steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps taken so far: Adam(W) counts them in every parameter's state (0 before the first)."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def install(folder: str | os.PathLike[str]) -> None:
    """Record every batch of every ``ResumableDataLoader`` in this process; see the module docstring.

    Rank and world size come from torchrun's environment (``RANK``, ``WORLD_SIZE``; 0 and 1 without).
    """
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    path = Path(folder) / FILE_NAME.format(rank=rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process, line-buffered
    pending: list[dict[str, Any]] = []
    real_iter = ResumableDataLoader.__iter__

    def recording_iter(loader: ResumableDataLoader) -> Iterator[Any]:
        batches = real_iter(loader)
        while True:
            upcoming = loader.peek_indices(1)
            try:
                batch = next(batches)
            except StopIteration:
                return
            pending.append({"epoch": loader.epoch, "indices": upcoming[0]})
            yield batch

    def write_pending(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        step = _steps_taken(optimizer) + 1
        for record in pending:
            out.write(json.dumps({"step": step, "world_size": world_size, **record}) + "\n")
        pending.clear()

    ResumableDataLoader.__iter__ = recording_iter  # type: ignore[method-assign]
    register_optimizer_step_pre_hook(write_pending)
