"""Read a manifest file as a JSON object with bounded effort, whatever is on disk.

A manifest is data to distrust: a disk, a copy tool or a person can leave anything in it. It is read
as a regular file only, of at most ``max_bytes``, nested at most :data:`MAX_DEPTH` deep (checked
*before* the parser runs, so no input can exhaust the stack or memory); a FIFO planted under its name
does not hang the reader.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import ResumeError

__all__ = ["MAX_DEPTH", "read_json_object"]

MAX_DEPTH = 4
_OPENING = frozenset(b"[{")
_CLOSING = frozenset(b"]}")
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


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
        raise ResumeError(f"missing manifest {path.name} (incomplete write?)") from None
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
