"""CheckpointManager: atomic ``step-N`` checkpoints with a checksum manifest, newest-valid lookup,
pruning that keeps K valid checkpoints, async writes, and a run-folder lock.

Layout of a run folder::

    DIRECTORY/
      .lock                        flock'ed while a manager owns the folder (see lock.py)
      step-00000100/
        state.pt                   torch.save(state); loads with weights_only=True
        manifest.json              step, created, sha256 + size of state.pt, library version, metric
      step-00000200/ ...
      .tmp-step-00000300-<hex>/    a write in progress (or one cut off by a crash); never read

A checkpoint is written into a ``.tmp-*`` folder (payload, then manifest, each fsynced), which is
then renamed to ``step-N`` and the run folder fsynced. A checkpoint therefore counts only once it is
complete: a crash at any point leaves either the previous set of checkpoints or the previous set
plus the new one, and ``.tmp-*`` leftovers that the next save removes (a symlink is unlinked, never
followed). Pruning runs only after the new checkpoint is in place, renames a folder to ``.tmp-*``
before deleting it (so a crash mid-delete cannot leave a half-deleted ``step-N``), keeps the newest
``keep_last`` *valid* checkpoints and never touches the best one, nor one written by a newer release
(whose manifest this one cannot judge). A failed write raises an
``OSError`` naming the checkpoint and the OS error, and leaves the folder as it was.

The manager's jobs live in small modules: the step-folder publish, prune and validity cache it
shares with ``DcpStore`` (``store``), the lock (``lock``), the manifest and what makes a checkpoint
valid (``manifest``), weights-only checks and loading (``weights_only``), durable file operations
(``durable``).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import uuid
import warnings
from pathlib import Path
from typing import Any

from ..errors import ResumeError
from . import durable
from .lock import CheckpointLockedError, RunLock
from .manifest import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    MAX_MANIFEST_BYTES,
    PAYLOAD_NAME,
    Manifest,
    checkpoint_problem,
    file_digest,
    read_manifest,
    step_name,
)
from .manifest import step_of as _step_of
from .store import TMP_PREFIX, StepFolderStore
from .weights_only import is_mapping, load_weights_only, snapshot

__all__ = ["CheckpointLockedError", "CheckpointManager"]


class CheckpointManager(StepFolderStore):
    """Saves, finds, verifies and prunes the checkpoints of one training run.

    Each checkpoint is a folder ``DIRECTORY/step-{step:08d}/`` holding ``state.pt`` (the state,
    written with ``torch.save``) and ``manifest.json`` (step, time, sha256, size, library version,
    metric). Saves are atomic; :meth:`latest` returns the newest checkpoint whose checksum matches.
    An odd manifest or a damaged payload makes a checkpoint invalid: it is skipped with a warning.

    Args:
        directory: The run folder; created if missing (durably: each new folder's parent is fsynced).
        keep_last: How many of the newest *valid* checkpoints to keep (at least 2, so a checkpoint
            found corrupt still leaves one to fall back to). Invalid ones never count.
        keep_best: Also keep the valid checkpoint with the lowest ``metric`` passed to :meth:`save`.
        async_save: Copy the state to CPU memory in :meth:`save` and write it in a background
            thread, so training continues while the file is written.
        lock: Take an exclusive lock on the folder so two jobs cannot write the same run. The lock
            dies with this process, even if it forked children (DataLoader workers) that live on.

    Raises:
        ResumeError: ``keep_last`` is below 2.
        CheckpointLockedError: Another process holds the folder's lock.

    Example::

        with CheckpointManager("runs/exp1", keep_last=3) as ckpt:
            start = 0
            if ckpt.latest() is not None:
                state = ckpt.load()
                model.load_state_dict(state["model"])
                start = state["train_state"]["step"] + 1
            for step in range(start, total_steps):
                train_one_step()
                if step % 1000 == 0:
                    state = {"model": model.state_dict(), "train_state": {"step": step}}
                    ckpt.save(step, state, metric=val_loss)
    """

    manifest_version = MANIFEST_VERSION
    max_manifest_bytes = MAX_MANIFEST_BYTES
    retried_at = "save"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int = 2,
        keep_best: bool = True,
        async_save: bool = False,
        lock: bool = True,
    ) -> None:
        super().__init__(directory, keep_last)
        self.keep_best = keep_best
        self.async_save = async_save
        # Durably: a run folder that a power loss can take away takes its first checkpoints with it.
        durable.make_dirs(self.directory)
        self._lock: RunLock | None = RunLock(self.directory) if lock else None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[Path] | None = None
        self._closed = False

    # -- writing ---------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, metric: float | None = None) -> Path:
        """Write ``state`` as the checkpoint of ``step``, then prune old ones.

        The state is checked first: everything must load with ``torch.load(weights_only=True)``
        (tensors, ints, floats, bools, strings, None, in dicts/lists/tuples), so nothing is written
        for a state that could not be resumed from. Saving a step that already exists replaces it
        (e.g. after resuming from an older checkpoint because the newer one was corrupt).

        Args:
            step: The training step; names the folder ``step-{step:08d}``.
            state: The state to save, e.g. ``{"model": ..., "optimizer": ..., "dataloader": ...}``.
            metric: Lower is better (e.g. validation loss); the lowest one is kept as :meth:`best`.
                NaN never counts as best.

        Returns:
            The checkpoint folder. With ``async_save`` it exists only once :meth:`wait` returns.

        Raises:
            ResumeError: ``step`` or ``metric`` is invalid, ``state`` holds something that
                ``weights_only`` loading would refuse (the message names its key path), or the
                step's folder exists and was written by a newer release.
            OSError: The write failed (disk full, read-only, I/O error): the message names the
                checkpoint and the OS error, ``errno`` is the OS's, and the run folder is as it was.
                With ``async_save``, a failure of the previous background save is raised here.
        """
        # Finish (and surface the failure of) the previous save before anything else, so at most
        # one write is ever in flight and no error is lost.
        self.wait()
        if self._closed:
            raise ResumeError(f"CheckpointManager for {self.directory} is closed; create a new one to save")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ResumeError(f"step must be an int >= 0, but got step={step!r}")
        if metric is not None:
            if isinstance(metric, bool) or not isinstance(metric, (int, float)):
                raise ResumeError(f"metric must be a float or None, but got metric={metric!r}")
            metric = float(metric)
        if not is_mapping(state):
            raise ResumeError(f"state must be a dict, but got {type(state).__name__}")
        self._refuse_to_replace_newer(self.directory / step_name(step))
        # The snapshot also validates; async copies tensors to CPU now, because the caller may
        # update them in place as soon as save() returns.
        copied = snapshot(state, "state", copy=self.async_save, memo={})
        target = self.directory / step_name(step)
        if not self.async_save:
            return self._write(step, copied, metric)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="checkpoint-writer"
            )
        self._pending = self._executor.submit(self._write, step, copied, metric)
        return target

    def wait(self) -> None:
        """Block until the background save (if any) is done; re-raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _settle(self) -> None:
        """Block until the background save is done, leaving its error for save/wait/close.

        Readers call this so they never list a folder that the writer thread is pruning.
        """
        if self._pending is not None:
            concurrent.futures.wait([self._pending])

    def close(self) -> None:
        """Wait for the background save, then release the lock. Safe to call twice.

        Raises:
            Exception: Whatever the background save raised; the lock is released regardless.
        """
        self._closed = True
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _write(self, step: int, state: dict[str, Any], metric: float | None) -> Path:
        """Write, publish and prune; runs in the caller's thread or the writer thread."""
        # With the lock held nobody else writes here, so any .tmp-* is a leftover of a crash.
        if self._lock is not None:
            self._remove_leftovers()
        target = self.directory / step_name(step)
        try:
            self._publish(step, state, metric, target)
        except OSError as e:
            raise durable.write_error(target, e, "nothing was written and the earlier checkpoints are intact") from e
        self._prune(keep=target)
        return target

    def _publish(self, step: int, state: dict[str, Any], metric: float | None, target: Path) -> None:
        """Write into a temp folder and rename it to ``target``; on failure, leave the folder as it was."""
        tmp = self.directory / f"{TMP_PREFIX}{target.name}-{uuid.uuid4().hex[:12]}"
        os.mkdir(tmp)
        try:
            durable.write_payload(state, tmp / PAYLOAD_NAME)
            sha256, size = file_digest(tmp / PAYLOAD_NAME)
            with durable.durable_file(tmp / MANIFEST_NAME) as f:
                f.write(Manifest(step=step, sha256=sha256, size=size, metric=metric).to_json())
            durable.fsync_dir(tmp)
            self._swap_in(tmp, target)
        except BaseException:
            self._remove_quietly(tmp)
            raise

    # -- validity --------------------------------------------------------------------------------

    def _folder_problem(self, path: Path, *, verify: bool) -> str | None:
        return checkpoint_problem(path, verify=verify)

    def _also_keep(self, folders: list[Path]) -> Path | None:
        return self._best_of(folders, warn=False) if self.keep_best else None

    def _best_of(self, folders: list[Path], *, warn: bool) -> Path | None:
        """The valid checkpoint with the lowest metric (NaN and None never win; ties: the newest).

        Folders with an unreadable manifest are passed over silently (callers that report warn
        about them); with ``warn``, a candidate whose checksum fails is named in a warning.
        """
        ranked = []
        for path in folders:
            try:
                manifest = read_manifest(path)
            except ResumeError:
                continue
            if manifest.metric is not None and not math.isnan(manifest.metric):
                ranked.append((manifest.metric, -_step_of(path), path))
        for _, _, path in sorted(ranked):
            if self._is_valid(path):
                return path
            if warn:
                warnings.warn(f"skipping checkpoint {path}: {checkpoint_problem(path, verify=True)}", stacklevel=3)
        return None

    # -- reading ---------------------------------------------------------------------------------

    def best(self) -> Path | None:
        """The valid checkpoint with the lowest metric (ties: the newest), or None if none has one.

        Invalid candidates are skipped with a warning, like :meth:`latest`.
        """
        self._settle()
        folders = self._step_folders()
        for path in folders:
            if (problem := checkpoint_problem(path, verify=False)) is not None:
                warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
        return self._best_of(folders, warn=True)

    def load(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        map_location: Any = "cpu",
        verify: bool = True,
    ) -> dict[str, Any]:
        """Load a checkpoint's state with ``torch.load(..., weights_only=True)``.

        Args:
            path: A ``step-N`` folder or its ``state.pt``; a relative name that does not exist is
                also looked up in the run folder. None loads :meth:`latest`.
            map_location: Passed to ``torch.load``; the default keeps GPU memory free until the
                caller moves things.
            verify: Check the manifest and sha256 first. False loads the payload as it is (for
                salvaging a checkpoint whose manifest is lost); it is still never unpickled freely.

        Returns:
            The state dict that was passed to :meth:`save`.

        Raises:
            ResumeError: No checkpoint exists, or the path is missing, incomplete, corrupt or
                not a weights-only payload; the message names the path and the problem.
        """
        self._settle()
        if path is None:
            folder = self.latest()
            if folder is None:
                raise ResumeError(f"no valid checkpoint in {self.directory} to load")
        else:
            folder = self._resolve(Path(path))
        if verify:
            problem = self._problem(folder)
            if problem is not None:
                raise ResumeError(f"cannot load checkpoint {folder}: {problem}")
        payload = folder / PAYLOAD_NAME
        if not payload.is_file():
            raise ResumeError(f"cannot load checkpoint {folder}: {PAYLOAD_NAME} is missing")
        state = load_weights_only(payload, map_location=map_location)
        if not isinstance(state, dict):
            raise ResumeError(f"cannot load checkpoint {payload}: expected a dict, got {type(state).__name__}")
        return state

    @staticmethod
    def step_of(path: str | os.PathLike[str]) -> int:
        """The step of a ``step-N`` folder or of its payload file, read from the name.

        Raises:
            ResumeError: Neither the path nor its parent is named ``step-N``.

        Example:
            >>> CheckpointManager.step_of("runs/exp1/step-00001200/state.pt")
            1200
        """
        return _step_of(path)

    def _resolve(self, path: Path) -> Path:
        """Map a user's path (folder, payload file, or a name inside the run folder) to a folder."""
        if not path.exists() and not path.is_absolute() and (self.directory / path).exists():
            path = self.directory / path
        if not path.exists():
            raise ResumeError(f"cannot load checkpoint {path}: no such file or folder")
        return path if path.is_dir() else path.parent
