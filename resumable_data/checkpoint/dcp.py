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

Trust: DCP itself reads ``.metadata`` with ``pickle`` and non-tensor values with full unpickling;
the manifest proves a folder complete and unchanged, not that its writer was benign. Load DCP
checkpoints only from sources you trust. The payloads (``trainer.pt``) load with
``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import stat
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..core.state import VERSION, is_int
from ..core.version import __version__
from ..errors import ResumeError
from . import durable
from .lock import RunLock
from .manifest import (
    MANIFEST_NAME,
    file_digest,
    name_problem,
    read_json_object,
    refuse_to_replace_newer,
    step_folders,
    step_name,
    written_by_newer,
)
from .weights_only import is_mapping, load_weights_only, snapshot

if TYPE_CHECKING:
    from .dcp_writer import ErrnoFileSystemWriter

__all__ = [
    "DCP_METADATA",
    "DcpManifest",
    "DcpStore",
    "dcp_checkpoint_problem",
    "is_dcp_folder",
    "read_dcp_manifest",
    "verify_payload",
]

DCP_MANIFEST_VERSION = 1
# DCP's own index of the shards: written last by DCP's coordinator, so a folder without it is incomplete.
DCP_METADATA = ".metadata"
# One entry of about 120 bytes per file: room for tens of thousands of ranks' shards.
MAX_DCP_MANIFEST_BYTES = 16 * 1024 * 1024
_TMP_PREFIX = ".tmp-"
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

# Manifest keys, declared once.
KIND = "kind"
KIND_DCP = "dcp"
STEP = "step"
CREATED = "created"
CREATED_ISO = "created_iso"
LIBRARY_VERSION = "library_version"
FILES = "files"
PAYLOADS = "payloads"
SIZE = "size"
SHA256 = "sha256"


@dataclass(frozen=True)
class DcpManifest:
    """The typed content of a DCP step folder's ``manifest.json``.

    Attributes:
        step: The training step; must match the folder's ``step-N`` name.
        files: Every file of the folder but the manifest, by name: ``(size, sha256)``.
        payloads: The names among ``files`` written by :meth:`DcpStore.publish` (weights-only).
        created: Unix time of the write.
        library_version: The resumable_data release that wrote it.
    """

    step: int
    files: dict[str, tuple[int, str]]
    payloads: tuple[str, ...] = ()
    created: float | None = None
    library_version: str | None = None

    def to_json(self) -> bytes:
        created = time.time() if self.created is None else self.created
        record = {
            VERSION: DCP_MANIFEST_VERSION,
            KIND: KIND_DCP,
            STEP: self.step,
            CREATED: created,
            CREATED_ISO: datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat(),
            LIBRARY_VERSION: self.library_version or __version__,
            PAYLOADS: list(self.payloads),
            FILES: {name: {SIZE: size, SHA256: sha256} for name, (size, sha256) in sorted(self.files.items())},
        }
        return (json.dumps(record, indent=1) + "\n").encode()

    @property
    def total_bytes(self) -> int:
        return sum(size for size, _ in self.files.values())


def read_dcp_manifest(folder: Path) -> DcpManifest:
    """Read and type-check ``folder/manifest.json`` of a DCP step folder, with bounded effort.

    Raises:
        ResumeError: Missing, odd or mistyped; the message names the file and the field.
    """
    path = folder / MANIFEST_NAME
    record = read_json_object(path, max_bytes=MAX_DCP_MANIFEST_BYTES)
    version = record.get(VERSION)
    if not is_int(version) or version != DCP_MANIFEST_VERSION or record.get(KIND) != KIND_DCP:
        raise ResumeError(
            f"manifest {path} is not a version-{DCP_MANIFEST_VERSION} DCP manifest (version "
            f"{_short(version)}, kind {_short(record.get(KIND))}); load it with the release that wrote it"
        )
    step = record.get(STEP)
    if not is_int(step) or step < 0:
        raise ResumeError(f"manifest {path} field {STEP!r} must be an int >= 0, but got {_short(step)}")
    raw_files = record.get(FILES)
    if not isinstance(raw_files, dict) or not raw_files:
        raise ResumeError(f"manifest {path} field {FILES!r} must be a non-empty object, but got {_short(raw_files)}")
    files: dict[str, tuple[int, str]] = {}
    for name, entry in raw_files.items():
        if not _plain_name(name):
            raise ResumeError(f"manifest {path} names the file {_short(name)}, which is not a plain file name")
        size = entry.get(SIZE) if isinstance(entry, dict) else None
        sha256 = entry.get(SHA256) if isinstance(entry, dict) else None
        if not (is_int(size) and size >= 0 and isinstance(sha256, str) and _SHA256_RE.match(sha256)):
            raise ResumeError(
                f"manifest {path} entry for {name!r} must be {{size: int >= 0, sha256: 64 hex digits}}, "
                f"but got {_short(entry)}"
            )
        files[name] = (size, sha256)
    if DCP_METADATA not in files:
        raise ResumeError(f"manifest {path} lists no {DCP_METADATA}: not a complete DCP checkpoint")
    payloads = record.get(PAYLOADS, [])
    if not isinstance(payloads, list) or not all(isinstance(p, str) and p in files for p in payloads):
        raise ResumeError(
            f"manifest {path} field {PAYLOADS!r} must list files of the folder, but got {_short(payloads)}"
        )
    created = record.get(CREATED)
    library = record.get(LIBRARY_VERSION)
    return DcpManifest(
        step=step,
        files=files,
        payloads=tuple(payloads),
        created=float(created) if isinstance(created, (int, float)) and not isinstance(created, bool) else None,
        library_version=library if isinstance(library, str) else None,
    )


def is_dcp_folder(folder: Path) -> bool:
    """Whether ``folder`` looks like a DCP step folder: DCP's ``.metadata``, or a manifest of kind
    ``dcp`` (a folder that lost its ``.metadata`` is still one, and is judged as one)."""
    if (folder / DCP_METADATA).exists():
        return True
    try:
        return read_json_object(folder / MANIFEST_NAME, max_bytes=MAX_DCP_MANIFEST_BYTES).get(KIND) == KIND_DCP
    except ResumeError:
        return False


def dcp_checkpoint_problem(folder: Path, *, verify: bool, check_name: bool = True) -> str | None:
    """What is wrong with a DCP step folder, or None if it is complete (and, with ``verify``, every
    file's sha256 matches the manifest). Never raises for anything found on disk.

    Args:
        verify: Also read every file and compare its sha256 (else sizes only).
        check_name: Require the folder's ``step-N`` name to match the manifest's step.
    """
    if not folder.is_dir():
        return "not a checkpoint folder"
    try:
        manifest = read_dcp_manifest(folder)
    except ResumeError as e:
        return str(e)
    if check_name and (problem := name_problem(folder, manifest.step)) is not None:
        return problem
    for name, (size, _) in manifest.files.items():
        try:
            info = (folder / name).lstat()
        except OSError:
            return f"{name} is missing"
        if not stat.S_ISREG(info.st_mode):
            return f"{name} is not a regular file"
        if info.st_size != size:
            return f"{name} has {info.st_size} bytes but the manifest records {size} (truncated?)"
    if verify:
        for name, (_, sha256) in manifest.files.items():
            try:
                actual, _ = file_digest(folder / name)
            except OSError as e:
                return f"{name} is unreadable: {e.strerror}"
            if actual != sha256:
                return f"checksum mismatch: {name} has sha256 {actual}, manifest records {sha256}"
    return None


def verify_payload(folder: Path, name: str) -> DcpManifest:
    """Check the payload ``name`` of a DCP step folder against the folder's manifest (listed as a
    payload, size and sha256), without reading the rest of the folder.

    Returns:
        The folder's manifest.

    Raises:
        ResumeError: ``cannot load FOLDER/NAME: ...`` naming what does not match.
    """
    try:
        manifest = read_dcp_manifest(folder)
    except ResumeError as e:
        raise ResumeError(f"cannot load {folder / name}: {e}") from None
    if name not in manifest.payloads:
        raise ResumeError(
            f"cannot load {folder / name}: the manifest lists no payload {name!r} (payloads: "
            f"{list(manifest.payloads)}; DCP's own files load only with DCP)"
        )
    size, sha256 = manifest.files[name]
    try:
        actual, actual_size = file_digest(folder / name)
    except OSError as e:
        raise ResumeError(f"cannot load {folder / name}: {e.strerror}") from None
    if (actual_size, actual) != (size, sha256):
        raise ResumeError(
            f"cannot load {folder / name}: it has {actual_size} bytes and sha256 {actual}, "
            f"the manifest records {size} bytes and {sha256}"
        )
    return manifest


@dataclass
class DcpStore:
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

    directory: Path
    keep_last: int = 2
    lock: bool = True
    _lock: RunLock | None = field(default=None, init=False, repr=False)
    # Verdicts of full verifications, so pruning does not re-read every kept checkpoint on every
    # save. Trusted only while every file's inode, size and mtime are unchanged.
    _verified: dict[Path, tuple[tuple[int, ...], bool]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 2:
            raise ResumeError(
                f"keep_last must be an int >= 2 so a corrupt newest checkpoint still leaves one to "
                f"resume from, but got keep_last={self.keep_last!r}"
            )

    def __enter__(self) -> DcpStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

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
        return self.directory / f"{_TMP_PREFIX}{step_name(step)}"

    def remove_leftovers(self) -> None:
        """Delete ``.tmp-*`` folders of saves cut off by a crash (a symlink is unlinked, never
        followed). Call it on rank 0 before any rank of this job saves: it takes the folder's lock.

        Raises:
            CheckpointLockedError: Another writer holds the folder.
        """
        self._locked()
        for path in self.directory.glob(f"{_TMP_PREFIX}*"):
            _remove_quietly(path)

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
            if not _plain_name(name) or name in (MANIFEST_NAME, DCP_METADATA) or (tmp / name).exists():
                raise ResumeError(f"payload name {name!r} must be a plain file name that DCP's files do not use")
            if not is_mapping(state):
                raise ResumeError(f"payload {name!r} must be a dict, but got {type(state).__name__}")
            checked[name] = snapshot(state, name, copy=False, memo={})
        target = self.directory / step_name(step)
        refuse_to_replace_newer(target, DCP_MANIFEST_VERSION, max_bytes=MAX_DCP_MANIFEST_BYTES)
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
        replaced: Path | None = None
        published = False
        try:
            # rename() cannot replace a non-empty folder: an existing step-N (saved again after a
            # resume from an older checkpoint) is moved aside first and deleted once the new one
            # is in place; a crash between the renames loses only that step (resume falls back).
            replaced = self._move_aside(target) if os.path.lexists(target) else None
            os.rename(tmp, target)
            published = True
            durable.fsync_dir(self.directory)
        except BaseException:
            if published:
                os.rename(target, tmp)
            if replaced is not None:
                os.rename(replaced, target)
            raise
        if replaced is not None:
            _remove_quietly(replaced)
        self._remember(target, valid=True)

    def _prune(self, keep: Path) -> None:
        """Keep the newest ``keep_last`` valid checkpoints and ``keep``; move the rest aside and delete them."""
        valid_kept = 0
        for path in reversed(self._step_folders()):
            if valid_kept >= self.keep_last:
                newer = written_by_newer(path, DCP_MANIFEST_VERSION, max_bytes=MAX_DCP_MANIFEST_BYTES)
                if path == keep or newer is not None:
                    continue
                try:
                    durable.remove_tree(self._move_aside(path))
                except OSError as e:  # the new checkpoint is safe; only space is at stake
                    warnings.warn(f"could not prune checkpoint {path}: {e}", stacklevel=3)
                self._verified.pop(path, None)
            elif path == keep or self._is_valid(path):
                valid_kept += 1

    def _move_aside(self, path: Path) -> Path:
        doomed = self.directory / f"{_TMP_PREFIX}deleted-{path.name}-{uuid.uuid4().hex[:12]}"
        os.rename(path, doomed)
        durable.fsync_dir(self.directory)
        return doomed

    # -- reading ---------------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints (manifest valid, every file of the recorded size), oldest first."""
        return [p for p in self._step_folders() if dcp_checkpoint_problem(p, verify=False) is None]

    def latest(self) -> Path | None:
        """The newest checkpoint whose manifest is valid and whose files' sha256 all match.

        Newer folders that are incomplete or corrupt (a zero-length or missing file, a changed
        byte) are skipped with a ``warnings.warn`` naming each and the problem.
        """
        for path in reversed(self._step_folders()):
            problem = dcp_checkpoint_problem(path, verify=True)
            self._remember(path, valid=problem is None)
            if problem is None:
                return path
            warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
        return None

    def problem(self, path: str | os.PathLike[str]) -> str | None:
        """What makes the step folder ``path`` unusable (manifest, every file's size and sha256 are
        checked), or None when it can be loaded."""
        problem = dcp_checkpoint_problem(Path(path), verify=True)
        self._remember(Path(path), valid=problem is None)
        return problem

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

    def _step_folders(self) -> list[Path]:
        return step_folders(self.directory)

    def _is_valid(self, path: Path) -> bool:
        key = _stat_key(path)
        cached = self._verified.get(path)
        if key is not None and cached is not None and cached[0] == key:
            return cached[1]
        valid = dcp_checkpoint_problem(path, verify=True) is None
        self._remember(path, valid=valid)
        return valid

    def _remember(self, path: Path, *, valid: bool) -> None:
        key = _stat_key(path)
        if key is not None:
            self._verified[path] = (key, valid)


def _stat_key(folder: Path) -> tuple[int, ...] | None:
    """Inode, size and mtime of every file in a folder, or None if it cannot be listed."""
    try:
        entries = sorted(folder.iterdir())
        infos = [entry.lstat() for entry in entries]
    except OSError:
        return None
    return tuple(value for info in infos for value in (info.st_ino, info.st_size, info.st_mtime_ns))


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _remove_quietly(path: Path) -> None:
    try:
        durable.remove_tree(path)
    except OSError as e:
        warnings.warn(f"could not remove the leftover {path}: {e}; the next start tries again", stacklevel=3)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
