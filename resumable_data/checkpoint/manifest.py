"""The checkpoint manifests: what they hold, how they are written, and how a folder is judged valid.

Two formats share the keys declared here: a :class:`Manifest` records the one payload of a
:class:`CheckpointManager` folder; a :class:`DcpManifest` records every file of a ``DcpStore``
folder (DCP's shards and index, and the payloads written beside them).

A manifest is data to distrust: a disk, a copy tool or a person can leave anything in it. It is read
with bounds (at most :data:`MAX_MANIFEST_BYTES`, a regular file only, JSON nested at most a few
levels deep: see :mod:`.bounded_json`), and every field is type-checked into a :class:`Manifest`. Anything odd makes the checkpoint
*invalid*, with a one-line reason; the manager then skips it with a warning, as it skips a corrupt
payload.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

from ..core.state import VERSION, brief, is_int
from ..core.version import __version__
from ..errors import ResumeError
from .bounded_json import read_json_object

__all__ = [
    "DCP_METADATA",
    "MANIFEST_NAME",
    "PAYLOAD_NAME",
    "DcpManifest",
    "Manifest",
    "checkpoint_problem",
    "dcp_checkpoint_problem",
    "file_digest",
    "is_dcp_folder",
    "read_dcp_manifest",
    "read_json_object",
    "read_manifest",
    "refuse_to_replace_newer",
    "step_folders",
    "verify_payload",
    "written_by_newer",
]

MANIFEST_VERSION = 1
PAYLOAD_NAME = "state.pt"
MANIFEST_NAME = "manifest.json"
STEP_RE = re.compile(r"^step-(\d+)$")
# A real manifest is about 400 bytes of flat JSON.
MAX_MANIFEST_BYTES = 64 * 1024
DCP_MANIFEST_VERSION = 1
# DCP's own index of the shards: written last by DCP's coordinator, so a folder without it is incomplete.
DCP_METADATA = ".metadata"
# One entry of about 120 bytes per file: room for tens of thousands of ranks' shards.
MAX_DCP_MANIFEST_BYTES = 16 * 1024 * 1024
_HASH_CHUNK = 1 << 20
_LAST_TIMESTAMP = 253402300799  # 9999-12-31T23:59:59Z, the last time datetime can show
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

# Manifest keys, declared once; the DCP manifest uses the first six and the last three.
STEP = "step"
CREATED = "created"
CREATED_ISO = "created_iso"
SHA256 = "sha256"
SIZE = "size"
LIBRARY_VERSION = "library_version"
PAYLOAD = "payload"
METRIC = "metric"
KIND = "kind"
KIND_DCP = "dcp"
FILES = "files"
PAYLOADS = "payloads"


@dataclass(frozen=True)
class Manifest:
    """The typed content of a ``manifest.json``.

    Attributes:
        step: The training step; must match the folder's ``step-N`` name.
        sha256: Hex digest of the payload.
        size: Payload size in bytes.
        metric: Lower is better; None if none was given (NaN is kept and never counts as best).
        created: Unix time of the write, if recorded.
        library_version: The resumable_data release that wrote it, if recorded.
    """

    step: int
    sha256: str
    size: int
    metric: float | None = None
    created: float | None = None
    library_version: str | None = None

    def to_json(self) -> bytes:
        """The file content, with the wall-clock time in both machine and human form."""
        record = {
            VERSION: MANIFEST_VERSION,
            STEP: self.step,
            **_created(self.created),
            PAYLOAD: PAYLOAD_NAME,
            SHA256: self.sha256,
            SIZE: self.size,
            LIBRARY_VERSION: self.library_version or __version__,
            METRIC: self.metric,
        }
        return (json.dumps(record, indent=2) + "\n").encode()


@dataclass(frozen=True)
class DcpManifest:
    """The typed content of a DCP step folder's ``manifest.json``.

    Attributes:
        step: The training step; must match the folder's ``step-N`` name.
        files: Every file of the folder but the manifest, by name: ``(size, sha256)``.
        payloads: The names among ``files`` written by ``DcpStore.publish`` (weights-only).
        created: Unix time of the write.
        library_version: The resumable_data release that wrote it.
    """

    step: int
    files: dict[str, tuple[int, str]]
    payloads: tuple[str, ...] = ()
    created: float | None = None
    library_version: str | None = None

    def to_json(self) -> bytes:
        record = {
            VERSION: DCP_MANIFEST_VERSION,
            KIND: KIND_DCP,
            STEP: self.step,
            **_created(self.created),
            LIBRARY_VERSION: self.library_version or __version__,
            PAYLOADS: list(self.payloads),
            FILES: {name: {SIZE: size, SHA256: sha256} for name, (size, sha256) in sorted(self.files.items())},
        }
        return (json.dumps(record, indent=1) + "\n").encode()

    @property
    def total_bytes(self) -> int:
        return sum(size for size, _ in self.files.values())


def _created(created: float | None) -> dict[str, Any]:
    """The time of a write (now if None), in machine and human form."""
    created = time.time() if created is None else created
    return {CREATED: created, CREATED_ISO: datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat()}


def plain_name(name: Any) -> bool:
    """Whether ``name`` names a file inside a folder: no path separator, not ``.`` or ``..``."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def step_of(path: str | os.PathLike[str]) -> int:
    """The step of a ``step-N`` folder or of a file in one, read from the name.

    Raises:
        ResumeError: Neither the path nor its parent is named ``step-N``.
    """
    path = Path(path)
    for name in (path.name, path.parent.name):
        match = STEP_RE.match(name)
        if match:
            return int(match.group(1))
    raise ResumeError(f"{path} is not a checkpoint: expected a folder named step-<N> or a file in one")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_folders(directory: Path) -> list[Path]:
    """Every ``step-N`` folder (or symlink to one) in ``directory``, complete or not, ordered by step."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if STEP_RE.match(p.name) and p.is_dir()), key=step_of)


def written_by_newer(folder: Path, reads: int, *, max_bytes: int = MAX_MANIFEST_BYTES) -> int | None:
    """The manifest version of ``folder`` when it is above ``reads`` (a newer release wrote the folder,
    complete as far as anyone here can tell), else None. Never raises for anything found on disk.

    Such a folder is never pruned or replaced: this release cannot judge it, so it keeps it.
    """
    try:
        version = read_json_object(folder / MANIFEST_NAME, max_bytes=max_bytes).get(VERSION)
    except ResumeError:
        return None
    return version if is_int(version) and version > reads else None


def refuse_to_replace_newer(folder: Path, reads: int, *, max_bytes: int = MAX_MANIFEST_BYTES) -> None:
    """Refuse to save over ``folder`` when a newer release wrote it (see :func:`written_by_newer`).

    Raises:
        ResumeError: naming the folder, both manifest versions and what to do.
    """
    version = written_by_newer(folder, reads, max_bytes=max_bytes)
    if version is not None:
        raise ResumeError(
            f"cannot save {folder}: a newer resumable_data wrote it (manifest version {version}, this release "
            f"writes version {reads}), and it is never replaced; continue with that release, or save into another folder"
        )


def read_manifest(folder: Path) -> Manifest:
    """Read and check ``folder/manifest.json`` with bounded effort.

    Raises:
        ResumeError: The manifest is missing, not a regular file, too large, too deeply nested, not
            JSON, or has a missing or mistyped field; the message names the file and the field.
    """
    path = folder / MANIFEST_NAME
    return _typed(read_json_object(path, max_bytes=MAX_MANIFEST_BYTES), path)


def _typed(record: Mapping[str, Any], path: Path) -> Manifest:
    def field(key: str, ok: Any, expected: str, *, required: bool) -> Any:
        if key not in record:
            if required:
                raise ResumeError(f"manifest {path} lacks the field {key!r}")
            return None
        value = record[key]
        if not ok(value):
            raise ResumeError(f"manifest {path} field {key!r} must be {expected}, but got {brief(value)}")
        return value

    version = record.get(VERSION)
    if not is_int(version) or version != MANIFEST_VERSION:
        raise ResumeError(
            f"manifest {path} has version {brief(version)}, but this resumable_data reads version "
            f"{MANIFEST_VERSION}; load it with the release that wrote it"
        )
    step = field(STEP, lambda v: is_int(v) and v >= 0, "an int >= 0", required=True)
    sha256 = field(
        SHA256, lambda v: isinstance(v, str) and _SHA256_RE.match(v), "64 lowercase hex digits", required=True
    )
    size = field(SIZE, lambda v: is_int(v) and v >= 0, "an int >= 0", required=True)
    field(PAYLOAD, lambda v: v == PAYLOAD_NAME, repr(PAYLOAD_NAME), required=False)
    metric = field(METRIC, lambda v: v is None or _is_number(v), "a number or null", required=False)
    created = field(CREATED, _is_time, "a Unix time", required=False)
    field(CREATED_ISO, lambda v: isinstance(v, str), "a string", required=False)
    library = field(LIBRARY_VERSION, lambda v: isinstance(v, str), "a string", required=False)
    return Manifest(
        step=step,
        sha256=sha256,
        size=size,
        metric=None if metric is None else float(metric),
        created=None if created is None else float(created),
        library_version=library,
    )


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and _fits_float(value)


def _is_time(value: Any) -> TypeGuard[int | float]:
    return _is_number(value) and 0 <= value <= _LAST_TIMESTAMP


def _fits_float(value: int | float) -> bool:
    try:
        float(value)
    except OverflowError:
        return False
    return True


def file_digest(path: Path) -> tuple[str, int]:
    """sha256 hex digest and size of a file, read in chunks to bound memory."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def name_problem(folder: Path, step: int) -> str | None:
    """Why the folder's ``step-N`` name does not match the manifest's ``step``, or None."""
    try:
        folder_step = step_of(folder)
    except ResumeError as e:
        return str(e)
    if step != folder_step:
        return f"manifest says step {step} but the folder is {folder.name}"
    return None


_Read = TypeVar("_Read", Manifest, DcpManifest)


def _named_manifest(folder: Path, read: Callable[[Path], _Read], *, check_name: bool) -> _Read | str:
    """The manifest of a step folder, or why there is none that fits the folder."""
    if not folder.is_dir():
        return "not a checkpoint folder"
    try:
        manifest = read(folder)
    except ResumeError as e:
        return str(e)
    if check_name and (problem := name_problem(folder, manifest.step)) is not None:
        return problem
    return manifest


def _files_problem(folder: Path, files: Mapping[str, tuple[int, str]], *, verify: bool, follow: bool) -> str | None:
    """The first file that is not as recorded: sizes of all first (cheap), then, with ``verify``, sha256s.

    Args:
        follow: Accept a symlink to a regular file (a payload someone linked in); DCP folders do not.
    """
    for name, (size, _) in files.items():
        try:
            info = (folder / name).stat() if follow else (folder / name).lstat()
        except OSError:
            return f"{name} is missing"
        if not stat.S_ISREG(info.st_mode):
            return f"{name} is not a regular file"
        if info.st_size != size:
            return f"{name} has {info.st_size} bytes but the manifest records {size} (truncated?)"
    if verify:
        for name, (_, sha256) in files.items():
            try:
                actual, _ = file_digest(folder / name)
            except OSError as e:
                return f"{name} is unreadable: {e.strerror}"
            if actual != sha256:
                return f"checksum mismatch: {name} has sha256 {actual}, manifest records {sha256}"
    return None


def checkpoint_problem(folder: Path, *, verify: bool, check_name: bool = True) -> str | None:
    """What is wrong with a checkpoint folder, or None if it is complete (and, with ``verify``, its
    payload's sha256 matches the manifest). Never raises for anything found on disk.

    Args:
        check_name: Require the folder's ``step-N`` name to match the manifest's step (False for a
            checkpoint copied elsewhere under another name).
    """
    manifest = _named_manifest(folder, read_manifest, check_name=check_name)
    if isinstance(manifest, str):
        return manifest
    return _files_problem(folder, {PAYLOAD_NAME: (manifest.size, manifest.sha256)}, verify=verify, follow=True)


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
            f"{brief(version)}, kind {brief(record.get(KIND))}); load it with the release that wrote it"
        )
    step = record.get(STEP)
    if not is_int(step) or step < 0:
        raise ResumeError(f"manifest {path} field {STEP!r} must be an int >= 0, but got {brief(step)}")
    raw_files = record.get(FILES)
    if not isinstance(raw_files, dict) or not raw_files:
        raise ResumeError(f"manifest {path} field {FILES!r} must be a non-empty object, but got {brief(raw_files)}")
    files: dict[str, tuple[int, str]] = {}
    for name, entry in raw_files.items():
        if not plain_name(name):
            raise ResumeError(f"manifest {path} names the file {brief(name)}, which is not a plain file name")
        size = entry.get(SIZE) if isinstance(entry, dict) else None
        sha256 = entry.get(SHA256) if isinstance(entry, dict) else None
        if not (is_int(size) and size >= 0 and isinstance(sha256, str) and _SHA256_RE.match(sha256)):
            raise ResumeError(
                f"manifest {path} entry for {name!r} must be {{size: int >= 0, sha256: 64 hex digits}}, "
                f"but got {brief(entry)}"
            )
        files[name] = (size, sha256)
    if DCP_METADATA not in files:
        raise ResumeError(f"manifest {path} lists no {DCP_METADATA}: not a complete DCP checkpoint")
    payloads = record.get(PAYLOADS, [])
    if not isinstance(payloads, list) or not all(isinstance(p, str) and p in files for p in payloads):
        raise ResumeError(
            f"manifest {path} field {PAYLOADS!r} must list files of the folder, but got {brief(payloads)}"
        )
    created = record.get(CREATED)
    library = record.get(LIBRARY_VERSION)
    return DcpManifest(
        step=step,
        files=files,
        payloads=tuple(payloads),
        # Informational only: a time that is not one (too large for a float, or for a date) is dropped.
        created=float(created) if _is_time(created) else None,
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
    manifest = _named_manifest(folder, read_dcp_manifest, check_name=check_name)
    if isinstance(manifest, str):
        return manifest
    return _files_problem(folder, manifest.files, verify=verify, follow=False)


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
