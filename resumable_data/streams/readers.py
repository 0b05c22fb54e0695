"""Ready-made shard readers that seek in O(1): token windows from memmapped arrays, text lines.

Both raise :class:`~resumable_data.ResumeError` naming the shard and the offset when a shard is
missing, or shorter than a saved cursor (truncated or replaced since the checkpoint), before
yielding anything.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, BinaryIO

import numpy as np
import torch

from ..core.state import check_int_arg
from ..errors import ResumeError

__all__ = ["TextLineReader", "TokenShardReader", "file_identity"]

_EDGE = 4096  # bytes read at each end of a shard for its identity
_MAPPED_SHARDS = 64  # token shards a reader keeps mapped
_CHUNK = 32  # windows a reader makes at a time (see TokenShardReader._windows)


def file_identity(file: BinaryIO) -> str:
    """``"size:digest"`` of a binary file: its size and a BLAKE2b digest of its first and last 4 KiB.

    The shard identity the ready-made readers give (:attr:`ShardedIterable` keeps it for the
    shards being read): a truncated, extended or rewritten file changes its size or its edges
    (a Parquet file's footer is its last bytes), at the cost of two small reads.
    """
    size = file.seek(0, os.SEEK_END)
    file.seek(0)
    digest = hashlib.blake2b(file.read(_EDGE), digest_size=8)
    if size > _EDGE:
        file.seek(max(_EDGE, size - _EDGE))
        digest.update(file.read(_EDGE))
    return f"{size}:{digest.hexdigest()}"


def _path_identity(shard: Any, what: str) -> str:
    path = os.fspath(shard)
    try:
        with open(path, "rb") as file:
            return file_identity(file)
    except FileNotFoundError as exc:
        raise ResumeError(f"{what} shard {path!r} is missing: {exc}") from exc


def _npy_length(path: str, size: int) -> int | None:
    """The length of the array in a ``.npy`` file of ``size`` bytes, from its header alone (None for
    a format version other than 1.0 and 2.0, which numpy writes only for exotic dtypes).

    Raises:
        ValueError: the header is not one numpy reads, or the data is shorter than it says.
    """
    with open(path, "rb") as file:
        version = np.lib.format.read_magic(file)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(file)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(file)
        else:
            return None
        data = file.tell()
    if not shape:
        raise ValueError("it holds a 0-d array, not a sequence of tokens")
    needed = data + int(np.prod(shape)) * dtype.itemsize
    if size < needed:
        raise ValueError(f"its header needs {needed} bytes, the file holds {size}")
    return int(shape[0])


class TokenShardReader:
    """Fixed-length token windows from a ``.npy`` file or a raw ``.bin`` token file, via memmap.

    Record ``i`` of a shard is ``tokens[i * stride : i * stride + window]`` as an int64 tensor; a
    tail shorter than ``window`` is not a record. Seeking to record ``i`` is a slice of the memmap:
    O(1), and only the pages of the records actually read are touched.

    Args:
        window: tokens per record (e.g. ``block_size + 1`` for next-token targets).
        stride: tokens between record starts (default ``window``: non-overlapping windows).
        dtype: element type of raw ``.bin`` files (``.npy`` files carry their own).

    Example::

        reader = TokenShardReader(1025)  # 1024 inputs + 1 shifted target
        stream = ShardedIterable(sorted(glob("tokens/*.bin")), read_shard=reader)
        window = next(iter(stream))  # torch.int64 tensor of 1025 tokens
    """

    def __init__(self, window: int, *, stride: int | None = None, dtype: Any = np.uint16) -> None:
        self.window = check_int_arg("window", window, minimum=1)
        self.stride = window if stride is None else check_int_arg("stride", stride, minimum=1)
        self.dtype = np.dtype(dtype)
        self._mapped: OrderedDict[tuple[str, int, int], np.ndarray] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        # A worker maps the files itself; mappings are not sent along.
        return {**self.__dict__, "_mapped": OrderedDict()}

    def tokens(self, shard: Any) -> np.ndarray:
        """The shard's tokens as a read-only memmap (an empty array for an empty file).

        The last few shards' mappings are kept, keyed by path, size and modification time: a
        shuffled read fetches a handful of records from each of many shards at a time, and mapping
        a file costs far more than reading a window from it. A file rewritten since is mapped anew.
        """
        path = os.fspath(shard)
        try:
            stat = os.stat(path)
        except FileNotFoundError as exc:
            raise ResumeError(f"token shard {path!r} is missing: {exc}") from exc
        key = (path, stat.st_size, stat.st_mtime_ns)
        tokens = self._mapped.get(key)
        if tokens is None:
            tokens = self._map(path, stat.st_size)
            self._mapped[key] = tokens
            if len(self._mapped) > _MAPPED_SHARDS:
                self._mapped.popitem(last=False)
        else:
            self._mapped.move_to_end(key)
        return tokens

    def _map(self, path: str, size: int) -> np.ndarray:
        try:
            if path.endswith(".npy"):
                return np.load(path, mmap_mode="r")
            if size % self.dtype.itemsize:
                raise ResumeError(
                    f"token shard {path!r} holds {size} bytes, not a multiple of {self.dtype.itemsize} "
                    f"({self.dtype}): it is truncated or written with another dtype"
                )
            if size == 0:  # numpy refuses to memmap an empty file
                return np.empty(0, dtype=self.dtype)
            return np.memmap(path, dtype=self.dtype, mode="r")
        except FileNotFoundError as exc:
            raise ResumeError(f"token shard {path!r} is missing: {exc}") from exc
        except ValueError as exc:  # np.load on a .npy whose data is shorter than its header says
            raise ResumeError(f"token shard {path!r} is unreadable or truncated: {exc}") from exc

    def num_records(self, shard: Any) -> int:
        """Windows in the shard, from its size (and a ``.npy`` file's header): the file is not mapped.

        What a :class:`ShardedIterable` asks of every shard when it is built, so it costs one
        ``stat`` per raw shard; the checks are those of mapping it (:meth:`tokens`).
        """
        path = os.fspath(shard)
        try:
            size = os.stat(path).st_size
            if path.endswith(".npy"):
                length = _npy_length(path, size)
                return self._count(len(self.tokens(shard)) if length is None else length)
        except FileNotFoundError as exc:
            raise ResumeError(f"token shard {path!r} is missing: {exc}") from exc
        except ResumeError:
            raise
        except ValueError as exc:  # a header numpy cannot read, as np.load would refuse it
            raise ResumeError(f"token shard {path!r} is unreadable or truncated: {exc}") from exc
        if size % self.dtype.itemsize:
            raise ResumeError(
                f"token shard {path!r} holds {size} bytes, not a multiple of {self.dtype.itemsize} "
                f"({self.dtype}): it is truncated or written with another dtype"
            )
        return self._count(size // self.dtype.itemsize)

    def identity(self, shard: Any) -> str:
        """The shard's size and a digest of its first and last bytes (see :func:`file_identity`)."""
        return _path_identity(shard, "token")

    def count_windows(self, n_tokens: int) -> int:
        """Records in a shard of ``n_tokens`` tokens: how an index file's token counts give the sizes
        (:meth:`ShardedIterable.from_index`) without opening a shard."""
        return self._count(n_tokens)

    def _count(self, n_tokens: int) -> int:
        return 0 if n_tokens < self.window else (n_tokens - self.window) // self.stride + 1

    def __call__(self, shard: Any, start: int) -> Iterator[torch.Tensor]:
        """Windows from record offset ``start``."""
        tokens = self.tokens(shard)
        n = self._count(len(tokens))
        if start > n:
            raise ResumeError(
                f"token shard {os.fspath(shard)!r} has {n} windows but the cursor is at offset {start}: "
                "the shard is shorter than when the checkpoint was written (truncated or replaced?)"
            )
        return self._windows(tokens.view(np.ndarray), range(start, n))

    def read_records(self, shard: Any, offsets: Sequence[int]) -> list[torch.Tensor]:
        """The windows at record ``offsets`` (ascending), with the shard mapped once for all of them.

        What a shuffle buffer's restore calls: up to a buffer's worth of scattered windows cost one
        open and one slice each, not one open each. Each window gets its own tensor storage, as
        from :meth:`__call__`.
        """
        tokens = self.tokens(shard)
        n = self._count(len(tokens))
        if offsets and (offsets[0] < 0 or offsets[-1] >= n):
            bad = offsets[-1] if offsets[-1] >= n else offsets[0]
            raise ResumeError(
                f"token shard {os.fspath(shard)!r} has {n} windows but the checkpoint needs the one at "
                f"offset {bad}: the shard is shorter than when the checkpoint was written (truncated or replaced?)"
            )
        return list(self._windows(tokens.view(np.ndarray), offsets))

    def _windows(self, tokens: np.ndarray, offsets: Iterable[int]) -> Iterator[torch.Tensor]:
        # ``tokens`` is a plain ndarray view of the memmap: slicing the np.memmap subclass itself
        # costs several times more per window. Windows are made _CHUNK at a time, in one tight
        # loop: a consumer that does real work per record (a map, a training step) between two
        # reads leaves each read with cold caches, and a read then costs about twice as much.
        stride, window = self.stride, self.window
        offsets = iter(offsets)
        while chunk := [
            torch.from_numpy(tokens[i * stride : i * stride + window].astype(np.int64))
            for i in itertools.islice(offsets, _CHUNK)
        ]:
            yield from chunk


class TextLineReader:
    """Lines of a text or JSONL file; the cursor is a byte offset, so a restore seeks, not replays.

    Each line (without its newline) is decoded and passed to ``parse`` (e.g. ``json.loads``).
    Offsets are bytes: a restore checks that the saved offset is at a line start of the file and
    ``seek``\\ s there.

    Args:
        parse: applied to each decoded line; the line string itself when None.
        encoding: text encoding of the file.

    Example::

        stream = ShardedIterable(["a.jsonl", "b.jsonl"], read_shard=TextLineReader(json.loads))
        stream.state_dict()["remaining"]  # [[shard index, name, byte offset], ...]
    """

    def __init__(self, parse: Callable[[str], Any] | None = None, *, encoding: str = "utf-8") -> None:
        self.parse = parse
        self.encoding = encoding

    def identity(self, shard: Any) -> str:
        """The file's size and a digest of its first and last bytes (see :func:`file_identity`)."""
        return _path_identity(shard, "text")

    def read_from(self, shard: Any, start: int) -> Iterator[tuple[int, Any]]:
        """``(byte offset after the line, parsed line)`` from byte offset ``start``."""
        path = os.fspath(shard)
        with self._open(path, start) as file:
            self._seek_line(file, path, start)
            offset = start
            for line in file:
                offset += len(line)
                yield offset, self._decode(line)

    def read_records(self, shard: Any, offsets: Sequence[int]) -> list[Any]:
        """The parsed lines at byte ``offsets`` (ascending), from one open of the file.

        What a shuffle buffer's restore calls; consecutive lines are read without seeking.
        """
        path = os.fspath(shard)
        if not offsets:
            return []
        records = []
        with self._open(path, offsets[0]) as file:
            position = -1
            for offset in offsets:
                if offset != position:
                    self._seek_line(file, path, offset)
                line = file.readline()
                if not line:
                    raise ResumeError(
                        f"text shard {path!r} has no line at byte {offset} (it ends there): it is shorter "
                        "than when the checkpoint was written (truncated or replaced?)"
                    )
                position = offset + len(line)
                records.append(self._decode(line))
        return records

    @staticmethod
    def _open(path: str, start: int) -> BinaryIO:
        try:
            return open(path, "rb")
        except FileNotFoundError as exc:
            raise ResumeError(f"text shard {path!r} is missing (cursor at byte {start}): {exc}") from exc

    @staticmethod
    def _seek_line(file: BinaryIO, path: str, start: int) -> None:
        """Seek to byte ``start``, refusing one past the end or inside a line. The end of the file is
        a line start even when its last line has no newline: it is where reading that line left off."""
        size = os.fstat(file.fileno()).st_size
        if start > size:
            raise ResumeError(
                f"text shard {path!r} has {size} bytes but the cursor is at byte {start}: "
                "it is shorter than when the checkpoint was written (truncated or replaced?)"
            )
        if 0 < start < size:
            file.seek(start - 1)
            if file.read(1) != b"\n":
                raise ResumeError(
                    f"text shard {path!r}: byte offset {start} is not at the start of a line, so "
                    "the file changed since the checkpoint was written"
                )
        else:
            file.seek(start)

    def _decode(self, line: bytes) -> Any:
        text = line.decode(self.encoding).rstrip("\r\n")
        return text if self.parse is None else self.parse(text)

    def __call__(self, shard: Any, start: int) -> Iterator[Any]:
        """Parsed lines from byte offset ``start``."""
        return (record for _, record in self.read_from(shard, start))
