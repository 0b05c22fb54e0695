"""A DCP storage writer whose failed writes say why: the OS error (errno, reason, file), not torch's
serializer's ``[enforce fail at inline_container.cc ...] unexpected pos``.

DCP writes each tensor with ``torch.save`` into its shard file. When the file's ``write`` fails (disk
full, quota, file too large, I/O error) torch reports only a ``RuntimeError`` about a stream position:
the errno and the path are lost. The writer here opens its files through a file system that
remembers the first ``OSError`` a write raised, and raises *that* (with the file's path) in place of
the serializer's error. It is imported only when a save asks for it (:meth:`DcpStore.writer`),
because importing ``torch.distributed.checkpoint`` costs about a second.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

__all__ = ["ErrnoFileSystemWriter"]


class _RecordingFileSystem(FileSystem):
    """DCP's local file system, but each written file remembers the first ``OSError`` of its writes."""

    def __init__(self) -> None:
        self.error: OSError | None = None
        self._lock = threading.Lock()  # DCP may write with several threads

    def record(self, error: OSError) -> None:
        with self._lock:
            self.error = self.error or error

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with io.BufferedWriter(_RecordingFile(Path(path), self)) as stream:
            yield stream


class _RecordingFile(io.FileIO):
    """A file opened for writing whose failed writes are recorded with its path (an ``OSError`` raised
    by ``FileIO.write`` names no file)."""

    def __init__(self, path: Path, file_system: _RecordingFileSystem) -> None:
        super().__init__(path, "w")
        self._path = path
        self._file_system = file_system

    def write(self, data: Any) -> int:
        try:
            return super().write(data)
        except OSError as e:
            self._file_system.record(OSError(e.errno, e.strerror, str(self._path)))
            raise


class ErrnoFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose failed write raises the OS error, naming the file, with its errno.

    Args:
        path: The folder DCP writes into.
        **kwargs: ``FileSystemWriter``'s options.
    """

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        # FileSystemWriter reaches its files through ``self.fs``, a public FileSystemBase seam.
        self.fs: _RecordingFileSystem = _RecordingFileSystem()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self.fs.error = None

    def write_data(self, plan: Any, planner: Any) -> Any:
        with self._os_error():
            return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        with self._os_error():
            super().finish(metadata, results)

    @contextlib.contextmanager
    def _os_error(self) -> Iterator[None]:
        """Raise the first recorded OS error in place of what the write raised: torch.save's
        RuntimeError, or an OSError that names no file."""
        try:
            yield
        except (OSError, RuntimeError) as e:
            if self.fs.error is None or e is self.fs.error:
                raise
            raise self.fs.error from e
