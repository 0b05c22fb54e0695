"""The records of one litdata chunk, read from its bytes by offset: no item before the one asked is read.

A chunk of items (``PyTreeLoader``) starts with ``uint32`` item count ``N`` and ``N + 1`` ``uint32``
offsets, then the items' bytes: item ``i`` is ``bytes[offset[i]:offset[i + 1]]``, an O(1) seek.
With ``compression="zstd"`` litdata writes one of three layouts (``config.compression_level``):

* ``"batch"`` (its default): the file starts with the magic ``LDFZ01``, the items' offsets in the
  uncompressed stream and a table of zstd frames of ``K`` items each; an item costs one frame
  decompressed (the last frame is kept, so reading in order decompresses each frame once);
* ``"sample"``: the plain layout, each item's bytes a zstd frame of their own;
* ``"chunk"``: the whole file is one zstd stream (``.zstd.bin``), decompressed as a whole.

When pyarrow is installed, litdata writes a chunk of dicts of JSON values (str, int, float, bool,
bytes, lists, dicts) as an Arrow IPC file after the header (magic ``LDARW01`` at the end), often with
no item bytes at all, and reads those rows (``to_pylist``) in preference to the items' bytes; so
does this reader, a batch of rows at a time (pyarrow is then needed).

A chunk of tokens (``TokensLoader``) is the plain header, then ``dim`` tokens; record ``i`` is the
block ``tokens[i * block_size : (i + 1) * block_size]``, and a tail shorter than a block is not a
record (as litdata reads it: ``dim // block_size`` blocks per chunk, none across chunks).
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from ...errors import ResumeError
from .litdata_index import TOKENS, LitdataChunk, LitdataIndex
from .litdata_items import token_dtype

__all__ = ["Bytes", "ChunkRecords", "inflate"]

_FRAMED_MAGIC = b"LDFZ01\0\0"
_ARROW_MAGIC = b"LDARW01\0"  # the last bytes of a chunk with an Arrow IPC footer (its length before them)
_FRAMED_PREFIX = struct.Struct("<8sHHIII")  # magic, version, flags, items, items per frame, frames
_FRAME = struct.Struct("<IIQII")  # first item, items, offset in the file, compressed and raw length


class Bytes(Protocol):
    """A chunk's bytes: its length, and a slice of it (a memory map, or ranged reads of a remote file)."""

    def __len__(self) -> int: ...

    def __getitem__(self, span: slice) -> Any: ...


def _zstandard() -> Any:
    """Import ``zstandard`` on first use: only compressed chunks need it."""
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "this litdata dataset is zstd-compressed; reading it needs zstandard: pip install "
            "'resumable-data[formats]' (or pip install zstandard)"
        ) from exc
    return zstandard


def inflate(data: Any, size: int | None = None) -> bytes:
    """The bytes of a zstd frame (``size``: its decompressed length, when the writer recorded it).

    Raises:
        ValueError: the data is not a whole zstd frame (truncated, or not zstd).
    """
    zstandard = _zstandard()
    decompressor = zstandard.ZstdDecompressor()
    try:
        try:
            raw = decompressor.decompress(bytes(data), max_output_size=size or 0)
        except zstandard.ZstdError:  # a frame whose header does not give its size
            raw = decompressor.decompressobj().decompress(bytes(data))
    except zstandard.ZstdError as exc:
        raise ValueError(f"not a whole zstd frame: {exc}") from exc
    if size is not None and len(raw) != size:
        raise ValueError(f"a zstd frame inflated to {len(raw)} bytes, the chunk says {size}")
    return raw


class ChunkRecords:
    """The records of one chunk (see the module docstring), read from ``data`` by offset.

    Args:
        data: the chunk's bytes (decompressed already for ``compression_level="chunk"``).
        entry: the chunk as the index lists it.
        index: the dataset's index (its layout, compression and item loader).
        name: the chunk as errors name it.
        decode: what turns an item's bytes into the user's item (``PyTreeLoader`` chunks).
        block_size: tokens per record (``TokensLoader`` chunks).

    Raises:
        ResumeError: the header does not match the index (the chunk was rewritten or truncated).
    """

    def __init__(
        self,
        data: Bytes,
        entry: LitdataChunk,
        index: LitdataIndex,
        name: str,
        *,
        decode: Callable[[bytes], Any],
        block_size: int | None,
    ) -> None:
        self.name, self.data, self.decode = name, data, decode
        self._frame: tuple[int, bytes] | None = None  # the last frame decompressed (batch level)
        self._frames: list[tuple[int, int, int, int, int]] | None = None
        self._sample = index.compression is not None and index.level == "sample"
        try:
            self._parse(entry, index, block_size)
        except (ValueError, struct.error) as exc:
            raise ResumeError(f"litdata chunk {name!r} has a damaged header (truncated or rewritten?): {exc}") from exc

    def _parse(self, entry: LitdataChunk, index: LitdataIndex, block_size: int | None) -> None:
        data, size = self.data, len(self.data)
        if size >= _FRAMED_PREFIX.size and bytes(data[0:8]) == _FRAMED_MAGIC:
            _, version, _, items, _, frames = _FRAMED_PREFIX.unpack(bytes(data[0 : _FRAMED_PREFIX.size]))
            if version != 1:
                raise ValueError(f"its framed-zstd version is {version}, this reader reads version 1")
            self._check_items(items, entry)
            start = _FRAMED_PREFIX.size + 4 * (items + 1)
            self.offsets = np.frombuffer(bytes(data[_FRAMED_PREFIX.size : start]), dtype="<u4").astype(np.int64)
            table = bytes(data[start : start + _FRAME.size * frames])
            self._frames = [_FRAME.unpack_from(table, f * _FRAME.size) for f in range(frames)]
            if any(offset + length > size for _, _, offset, length, _ in self._frames):
                raise ValueError(f"a zstd frame ends past the chunk's {size} bytes")
            self.count = items
            return
        (items,) = struct.unpack("<I", bytes(data[0:4]))
        self._check_items(items, entry)
        self.offsets = np.frombuffer(bytes(data[4 : 4 + 4 * (items + 1)]), dtype="<u4").astype(np.int64)
        if len(self.offsets) != items + 1 or np.any(np.diff(self.offsets) < 0) or self.offsets[-1] > size:
            raise ValueError(f"its offsets are not ascending within its {size} bytes")
        if self.offsets[0] != 4 * (items + 2):  # litdata's writer puts the items right after the table
            raise ValueError(
                f"its first offset is {self.offsets[0]}, not the end of its offset table ({4 * (items + 2)})"
            )
        if index.loader == TOKENS:
            assert block_size is not None and entry.dim is not None  # checked by the reader and the index
            dtype = token_dtype(index.data_format[0], f"litdata chunk {self.name!r}")
            self._token_bytes = (
                torch.empty(0, dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else dtype.itemsize
            )
            self._dtype, self._block = dtype, block_size
            if self.offsets[0] + entry.dim * self._token_bytes > size:
                raise ValueError(f"its {entry.dim} tokens would end past its {size} bytes")
            self.count = entry.dim // block_size
            return
        self._bounds = self.offsets.tolist()  # Python ints: slicing with numpy ints costs more per item
        self.count = items
        if size >= 12 and bytes(data[size - 8 : size]) == _ARROW_MAGIC:
            self._arrow_footer(entry, size, body=bool(items) and self.offsets[-1] > self.offsets[0])

    def _arrow_footer(self, entry: LitdataChunk, size: int, *, body: bool) -> None:
        """The chunk's rows from its Arrow IPC footer, which litdata reads in preference to the items'
        bytes when pyarrow is installed (it writes one for dicts of JSON values then, often alone)."""
        try:
            import pyarrow as pa
        except ImportError as exc:
            if body:  # as litdata without pyarrow: the items' bytes
                return
            raise ResumeError(
                f"litdata chunk {self.name!r} keeps its items in an Arrow IPC footer only (litdata writes dicts of "
                "JSON values so when pyarrow is installed): reading it needs pyarrow (pip install "
                "'resumable-data[parquet]')"
            ) from exc
        (length,) = struct.unpack("<I", bytes(self.data[size - 12 : size - 8]))
        if length > size - 12:
            raise ValueError(f"its Arrow footer of {length} bytes is longer than the chunk")
        ipc = pa.py_buffer(self.data[size - 12 - length : size - 12])
        try:
            if bytes(ipc[:6]) == b"ARROW1":  # an IPC file (litdata's batches of 256 rows); older chunks: a stream
                opened = pa.ipc.open_file(ipc)
                batches = [opened.get_batch(b) for b in range(opened.num_record_batches)]
            else:
                batches = pa.ipc.open_stream(ipc).read_all().to_batches()
        except pa.ArrowException as exc:
            raise ValueError(f"its Arrow footer does not read: {exc}") from exc
        self._batches = batches
        self._rows: tuple[int, list[Any]] | None = None  # the batch last made rows, and its rows
        self._firsts = np.cumsum([0] + [batch.num_rows for batch in batches]).tolist()
        self._check_items(self._firsts[-1], entry)

    def _arrow_row(self, i: int) -> Any:
        b = bisect.bisect_right(self._firsts, i) - 1
        if self._rows is None or self._rows[0] != b:
            self._rows = (b, self._batches[b].to_pylist())
        return self._rows[1][i - self._firsts[b]]

    def _check_items(self, items: int, entry: LitdataChunk) -> None:
        if items != entry.items:
            raise ValueError(f"its header counts {items} items, index.json gives chunk_size={entry.items}")

    def records(self, offsets: Iterable[int]) -> Iterator[Any]:
        """The records at ``offsets`` (each in ``range(count)``), in that order."""
        if self._frames is None and not hasattr(self, "_block") and not hasattr(self, "_batches"):
            yield from self._plain(offsets)
            return
        for i in offsets:
            yield self.record(i)

    def _plain(self, offsets: Iterable[int]) -> Iterator[Any]:
        # The hot loop of an uncompressed chunk of items: one slice and one decode per item.
        data, bounds, decode, sample = self.data, self._bounds, self.decode, self._sample
        for i in offsets:
            raw = bytes(data[bounds[i] : bounds[i + 1]])
            yield decode(inflate(raw) if sample else raw)

    def record(self, i: int) -> Any:
        """Record ``i`` of the chunk."""
        if hasattr(self, "_block"):
            span = self._block * self._token_bytes
            start = int(self.offsets[0]) + i * span
            block = np.frombuffer(self.data[start : start + span], dtype=np.uint8).copy()
            if isinstance(self._dtype, torch.dtype):
                return torch.from_numpy(block).view(self._dtype)
            return block.view(self._dtype)
        if hasattr(self, "_batches"):
            return self._arrow_row(i)
        if self._frames is None:
            return next(self._plain([i]))
        frame = self._frame_of(i)
        first, _, offset, length, raw_length = self._frames[frame]
        if self._frame is None or self._frame[0] != frame:
            self._frame = (frame, inflate(self.data[offset : offset + length], raw_length))
        base = self.offsets[first]
        return self.decode(self._frame[1][self.offsets[i] - base : self.offsets[i + 1] - base])

    def _frame_of(self, i: int) -> int:
        assert self._frames is not None
        # Frames hold K items each (the last fewer): frame i // K, unless a writer split otherwise.
        k = self._frames[0][1]
        guess = min(i // k, len(self._frames) - 1)
        first, items = self._frames[guess][0], self._frames[guess][1]
        if first <= i < first + items:
            return guess
        for frame, (first, items, *_) in enumerate(self._frames):
            if first <= i < first + items:
                return frame
        raise ResumeError(f"litdata chunk {self.name!r}: no zstd frame holds item {i} (truncated or rewritten?)")
