"""Durable file operations for checkpoints: fsynced writes, fsynced folders, removal that handles
symlinks, and OS errors that survive torch's serializer.

``torch.save`` into a file whose ``write`` fails (disk full, quota, file too large, I/O error)
raises ``RuntimeError: [enforce fail at inline_container.cc ...] unexpected pos``: the OS error, its
errno and the path are lost. :func:`write_payload` records the first OS error its file raised and
raises *that* instead, so the caller can say what really happened.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import torch

__all__ = ["durable_file", "fsync_dir", "fsync_file", "make_dirs", "remove_tree", "write_error", "write_payload"]


@contextlib.contextmanager
def durable_file(path: Path) -> Iterator[BinaryIO]:
    """Open ``path`` for writing and fsync it on success, so it is on disk before any rename."""
    with open(path, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


class _ErrorRecorder(io.RawIOBase):
    """A write-only view of a file that remembers the first OSError its writes raised."""

    def __init__(self, file: BinaryIO) -> None:
        super().__init__()
        self._file = file
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as e:
            self.error = self.error or e
            raise


def write_payload(state: dict[str, Any], path: Path) -> None:
    """``torch.save`` the state to ``path`` durably.

    Raises:
        OSError: The OS refused a write (with its errno), even when torch reports it as a RuntimeError.
    """
    with durable_file(path) as f:
        recorder = _ErrorRecorder(f)
        try:
            # A RawIOBase is a binary file at runtime; typeshed just does not call it IO[bytes].
            torch.save(state, cast(IO[bytes], recorder))
        except RuntimeError as e:
            if recorder.error is not None:
                raise recorder.error from e
            raise


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable: fsync the folder itself."""
    _fsync_path(path)


def fsync_file(path: Path) -> None:
    """Flush a file that another process (or library) wrote to disk: fsync makes the inode's data
    durable whichever descriptor wrote it."""
    _fsync_path(path)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """Create ``path`` and any missing parents durably: each new folder's entry in its parent is
    fsynced, so a power loss cannot take the folder, and the checkpoints in it, away.

    Raises:
        OSError: A folder could not be created or synced.
    """
    missing = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except FileExistsError:  # another process created it meanwhile; still make its entry durable
            if not folder.is_dir():
                raise
        fsync_dir(folder.parent)


def remove_tree(path: Path) -> None:
    """Remove a folder with its content, or just the link if ``path`` is a symlink (never what it
    points to), or a plain file.

    Raises:
        OSError: Something could not be removed.
    """
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def write_error(target: Path, error: OSError, outcome: str) -> OSError:
    """The ``OSError`` a failed checkpoint write raises: ``target``, the OS's reason and ``outcome``
    (what is left on disk), keeping the ``errno`` so a caller can still tell ENOSPC from EIO."""
    message = (
        f"cannot write checkpoint {target}: {error.strerror or error}; {outcome} "
        "(free space, fix permissions, or use another folder)"
    )
    return OSError(message) if error.errno is None else OSError(error.errno, message)
