"""Checkpoints written with ``torch.distributed.checkpoint`` (``--checkpoint-format dcp`` / ``dcp-async``).

Layout: ``RUN_DIR/dcp/step-00000040/`` holds DCP's shards and ``.metadata`` (model, optimizer,
data state: written by every rank, each its own shard), ``trainer.pt`` (scheduler, per-rank RNG
states, step counters, model config, audit: small, written by rank 0, read with
``weights_only=True``) and ``manifest.json`` (every file's size and sha256). The folders are the
library's :class:`resumable_data.checkpoint.DcpStore`: every rank saves into its staging folder (through the
store's writer, so a full disk is reported with its errno and file), rank 0 then fsyncs everything,
renames it to ``step-N`` and prunes, holding the folder's lock; ``--resume auto`` takes the newest
folder whose files all verify, falling back with a warning.

Trust: DCP reads ``.metadata`` with ``pickle`` and non-tensor values with full unpickling, so
unlike ``CheckpointManager``'s files, a DCP checkpoint must come from someone you trust.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from resumable_data.checkpoint import DcpStore
from resumable_data.distributed import dcp_errors

__all__ = ["EXTRAS_NAME", "DcpCheckpoints"]

EXTRAS_NAME = "trainer.pt"


class DcpCheckpoints:
    """DCP ``step-N`` folders of one run; every rank calls :meth:`save`, rank 0 publishes and prunes.

    Args:
        directory: the folder of the ``step-N`` checkpoints.
        keep_last: newest valid checkpoints to keep.
        is_main: this process is rank 0.
        async_save: write with ``dcp.async_save`` (the state is staged at the call; the files are
            written in the background and the folder is published at the next save or :meth:`wait`).
    """

    def __init__(self, directory: Path, *, keep_last: int, is_main: bool, async_save: bool) -> None:
        self.store = DcpStore(directory, keep_last=keep_last)
        self.directory = self.store.directory
        self.is_main = is_main
        self.async_save = async_save
        self._pending: tuple[Future[Any], int, dict[str, Any]] | None = None
        # Checkpoint collectives run in a background thread for async saves: they get their own
        # gloo group so they never interleave with the training's collectives.
        self._group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None

    def remove_leftovers(self) -> None:
        """Rank 0, before any save: lock the folder and delete half-written folders of an earlier, killed job."""
        self.store.remove_leftovers()

    def close(self) -> None:
        """Finish an asynchronous save, then release the folder's lock (rank 0)."""
        try:
            self.wait()
        finally:
            self.store.close()

    def read_extras(self, path: Path) -> dict[str, Any]:
        """The rank-0 part of a checkpoint, verified against its manifest, read with ``weights_only=True``.

        Raises:
            ResumeError: missing, not matching the manifest, or unreadable.
        """
        return self.store.load_payload(path, EXTRAS_NAME)

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
        staging = self.store.staging(step)
        writer = self.store.writer(step)
        with dcp_errors("save", staging):
            if self.async_save:
                future = dcp.async_save(app_state, storage_writer=writer, process_group=self._group)
                # The extras are written when the shards are done: copy them as they are now.
                self._pending = (future, step, copy.deepcopy(extras))
                return self._folder(step)
            dcp.save(app_state, storage_writer=writer)
        return self._publish(step, extras)

    def wait(self) -> None:
        """Finish an asynchronous save: wait for its files, then publish its folder."""
        if self._pending is None:
            return
        future, step, extras = self._pending
        self._pending = None
        with dcp_errors("save", self.store.staging(step)):
            future.result()
        self._publish(step, extras)

    def _publish(self, step: int, extras: dict[str, Any]) -> Path:
        # DCP's coordinator (rank 0) returns only after every rank's files are written.
        if self.is_main:
            return self.store.publish(step, payloads={EXTRAS_NAME: extras})
        return self._folder(step)

    def _folder(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"
