"""The checkpoint manifest: what it holds, how it is written, and how a folder is judged valid.

A manifest is data to distrust: a disk, a copy tool or a person can leave anything in it. It is read
with bounds (at most :data:`MAX_MANIFEST_BYTES`, a regular file only, JSON nested at most
:data:`MAX_DEPTH` deep, checked *before* the parser runs, so no input can exhaust the stack or
memory), and every field is type-checked into a :class:`Manifest`. Anything odd makes the checkpoint
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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.state import VERSION, brief, is_int
from ..core.version import __version__
from ..errors import ResumeError

__all__ = [
    "MANIFEST_NAME",
    "PAYLOAD_NAME",
    "Manifest",
    "checkpoint_problem",
    "file_digest",
    "read_json_object",
    "read_manifest",
    "refuse_to_replace_newer",
    "step_folders",
    "written_by_newer",
]

MANIFEST_VERSION = 1
PAYLOAD_NAME = "state.pt"
MANIFEST_NAME = "manifest.json"
STEP_RE = re.compile(r"^step-(\d+)$")
# A real manifest is about 400 bytes of flat JSON.
MAX_MANIFEST_BYTES = 64 * 1024
MAX_DEPTH = 4
_HASH_CHUNK = 1 << 20
_LAST_TIMESTAMP = 253402300799  # 9999-12-31T23:59:59Z, the last time datetime can show
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_OPENING = frozenset(b"[{")
_CLOSING = frozenset(b"]}")
_QUOTE, _BACKSLASH = ord('"'), ord("\\")

# Manifest keys, declared once.
STEP = "step"
CREATED = "created"
CREATED_ISO = "created_iso"
PAYLOAD = "payload"
SHA256 = "sha256"
SIZE = "size"
LIBRARY_VERSION = "library_version"
METRIC = "metric"


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
        created = time.time() if self.created is None else self.created
        record = {
            VERSION: MANIFEST_VERSION,
            STEP: self.step,
            CREATED: created,
            CREATED_ISO: datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat(),
            PAYLOAD: PAYLOAD_NAME,
            SHA256: self.sha256,
            SIZE: self.size,
            LIBRARY_VERSION: self.library_version or __version__,
            METRIC: self.metric,
        }
        return (json.dumps(record, indent=2) + "\n").encode()


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


def read_json_object(path: Path, *, max_bytes: int) -> dict[str, Any]:
    """Read a manifest-like JSON object with bounded effort: a regular file of at most ``max_bytes``,
    nested at most :data:`MAX_DEPTH` deep (checked before the parser runs).

    Raises:
        ResumeError: Missing, not a regular file, too large, too deep, not JSON, or not an object.
    """
    raw = _read_bounded(path, max_bytes)
    depth = _nesting_depth(raw)
    if depth > MAX_DEPTH:
        raise ResumeError(f"manifest {path} is nested {depth} levels deep (at most {MAX_DEPTH} allowed)")
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError covers bad UTF-8 and over-long integers
        raise ResumeError(f"manifest {path} is not valid JSON: {e}") from None
    if not isinstance(record, dict):
        raise ResumeError(f"manifest {path} is not a JSON object but {type(record).__name__}")
    return record


def _read_bounded(path: Path, max_bytes: int) -> bytes:
    # O_NONBLOCK: a FIFO planted under the name must not hang the reader; it is refused below anyway.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ResumeError(f"missing manifest {MANIFEST_NAME} (incomplete write?)") from None
    except OSError as e:
        raise ResumeError(f"unreadable manifest {path}: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ResumeError(f"manifest {path} is not a regular file")
        if info.st_size > max_bytes:
            raise ResumeError(f"manifest {path} has {info.st_size} bytes (at most {max_bytes} allowed)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise ResumeError(f"unreadable manifest {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(raw) > max_bytes:  # grew while being read
        raise ResumeError(f"manifest {path} has more than {max_bytes} bytes")
    return raw


def _nesting_depth(raw: bytes) -> int:
    """How deep arrays and objects nest, ignoring brackets inside strings: one linear pass, no
    recursion (a regex over strings would rescan from every stray quote)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:  # every real manifest: one object
        return MAX_DEPTH
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == _BACKSLASH:
                escaped = True
            elif byte == _QUOTE:
                in_string = False
        elif byte == _QUOTE:
            in_string = True
        elif byte in _OPENING:
            depth += 1
            deepest = max(deepest, depth)
        elif byte in _CLOSING:
            depth -= 1
    return deepest


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
    created = field(CREATED, lambda v: _is_number(v) and 0 <= v <= _LAST_TIMESTAMP, "a Unix time", required=False)
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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and _fits_float(value)


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


def checkpoint_problem(folder: Path, *, verify: bool, check_name: bool = True) -> str | None:
    """What is wrong with a checkpoint folder, or None if it is complete (and, with ``verify``, its
    payload's sha256 matches the manifest). Never raises for anything found on disk.

    Args:
        check_name: Require the folder's ``step-N`` name to match the manifest's step (False for a
            checkpoint copied elsewhere under another name).
    """
    if not folder.is_dir():
        return "not a checkpoint folder"
    try:
        manifest = read_manifest(folder)
    except ResumeError as e:
        return str(e)
    if check_name and (problem := name_problem(folder, manifest.step)) is not None:
        return problem
    payload = folder / PAYLOAD_NAME
    try:
        info = payload.stat()
    except OSError:
        return f"{PAYLOAD_NAME} is missing"
    if not stat.S_ISREG(info.st_mode):
        return f"{PAYLOAD_NAME} is not a regular file"
    if info.st_size != manifest.size:
        return f"{PAYLOAD_NAME} has {info.st_size} bytes but the manifest records {manifest.size} (truncated?)"
    if verify:
        try:
            sha256, _ = file_digest(payload)
        except OSError as e:
            return f"{PAYLOAD_NAME} is unreadable: {e.strerror}"
        if sha256 != manifest.sha256:
            return f"checksum mismatch: {PAYLOAD_NAME} has sha256 {sha256}, manifest records {manifest.sha256}"
    return None
