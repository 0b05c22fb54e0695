"""Checkpoints written with ``torch.distributed.checkpoint`` (``--checkpoint-format dcp`` / ``dcp-async``).

Layout: ``RUN_DIR/dcp/step-00000040/`` holds DCP's shards and ``.metadata`` (model, optimizer,
data state: written by every rank, each its own shard) and ``trainer.pt`` (scheduler, per-rank RNG
states, step counters, model config, audit: small, written by rank 0 with ``torch.save`` and read
with ``weights_only=True``). A save goes to ``.tmp-step-…`` and is renamed by rank 0 once every
rank has finished, so a ``step-N`` folder is always complete; ``keep_last`` newest are kept.

Trust: DCP reads ``.metadata`` with ``pickle`` and non-tensor values with full unpickling, so
unlike ``CheckpointManager``'s files, a DCP checkpoint must come from someone you trust.
"""

from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from resumable_data import ResumeError, dcp_errors

__all__ = ["DcpCheckpoints"]

EXTRAS_NAME = "trainer.pt"
METADATA_NAME = ".metadata"
_TMP_PREFIX = ".tmp-"
_STEP_RE = re.compile(r"^step-(\d+)$")


class DcpCheckpoints:
    """DCP ``step-N`` folders of one run; every rank calls :meth:`save`, rank 0 renames and prunes.

    Args:
        directory: the folder of the ``step-N`` checkpoints.
        keep_last: newest complete checkpoints to keep.
        is_main: this process is rank 0.
        async_save: write with ``dcp.async_save`` (the state is staged at the call; the files are
            written in the background and the folder is completed at the next save or :meth:`wait`).
    """

    def __init__(self, directory: Path, *, keep_last: int, is_main: bool, async_save: bool) -> None:
        self.directory = directory
        self.keep_last = keep_last
        self.is_main = is_main
        self.async_save = async_save
        self._pending: tuple[Future[Any], Path, Path] | None = None
        # Checkpoint collectives run in a background thread for async saves: they get their own
        # gloo group so they never interleave with the training's collectives.
        self._group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        if is_main:
            directory.mkdir(parents=True, exist_ok=True)

    def remove_leftovers(self) -> None:
        """Rank 0, before any save: delete half-written folders of an earlier, killed job."""
        for path in self.directory.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(path, ignore_errors=True)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [
            p
            for p in self.directory.iterdir()
            if _STEP_RE.match(p.name) and (p / METADATA_NAME).is_file() and (p / EXTRAS_NAME).is_file()
        ]
        return sorted(found, key=lambda p: int(_STEP_RE.match(p.name).group(1)))  # type: ignore[union-attr]

    def latest(self) -> Path | None:
        done = self.checkpoints()
        return done[-1] if done else None

    @staticmethod
    def read_extras(path: Path) -> dict[str, Any]:
        """The rank-0 part of a checkpoint, read with ``weights_only=True``.

        Raises:
            ResumeError: missing or unreadable.
        """
        file = Path(path) / EXTRAS_NAME
        if not (Path(path) / METADATA_NAME).is_file() or not file.is_file():
            raise ResumeError(
                f"{path} is not a complete DCP checkpoint of this trainer (needs {METADATA_NAME} and {EXTRAS_NAME})"
            )
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types; all mean "unreadable"
            raise ResumeError(f"cannot load {file}: {e}") from e
        if not isinstance(state, dict):
            raise ResumeError(f"cannot load {file}: expected a dict, got {type(state).__name__}")
        return state

    @staticmethod
    def load(path: Path, app_state: dict[str, Any]) -> None:
        """Load the DCP shards into ``app_state`` in place (every rank; any world size).

        Raises:
            ResumeError: DCP failed on some rank (its ``CheckpointException`` is converted).
        """
        with dcp_errors("load", path):
            dcp.load(app_state, checkpoint_id=str(path))

    def save(self, step: int, app_state: dict[str, Any], extras: dict[str, Any]) -> Path:
        """Write ``step``: the shards from every rank, ``extras`` from rank 0.

        Returns:
            The ``step-N`` folder (complete on return unless saving asynchronously).
        """
        self.wait()
        target = self.directory / f"step-{step:08d}"
        tmp = self.directory / f"{_TMP_PREFIX}{target.name}"
        if self.is_main:
            tmp.mkdir(parents=True, exist_ok=True)
            torch.save(extras, tmp / EXTRAS_NAME)
        with dcp_errors("save", tmp):
            if self.async_save:
                future = dcp.async_save(app_state, checkpoint_id=str(tmp), process_group=self._group)
                self._pending = (future, tmp, target)
                return target
            dcp.save(app_state, checkpoint_id=str(tmp))
        self._complete(tmp, target)
        return target

    def wait(self) -> None:
        """Finish an asynchronous save: wait for its files, then complete its folder."""
        if self._pending is None:
            return
        future, tmp, target = self._pending
        self._pending = None
        with dcp_errors("save", tmp):
            future.result()
        self._complete(tmp, target)

    def _complete(self, tmp: Path, target: Path) -> None:
        if not self.is_main:
            return
        if target.exists():  # the same step saved again after resuming from an older checkpoint
            shutil.rmtree(target)
        os.replace(tmp, target)
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for old in self.checkpoints()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
