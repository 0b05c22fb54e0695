"""DcpStore: durable ``step-N`` folders for checkpoints whose files every rank writes itself
(``torch.distributed.checkpoint``), with the guarantees of :class:`CheckpointManager`.

Layout of the store's folder::

    DIRECTORY/
      step-00000040/
        .metadata, __0_0.distcp, __1_0.distcp    written by DCP (every rank its shards)
        trainer.pt                               payloads passed to publish(): torch.save, weights_only
        manifest.json                            step, time, library version, size + sha256 of every file
      .tmp-step-00000060/                        a save in progress (or cut off by a crash); never read

Every rank saves into :meth:`DcpStore.staging` (the same path on every rank), with
:meth:`DcpStore.writer` so that a failed write reports the OS error; once DCP's save has
returned on rank 0 (its coordinator, which returns after every rank's files are written), rank 0
calls :meth:`DcpStore.publish`: it fsyncs every file in the staging folder (DCP's writer syncs its
own data files, not the folder entries), writes the payloads and the manifest, each fsynced,
fsyncs the folder, renames it to ``step-N`` and fsyncs the store's folder. A ``step-N`` folder
therefore counts only once it is complete and durable; a crash at any point leaves the previous
set of checkpoints, or that set plus the new one, and a ``.tmp-*`` leftover. A publish that fails
(disk full) removes what it wrote into the staging folder, so it can be called again. The writing
rank holds ``DIRECTORY/.lock`` (:class:`RunLock`, as :class:`CheckpointManager` does) from its first
write until :meth:`DcpStore.close`, so a second writer on the same folder is refused.

:meth:`DcpStore.latest` returns the newest folder whose files all have the size and sha256 the
manifest records (a zero-length, truncated, missing or changed file makes it invalid) and falls
back to the one before with a warning. Replacing a step and pruning rename the old folder to a
``.tmp-*`` name first, so a crash mid-delete never leaves half a ``step-N``; a folder a newer release
wrote is never replaced or pruned.

The step-folder publish, pruning and validity cache are :class:`StepFolderStore`'s (shared with
:class:`CheckpointManager`); the manifest format and what makes a folder valid are in ``manifest``.

Trust: DCP itself reads ``.metadata`` with ``pickle`` and non-tensor values with full unpickling;
the manifest proves a folder complete and unchanged, not that its writer was benign. Load DCP
checkpoints only from sources you trust. The payloads (``trainer.pt``) load with
``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ResumeError
from . import durable
from .lock import RunLock
from .manifest import (
    DCP_MANIFEST_VERSION,
    DCP_METADATA,
    MANIFEST_NAME,
    MAX_DCP_MANIFEST_BYTES,
    DcpManifest,
    dcp_checkpoint_problem,
    file_digest,
    is_dcp_folder,
    plain_name,
    read_dcp_manifest,
    step_name,
    verify_payload,
)
from .store import TMP_PREFIX, StepFolderStore
from .weights_only import is_mapping, load_weights_only, snapshot

if TYPE_CHECKING:
    from .dcp_writer import ErrnoFileSystemWriter

# The manifest names stay importable from here, where they were defined before ``manifest`` held both formats.
__all__ = [
    "DCP_METADATA",
    "DcpManifest",
    "DcpStore",
    "dcp_checkpoint_problem",
    "is_dcp_folder",
    "read_dcp_manifest",
    "verify_payload",
]


class DcpStore(StepFolderStore):
    """The ``step-N`` DCP checkpoints of one run: staging, durable publishing, newest-valid lookup,
    pruning. Every rank calls :meth:`staging` and DCP's save; rank 0 alone calls the rest.

    Args:
        directory: The store's folder (DCP's save creates it; :meth:`publish` makes its entry durable).
        keep_last: How many of the newest *valid* checkpoints to keep (at least 2, so a checkpoint
            found corrupt still leaves one to fall back to).
        lock: Lock the folder at the first write (:meth:`remove_leftovers` or :meth:`publish`: rank 0's
            calls) until :meth:`close` or the end of the process, so two jobs cannot write the same
            store. Reading never locks.

    Raises:
        ResumeError: ``keep_last`` is below 2.

    Example::

        store = DcpStore("runs/exp1/dcp", keep_last=3)
        if rank == 0:
            store.remove_leftovers()  # before any rank saves; takes the folder's lock
        path = store.latest() if rank == 0 else None  # broadcast it, then on every rank:
        if path is not None:
            dcp.load(app_state, checkpoint_id=path)
            extras = store.load_payload(path, "trainer.pt")
        ...
        dcp.save(app_state, storage_writer=store.writer(step))  # every rank
        if rank == 0:
            store.publish(step, payloads={"trainer.pt": {"step": step, "rng": ...}})
        store.close()  # at the end: releases the lock
    """

    manifest_version = DCP_MANIFEST_VERSION
    max_manifest_bytes = MAX_DCP_MANIFEST_BYTES
    retried_at = "start"

    def __init__(self, directory: str | os.PathLike[str], keep_last: int = 2, lock: bool = True) -> None:
        super().__init__(directory, keep_last)
        self.lock = lock
        self._lock: RunLock | None = None

    def __repr__(self) -> str:
        return f"DcpStore(directory={self.directory!r}, keep_last={self.keep_last!r}, lock={self.lock!r})"

    def close(self) -> None:
        """Release the folder's lock, if this store took it. Safe to call twice."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    # -- writing ---------------------------------------------------------------------------------

    def _locked(self) -> None:
        """Take the folder's lock before the first write (see ``lock``).

        Raises:
            CheckpointLockedError: Another process (or another open store) holds it.
        """
        if self.lock and self._lock is None:
            durable.make_dirs(self.directory)
            self._lock = RunLock(self.directory)

    def writer(self, step: int, **options: Any) -> ErrnoFileSystemWriter:
        """A DCP storage writer for :meth:`staging` of ``step``: pass it as ``dcp.save(state,
        storage_writer=store.writer(step))`` on every rank. A write that fails raises the OS error
        (errno, reason, file) rather than torch's ``unexpected pos`` (``dcp_errors`` shows it).

        Args:
            step: The step to stage.
            **options: ``FileSystemWriter``'s options (``thread_count``, ``sync_files``...).

        Raises:
            ResumeError: ``step`` is not an int >= 0.
        """
        from .dcp_writer import ErrnoFileSystemWriter  # torch.distributed.checkpoint: only when saving

        return ErrnoFileSystemWriter(self.staging(step), **options)

    def staging(self, step: int) -> Path:
        """The folder every rank saves step ``step`` into (the same path on every rank).

        Raises:
            ResumeError: ``step`` is not an int >= 0.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ResumeError(f"step must be an int >= 0, but got step={step!r}")
        return self.directory / f"{TMP_PREFIX}{step_name(step)}"

    def remove_leftovers(self) -> None:
        """Delete ``.tmp-*`` folders of saves cut off by a crash (a symlink is unlinked, never
        followed). Call it on rank 0 before any rank of this job saves: it takes the folder's lock.

        Raises:
            CheckpointLockedError: Another writer holds the folder.
        """
        self._locked()
        self._remove_leftovers()

    def publish(self, step: int, *, payloads: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
        """Make the staged save of ``step`` a durable ``step-N`` checkpoint, then prune old ones.

        Call it on rank 0 once DCP's save (or the future of its async save) has returned there.

        Args:
            step: The step whose :meth:`staging` folder DCP wrote.
            payloads: Small states to store beside DCP's files, by file name (e.g. ``trainer.pt``);
                each must load with ``torch.load(weights_only=True)`` and is checked first.

        Returns:
            The ``step-N`` folder.

        Raises:
            ResumeError: No DCP save is staged for ``step``, a payload name is not a plain file
                name or collides with a file of DCP's, a payload holds something that
                ``weights_only`` loading would refuse, or a newer release wrote ``step-N``.
            CheckpointLockedError: Another writer holds the folder.
            OSError: A write, sync or rename failed: the message names the checkpoint and the OS
                error, the earlier checkpoints are as they were, and the staged save is as DCP
                left it (call publish again once the cause is fixed).
        """
        self._locked()
        tmp = self.staging(step)
        if not (tmp / DCP_METADATA).is_file():
            raise ResumeError(
                f"cannot publish step {step}: {tmp} holds no {DCP_METADATA}; save with "
                f"dcp.save(state, checkpoint_id=store.staging({step})) on every rank first"
            )
        checked: dict[str, dict[str, Any]] = {}
        for name, state in (payloads or {}).items():
            if not plain_name(name) or name in (MANIFEST_NAME, DCP_METADATA) or (tmp / name).exists():
                raise ResumeError(f"payload name {name!r} must be a plain file name that DCP's files do not use")
            if not is_mapping(state):
                raise ResumeError(f"payload {name!r} must be a dict, but got {type(state).__name__}")
            checked[name] = snapshot(state, name, copy=False, memo={})
        target = self.directory / step_name(step)
        self._refuse_to_replace_newer(target)
        try:
            self._publish(step, tmp, checked, target)
        except BaseException as e:
            # What this call wrote goes, so the staging folder is DCP's save again and publish can retry.
            for name in (*checked, MANIFEST_NAME):
                with contextlib.suppress(OSError):
                    (tmp / name).unlink(missing_ok=True)
            if isinstance(e, OSError):
                outcome = "the earlier checkpoints are intact and the staged save can be published again"
                raise durable.write_error(target, e, outcome) from e
            raise
        self._prune(keep=target)
        return target

    def _publish(self, step: int, tmp: Path, payloads: dict[str, dict[str, Any]], target: Path) -> None:
        # DCP's writer created the store's folder (if new) without syncing its entry.
        durable.fsync_dir(self.directory.parent)
        for name, state in payloads.items():
            durable.write_payload(state, tmp / name)
        files: dict[str, tuple[int, str]] = {}
        for path in sorted(tmp.iterdir()):
            if path.name == MANIFEST_NAME or not path.is_file() or path.is_symlink():
                continue
            durable.fsync_file(path)  # DCP syncs its shards' data; this covers everything else too
            sha256, size = file_digest(path)
            files[path.name] = (size, sha256)
        manifest = DcpManifest(step=step, files=files, payloads=tuple(payloads))
        with durable.durable_file(tmp / MANIFEST_NAME) as f:
            f.write(manifest.to_json())
        durable.fsync_dir(tmp)
        self._swap_in(tmp, target)

    # -- reading ---------------------------------------------------------------------------------

    def load_payload(self, folder: str | os.PathLike[str], name: str) -> dict[str, Any]:
        """A payload of a checkpoint, loaded with ``torch.load(weights_only=True)`` after checking
        its size and sha256 against the manifest.

        Raises:
            ResumeError: The folder is not a complete checkpoint, the manifest does not list the
                payload, or the file does not match it or does not hold a dict.
        """
        folder = Path(folder)
        verify_payload(folder, name)
        state = load_weights_only(folder / name, map_location="cpu")
        if not isinstance(state, dict):
            raise ResumeError(f"cannot load {folder / name}: expected a dict, got {type(state).__name__}")
        return state

    def _folder_problem(self, path: Path, *, verify: bool) -> str | None:
        return dcp_checkpoint_problem(path, verify=verify)
