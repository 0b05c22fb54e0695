"""CheckpointManager: atomic ``step-N`` checkpoints with a checksum manifest, newest-valid lookup,
pruning and async writes.

Layout of a run folder::

    DIRECTORY/
      .lock                        flock'ed while a manager owns the folder; holds {"pid", "host"}
      step-00000100/
        state.pt                   torch.save(state); loads with weights_only=True
        manifest.json              step, created, sha256 + size of state.pt, library version, metric
      step-00000200/ ...
      .tmp-step-00000300-<hex>/    a write in progress (or one cut off by a crash); never read

A checkpoint is written into a ``.tmp-*`` folder (payload, then manifest, each fsynced), which is
then renamed to ``step-N`` and the run folder fsynced. A checkpoint therefore counts only once it is
complete: a crash at any point leaves either the previous set of checkpoints or the previous set
plus the new one, and ``.tmp-*`` leftovers that the next save removes. Pruning runs only after the
new checkpoint is in place, renames a folder to ``.tmp-*`` before deleting it (so a crash mid-delete
cannot leave a half-deleted ``step-N``), and never touches the best checkpoint.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import socket
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import torch

from ._state import VERSION, ResumeError

__all__ = ["CheckpointLockedError", "CheckpointManager"]

MANIFEST_VERSION = 1
PAYLOAD_NAME = "state.pt"
MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".lock"
_TMP_PREFIX = ".tmp-"
_STEP_RE = re.compile(r"^step-(\d+)$")

# Manifest keys, declared once.
STEP = "step"
CREATED = "created"
CREATED_ISO = "created_iso"
PAYLOAD = "payload"
SHA256 = "sha256"
SIZE = "size"
LIBRARY_VERSION = "library_version"
METRIC = "metric"

# Exactly the types torch.load(weights_only=True) reconstructs without extra allow-listing.
# OrderedDict is there because nn.Module.state_dict() returns one.
_LEAF_TYPES = (int, float, bool, str, type(None))
_MAPPING_TYPES = (dict, collections.OrderedDict)
_SEQUENCE_TYPES = (list, tuple)
_HASH_CHUNK = 1 << 20


class CheckpointLockedError(ResumeError):
    """Another live process (or another manager in this process) owns the run folder."""


class CheckpointManager:
    """Saves, finds, verifies and prunes the checkpoints of one training run.

    Each checkpoint is a folder ``DIRECTORY/step-{step:08d}/`` holding ``state.pt`` (the state,
    written with ``torch.save``) and ``manifest.json`` (step, time, sha256, size, library version,
    metric). Saves are atomic; :meth:`latest` returns the newest checkpoint whose checksum matches.

    Args:
        directory: The run folder; created if missing.
        keep_last: How many of the newest complete checkpoints to keep (at least 2, so a checkpoint
            found corrupt still leaves one to fall back to).
        keep_best: Also keep the checkpoint with the lowest ``metric`` passed to :meth:`save`.
        async_save: Copy the state to CPU memory in :meth:`save` and write it in a background
            thread, so training continues while the file is written.
        lock: Take an exclusive lock on the folder so two jobs cannot write the same run.

    Raises:
        ResumeError: ``keep_last`` is below 2.
        CheckpointLockedError: Another process holds the folder's lock.

    Example:
        >>> with CheckpointManager("runs/exp1", keep_last=3) as ckpt:
        ...     start = 0
        ...     if ckpt.latest() is not None:
        ...         state = ckpt.load()
        ...         model.load_state_dict(state["model"])
        ...         start = state["train_state"]["step"] + 1
        ...     for step in range(start, total_steps):
        ...         train_one_step()
        ...         if step % 1000 == 0:
        ...             state = {"model": model.state_dict(), "train_state": {"step": step}}
        ...             ckpt.save(step, state, metric=val_loss)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int = 2,
        keep_best: bool = True,
        async_save: bool = False,
        lock: bool = True,
    ) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 2:
            raise ResumeError(
                f"keep_last must be an int >= 2 so a corrupt newest checkpoint still leaves one to "
                f"resume from, but got keep_last={keep_last!r}"
            )
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.async_save = async_save
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = _acquire_lock(self.directory) if lock else None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[Path] | None = None
        self._closed = False

    # -- context manager -------------------------------------------------------------------------

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

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
            ResumeError: ``step`` or ``metric`` is invalid, or ``state`` holds something that
                ``weights_only`` loading would refuse (the message names its key path).
            Exception: Whatever the previous background save raised, with ``async_save``.
        """
        # Finish (and surface the failure of) the previous save before anything else, so at most
        # one write is ever in flight and no error is lost.
        self.wait()
        if self._closed:
            raise ResumeError(
                f"CheckpointManager for {self.directory} is closed; create a new one to save"
            )
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ResumeError(f"step must be an int >= 0, but got step={step!r}")
        if metric is not None:
            if isinstance(metric, bool) or not isinstance(metric, (int, float)):
                raise ResumeError(f"metric must be a float or None, but got metric={metric!r}")
            metric = float(metric)
        if not isinstance(state, _MAPPING_TYPES):
            raise ResumeError(f"state must be a dict, but got {type(state).__name__}")
        # The snapshot also validates; async copies tensors to CPU now, because the caller may
        # update them in place as soon as save() returns.
        snapshot = _snapshot(state, "state", copy=self.async_save, memo={})
        target = self.directory / _step_name(step)
        if not self.async_save:
            return self._write(step, snapshot, metric)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="checkpoint-writer"
            )
        self._pending = self._executor.submit(self._write, step, snapshot, metric)
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
            if self._lock_fd is not None:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
                self._lock_fd = None

    def _write(self, step: int, state: dict[str, Any], metric: float | None) -> Path:
        """Write, publish and prune; runs in the caller's thread or the writer thread."""
        # With the lock held nobody else writes here, so any .tmp-* is a leftover of a crash.
        if self._lock_fd is not None:
            self._remove_leftovers()
        target = self.directory / _step_name(step)
        tmp = self.directory / f"{_TMP_PREFIX}{target.name}-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        replaced: Path | None = None
        try:
            _write_payload(state, tmp / PAYLOAD_NAME)
            sha256, size = _file_digest(tmp / PAYLOAD_NAME)
            manifest = {
                VERSION: MANIFEST_VERSION,
                STEP: step,
                CREATED: time.time(),
                CREATED_ISO: datetime.datetime.now(datetime.timezone.utc).isoformat(),
                PAYLOAD: PAYLOAD_NAME,
                SHA256: sha256,
                SIZE: size,
                LIBRARY_VERSION: _library_version(),
                METRIC: metric,
            }
            with _durable_file(tmp / MANIFEST_NAME) as f:
                f.write((json.dumps(manifest, indent=2) + "\n").encode())
            _fsync_dir(tmp)
            # rename() cannot replace a non-empty folder, so an existing step-N is moved aside
            # first. A crash between the two renames loses that step-N (resume falls back to the
            # step before it); the old copy is only deleted once the new one is in place.
            replaced = self._move_aside(target) if target.exists() else None
            os.rename(tmp, target)
            _fsync_dir(self.directory)
        except BaseException:
            if replaced is not None and not target.exists():
                os.rename(replaced, target)  # the new one never landed: put the old one back
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        self._prune(keep=target)
        return target

    def _prune(self, keep: Path) -> None:
        """Delete complete checkpoints beyond the newest ``keep_last``; spare ``keep`` and best."""
        # Not checkpoints(): this runs in the writer thread, which must not wait for itself.
        complete = self._complete()
        survivors = set(complete[-self.keep_last :]) | {keep}
        if self.keep_best:
            best = _lowest_metric((path, _read_manifest(path)) for path in complete)
            if best is not None:
                survivors.add(best)
        for path in complete:
            if path not in survivors:
                shutil.rmtree(self._move_aside(path), ignore_errors=True)

    def _move_aside(self, path: Path) -> Path:
        """Rename a step folder to a .tmp-* name, durably, before deleting it.

        The rename is atomic, so a crash mid-delete leaves a .tmp-* leftover, never half a step-N.
        """
        doomed = self.directory / f"{_TMP_PREFIX}deleted-{path.name}-{uuid.uuid4().hex[:12]}"
        os.rename(path, doomed)
        _fsync_dir(self.directory)
        return doomed

    def _remove_leftovers(self) -> None:
        for path in self.directory.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(path, ignore_errors=True)

    # -- reading ---------------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first.

        Complete means: a ``step-N`` folder whose manifest parses, names step N, and whose payload
        has the size the manifest records. The checksum is not read here (see :meth:`latest`).
        """
        self._settle()
        return self._complete()

    def latest(self) -> Path | None:
        """The newest checkpoint whose manifest is present and whose checksum matches.

        Incomplete or corrupt newer checkpoints are skipped with a ``warnings.warn`` naming each.
        ``.tmp-*`` folders (writes in progress or cut off by a crash) are ignored.
        """
        self._settle()
        for path in reversed(self._step_folders()):
            problem = _problem(path, verify=True)
            if problem is None:
                return path
            warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
        return None

    def best(self) -> Path | None:
        """The valid checkpoint with the lowest metric (ties: the newest), or None if none has one.

        Corrupt candidates are skipped with a warning, like :meth:`latest`.
        """
        self._settle()
        candidates = []
        for path in self._complete():
            problem = _problem(path, verify=True)
            if problem is None:
                candidates.append((path, _read_manifest(path)))
            else:
                warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
        return _lowest_metric(candidates)

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
                salvaging a checkpoint whose manifest is lost).

        Returns:
            The state dict that was passed to :meth:`save`.

        Raises:
            ResumeError: No checkpoint exists, or the path is missing, incomplete, corrupt or
                cannot be unpickled; the message names the path and the problem.
        """
        self._settle()
        if path is None:
            folder = self.latest()
            if folder is None:
                raise ResumeError(f"no valid checkpoint in {self.directory} to load")
        else:
            folder = self._resolve(Path(path))
        if verify:
            problem = _problem(folder, verify=True)
            if problem is not None:
                raise ResumeError(f"cannot load checkpoint {folder}: {problem}")
        payload = folder / PAYLOAD_NAME
        if not payload.is_file():
            raise ResumeError(f"cannot load checkpoint {folder}: {PAYLOAD_NAME} is missing")
        try:
            state = torch.load(payload, map_location=map_location, weights_only=True)
        except Exception as e:  # torch raises several types here; all mean "unreadable payload".
            raise ResumeError(f"cannot load checkpoint {payload}: unpickling failed: {e}") from e
        if not isinstance(state, dict):
            raise ResumeError(
                f"cannot load checkpoint {payload}: expected a dict, got {type(state).__name__}"
            )
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
        path = Path(path)
        for name in (path.name, path.parent.name):
            match = _STEP_RE.match(name)
            if match:
                return int(match.group(1))
        raise ResumeError(
            f"{path} is not a checkpoint: expected a folder named step-<N> or a file in one"
        )

    def _complete(self) -> list[Path]:
        return [path for path in self._step_folders() if _problem(path, verify=False) is None]

    def _step_folders(self) -> list[Path]:
        """Every ``step-N`` folder, complete or not, ordered by step."""
        folders = [p for p in self.directory.iterdir() if _STEP_RE.match(p.name) and p.is_dir()]
        return sorted(folders, key=self.step_of)

    def _resolve(self, path: Path) -> Path:
        """Map a user's path (folder, payload file, or a name inside the run folder) to a folder."""
        if not path.exists() and not path.is_absolute() and (self.directory / path).exists():
            path = self.directory / path
        if not path.exists():
            raise ResumeError(f"cannot load checkpoint {path}: no such file or folder")
        return path if path.is_dir() else path.parent


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _acquire_lock(directory: Path) -> int:
    """Take a non-blocking exclusive flock on ``directory/.lock`` and record who holds it."""
    lock_path = directory / LOCK_NAME
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _read_holder(fd)
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise CheckpointLockedError(
                f"checkpoint folder {directory} is locked by pid {holder.get('pid', '?')} on host "
                f"{holder.get('host', '?')} (lock file {lock_path}); stop that job, close its "
                f"CheckpointManager, or use another folder"
            ) from e
        raise
    # The lock itself is the flock (released by the kernel if we die); the content only lets the
    # error above say who is holding it.
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
    return fd


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:  # the holder may be between truncate and write
        return {}
    return holder if isinstance(holder, dict) else {}


def _snapshot(obj: Any, where: str, *, copy: bool, memo: dict[Any, Any]) -> Any:
    """Check ``obj`` loads with weights_only; with ``copy``, deep-copy it with tensors on CPU.

    ``memo`` keeps one copy per tensor object and per storage (see :func:`_copy_tensor`), so
    tensors that share storage (tied weights, views) share it in the copy too, as torch.save
    keeps it: the copy saves to the same bytes as the original.
    """
    if isinstance(obj, torch.Tensor):
        if not copy:
            return obj
        if ("tensor", id(obj)) not in memo:
            memo[("tensor", id(obj))] = _copy_tensor(obj, memo)
        return memo[("tensor", id(obj))]
    if type(obj) in _LEAF_TYPES:
        return obj
    if type(obj) in _MAPPING_TYPES:
        items = []
        for key, value in obj.items():
            if type(key) not in _LEAF_TYPES:
                raise ResumeError(
                    f"{where} has a key of type {type(key).__name__} ({key!r}); checkpoint keys "
                    f"must be str, int, float, bool or None to load with weights_only=True"
                )
            items.append((key, _snapshot(value, f"{where}[{key!r}]", copy=copy, memo=memo)))
        if not copy:
            return obj
        result = type(obj)(items)
        # nn.Module.state_dict() attaches per-module versions here; load_state_dict reads them.
        if hasattr(obj, "_metadata"):
            result._metadata = obj._metadata  # type: ignore[attr-defined]
        return result
    if type(obj) in _SEQUENCE_TYPES:
        values = [_snapshot(v, f"{where}[{i}]", copy=copy, memo=memo) for i, v in enumerate(obj)]
        return type(obj)(values) if copy else obj
    raise ResumeError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
        f"torch.load(weights_only=True) cannot load; store plain data instead (tensors, int, "
        f"float, bool, str, None in dicts/lists/tuples), e.g. call .state_dict() on it, "
        f"torch.from_numpy() an array or .item() a numpy scalar. Nothing was written."
    )


def _copy_tensor(tensor: torch.Tensor, memo: dict[Any, Any]) -> torch.Tensor:
    """A detached CPU copy of ``tensor`` that shares a storage copy with the other tensors copied
    through ``memo`` that share its storage.

    Each source storage is copied once, whole, and the tensor rebuilt as a view on the copy with
    the same dtype, offset, size and stride. Copying tensor by tensor would untie tied weights
    (``wte.weight`` and ``lm_head.weight`` are two tensors on one storage): the async checkpoint
    would hold them twice, be larger than the sync one, and load untied. The key is the storage
    itself (its ``_cdata``, as torch.save keys storages) plus the dtype: torch.save refuses one
    storage viewed as two dtypes, so each dtype gets its own copy, which saves as before.
    """
    tensor = tensor.detach()
    if (
        type(tensor) is not torch.Tensor
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.device.type == "meta"
    ):
        # No plain storage to share (sparse, quantized, subclasses) or lazy bits that set_()
        # would drop: copy the tensor alone.
        return tensor.to("cpu", copy=True)
    source = tensor.untyped_storage()
    key = ("storage", source._cdata, tensor.dtype)
    if key not in memo:
        copied = source.clone() if source.device.type == "cpu" else source.cpu()
        # Keep the source alive with its copy, so its _cdata cannot be reused by another storage.
        memo[key] = (source, copied)
    copied = memo[key][1]
    return torch.empty(0, dtype=tensor.dtype).set_(
        copied, tensor.storage_offset(), tensor.size(), tensor.stride()
    )


@contextlib.contextmanager
def _durable_file(path: Path) -> Iterator[BinaryIO]:
    """Open ``path`` for writing and fsync it on success, so it is on disk before the rename."""
    with open(path, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def _write_payload(state: dict[str, Any], path: Path) -> None:
    """torch.save the state durably (the manifest written after it vouches for its bytes)."""
    with _durable_file(path) as f:
        torch.save(state, f)


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable: fsync the folder itself."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_digest(path: Path) -> tuple[str, int]:
    """sha256 hex digest and size of a file, read in chunks to bound memory."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _library_version() -> str:
    # Imported late: the package __init__ imports this module before defining __version__.
    from . import __version__

    return __version__


def _read_manifest(folder: Path) -> dict[str, Any]:
    """Parse and check a manifest; raise ResumeError saying what is wrong with it."""
    manifest_path = folder / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise ResumeError(f"missing manifest {MANIFEST_NAME} (incomplete write?)") from None
    except (OSError, ValueError) as e:
        raise ResumeError(f"unreadable manifest {manifest_path}: {e}") from e
    if not isinstance(manifest, dict):
        raise ResumeError(f"manifest {manifest_path} is not a JSON object")
    if manifest.get(VERSION) != MANIFEST_VERSION:
        raise ResumeError(
            f"manifest {manifest_path} has version {manifest.get(VERSION)!r}, but this "
            f"resumable_data reads version {MANIFEST_VERSION}; "
            f"load it with the release that wrote it"
        )
    missing = [key for key in (STEP, SHA256, SIZE) if key not in manifest]
    if missing:
        raise ResumeError(f"manifest {manifest_path} lacks {missing}")
    return manifest


def _problem(folder: Path, *, verify: bool) -> str | None:
    """What is wrong with a checkpoint folder, or None if it is complete (and, if ``verify``,
    its checksum matches)."""
    if not folder.is_dir():
        return "not a checkpoint folder"
    try:
        manifest = _read_manifest(folder)
    except ResumeError as e:
        return str(e)
    if manifest[STEP] != CheckpointManager.step_of(folder):
        return f"manifest says step {manifest[STEP]} but the folder is {folder.name}"
    payload = folder / PAYLOAD_NAME
    if not payload.is_file():
        return f"{PAYLOAD_NAME} is missing"
    size = payload.stat().st_size
    if size != manifest[SIZE]:
        return (
            f"{PAYLOAD_NAME} has {size} bytes but the manifest records {manifest[SIZE]} "
            f"(truncated?)"
        )
    if verify:
        sha256, _ = _file_digest(payload)
        if sha256 != manifest[SHA256]:
            return (
                f"checksum mismatch: {PAYLOAD_NAME} has sha256 {sha256}, "
                f"manifest records {manifest[SHA256]}"
            )
    return None


def _lowest_metric(candidates: Iterable[tuple[Path, dict[str, Any]]]) -> Path | None:
    """The path whose manifest metric is lowest (NaN and None never win; ties go to the newest).

    ``candidates`` come oldest first.
    """
    best: tuple[float, Path] | None = None
    for path, manifest in candidates:
        metric = manifest.get(METRIC)
        if metric is None or math.isnan(metric):
            continue
        if best is None or metric <= best[0]:
            best = (metric, path)
    return None if best is None else best[1]
