"""LitdataReader: the chunks ``litdata.optimize`` wrote, read as they are, with an O(1) seek.

A litdata dataset is a folder of chunk files and an ``index.json`` that lists them with their item
counts and sizes (:mod:`~resumable_data.streams.formats.litdata_index`). Each chunk is a shard of
a :class:`~resumable_data.streams.ShardedIterable`; its cursor is a record number, and a restore
reads the chunk's offset table and the records from the cursor on, nothing before them
(:mod:`~resumable_data.streams.formats.litdata_chunks`). The record counts come from the index,
so building a stream opens no chunk, its state is a position, and ``shuffle_window`` reads by
position.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from ...core.state import check_int_arg
from ...errors import ResumeError
from ...storage.cached import RemoteReading
from ...storage.files import is_url
from ..readers import file_identity
from ..sharded import ShardedIterable
from .litdata_chunks import ChunkRecords, inflate
from .litdata_index import TOKENS, LitdataChunk, LitdataIndex
from .litdata_items import ItemDecoder

__all__ = ["LitdataReader", "litdata_stream"]

_OPEN_CHUNKS = 8  # local chunks kept open (mapped, or decompressed): a shuffle's re-reads move among a few
_REMOTE_BLOCK = 4 << 20  # read-ahead of a remote chunk read without a cache: a restore fetches one block


class _Ranged:
    """A remote chunk's bytes by ranged reads (an fsspec file: seek, read, its read-ahead block kept)."""

    def __init__(self, file: IO[bytes], size: int) -> None:
        self.file, self.size = file, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, span: slice) -> bytes:
        self.file.seek(span.start)
        return self.file.read(span.stop - span.start)


class LitdataReader(RemoteReading):
    """Records of a litdata dataset's chunks: its items, or for ``TokensLoader`` chunks blocks of tokens.

    Use it as ``read_shard`` of a :class:`ShardedIterable` over the chunks (:attr:`shards`), or
    build both with :func:`litdata_stream`. Works with every stream stage (``shuffle_window``,
    ``shuffle_buffer``, ``mix``...), :class:`StreamLoader` workers and ranks, and a change of
    layout on resume, like the other readers.

    Items come back as the user gave them to ``litdata.optimize`` (the dict, tuple or list of
    ``config.data_spec``), each leaf decoded from its plain bytes: ints, floats, bools, strings,
    bytes, numpy arrays, torch tensors and ``json`` lists/dicts (see
    :mod:`~resumable_data.streams.formats.litdata_items`), or the rows of the Arrow IPC footer litdata
    writes for dicts of JSON values when pyarrow is installed (read from it as litdata reads them;
    pyarrow is then needed). A ``pickle`` leaf is refused unless ``allow_pickle=True``; images,
    audio and other media go to ``decode``. Token chunks yield
    blocks of ``block_size`` tokens of the dtype they were written with, as litdata's
    ``TokensLoader(block_size)`` does.

    A chunk whose size differs from ``chunk_bytes`` in the index (truncated, rewritten) is refused
    by name, and its identity (size and a digest of its edges, or a remote object's size and
    ETag) makes a restore over a chunk changed since the checkpoint an error.

    Args:
        location: the dataset's folder (litdata's ``output_dir``) or its ``index.json``; a path or
            a URL (``s3://bucket/dataset``, through fsspec with ``storage_options``).
        block_size: tokens per record, for a ``TokensLoader`` dataset (required there, refused
            for items).
        decode: ``decode(data_format, bytes)`` for leaves of serializers not decoded here (e.g.
            ``"jpeg"``, ``"pil"``): called with litdata's serializer name and the leaf's bytes.
        allow_pickle: decode ``pickle`` leaves with :func:`pickle.loads`, which runs code from the
            file: only for data you trust.
        storage_options: for URLs, the filesystem's options as fsspec takes them (see
            :mod:`resumable_data.storage`).
        cache_dir: a local directory to keep remote chunks in, shared by every process on the
            machine that passes it (None: no cache; chunks are read by ranged requests).
        cache_limit: bytes the cache may take (None: no bound); the same in every process.
        prefetch: with a cache, how many of the slot's next chunks download in the background.

    Raises:
        ResumeError: the index is missing or malformed, or a leaf's serializer is refused (naming
            the field).
        ValueError: ``block_size`` missing for tokens, or given for items.

    Example::

        reader = LitdataReader("my_optimized_dataset/")
        stream = ShardedIterable(reader.shards, read_shard=reader, seed=0).shuffle_window(10_000)
        state = stream.state_dict()  # a position: restore with load_state_dict(state)
    """

    def __init__(
        self,
        location: str | os.PathLike[str],
        *,
        block_size: int | None = None,
        decode: Callable[[str, bytes], Any] | None = None,
        allow_pickle: bool = False,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        prefetch: int = 2,
    ) -> None:
        super().__init__(storage_options, cache_dir, cache_limit, prefetch)
        self.index = LitdataIndex.load(location, self.storage_options)
        where = f"litdata dataset {self.index.location!r}"
        if self.index.loader == TOKENS:
            if block_size is None:
                raise ValueError(f"{where} holds TokensLoader chunks: pass block_size= (tokens per record)")
            self.block_size: int | None = check_int_arg("block_size", block_size, minimum=1)
        elif block_size is not None:
            raise ValueError(f"{where} holds items (PyTreeLoader), not tokens: block_size={block_size} does not apply")
        else:
            self.block_size = None
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be callable(data_format, bytes), got {type(decode).__name__}")
        self.decode, self.allow_pickle = decode, bool(allow_pickle)
        self._items = None
        if self.index.loader != TOKENS:
            self._items = ItemDecoder(
                self.index.data_format, self.index.data_spec, allow_pickle=self.allow_pickle, decode=decode, where=where
            )
        self._by_name = {chunk.filename: chunk for chunk in self.index.chunks}
        self._open_chunks: OrderedDict[tuple[Any, ...], ChunkRecords] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        # A worker maps the chunks itself; mappings are not sent along.
        return {**self.__dict__, "_open_chunks": OrderedDict()}

    @property
    def shards(self) -> list[str]:
        """The chunks' locations in the index's order: the shard list of the dataset."""
        return [self.index.chunk_location(chunk) for chunk in self.index.chunks]

    def _entry(self, shard: Any) -> LitdataChunk:
        name = str(shard).replace("\\", "/").rsplit("/", 1)[-1]
        entry = self._by_name.get(name)
        if entry is None:
            raise ResumeError(
                f"{str(shard)!r} is not a chunk of the litdata dataset {self.index.location!r} (its index.json lists "
                f"{len(self._by_name)} chunks, e.g. {next(iter(self._by_name), None)!r})"
            )
        return entry

    def num_records(self, shard: Any) -> int:
        """Records in the chunk, from ``index.json``: items (``chunk_size``), or ``dim // block_size`` blocks."""
        entry = self._entry(shard)
        return entry.items if self.block_size is None else (entry.dim or 0) // self.block_size

    def _check_size(self, shard: Any, entry: LitdataChunk, size: int, *, inflated: bool = False) -> None:
        """Refuse a chunk whose size is not the index's ``chunk_bytes``: the file's size, or for a chunk
        compressed whole (whose ``chunk_bytes`` litdata counts before compressing) the inflated size."""
        if self._whole_file and not inflated:
            return
        if size != entry.nbytes:
            raise ResumeError(
                f"litdata chunk {str(shard)!r} holds {size} bytes{' once inflated' if inflated else ''} but index.json "
                f"gives chunk_bytes={entry.nbytes}: the chunk was truncated or rewritten after litdata wrote it"
            )

    def _inflated(self, shard: Any, entry: LitdataChunk, data: bytes) -> bytes:
        """A chunk compressed whole, decompressed (and its size checked)."""
        try:
            raw = inflate(data)
        except ValueError as exc:
            raise ResumeError(
                f"litdata chunk {str(shard)!r} does not decompress (truncated or rewritten?): {exc}"
            ) from exc
        self._check_size(shard, entry, len(raw), inflated=True)
        return raw

    def identity(self, shard: Any) -> str:
        """``"size:digest"`` of the chunk's size and its first and last 4 KiB, or for a URL its size and
        ETag; a size other than the index's ``chunk_bytes`` is refused."""
        entry = self._entry(shard)
        try:
            if is_url(shard):
                identity = self._remote_identity(str(shard))
            else:
                with open(os.fspath(shard), "rb") as file:
                    identity = file_identity(file)
        except FileNotFoundError as exc:
            raise ResumeError(f"litdata chunk {str(shard)!r} is missing: {exc}") from exc
        self._check_size(shard, entry, int(identity.split(":", 1)[0]))
        return identity

    # -- opening ----------------------------------------------------------------------------------
    def _open(self, shard: Any, *, wait: bool) -> ChunkRecords:
        """The chunk's records: from a local file (mapped, kept among the last few), the cache's copy
        (downloaded first with ``wait``), or a remote file read by ranges."""
        entry, name = self._entry(shard), str(shard)
        cached = self._local_copy(shard, lambda path: self._chunk(name, entry, path), wait=wait)
        if cached is not None:
            return cached
        if is_url(shard):
            try:
                file: Any = self._remote.open(name, block_size=_REMOTE_BLOCK)  # an fsspec file: it has .size
            except FileNotFoundError as exc:
                raise ResumeError(f"litdata chunk {name!r} is missing: {exc}") from exc
            if self._whole_file:
                with file:
                    return self._records(name, entry, self._inflated(shard, entry, file.read()))
            if file.size != entry.nbytes:
                file.close()
                self._check_size(shard, entry, file.size)
            return self._records(name, entry, _Ranged(file, file.size))
        path = os.fspath(shard)
        try:
            stat = os.stat(path)
        except FileNotFoundError as exc:
            raise ResumeError(f"litdata chunk {path!r} is missing: {exc}") from exc
        key = (path, stat.st_size, stat.st_mtime_ns)
        records = self._open_chunks.get(key)
        if records is None:
            records = self._chunk(name, entry, path)
            self._open_chunks[key] = records
            if len(self._open_chunks) > _OPEN_CHUNKS:
                self._open_chunks.popitem(last=False)
        else:
            self._open_chunks.move_to_end(key)
        return records

    @property
    def _whole_file(self) -> bool:
        return self.index.compression is not None and self.index.level == "chunk"

    def _chunk(self, name: str, entry: LitdataChunk, path: str) -> ChunkRecords:
        """The records of the local file at ``path`` (the chunk ``name``): mapped, or decompressed whole."""
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            self._check_size(name, entry, size)
            if self._whole_file:
                return self._records(name, entry, self._inflated(name, entry, file.read()))
            # A slice of the mapping is a copy of just those bytes; an empty file cannot be mapped.
            data: Any = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        return self._records(name, entry, data)

    def _records(self, name: str, entry: LitdataChunk, data: Any) -> ChunkRecords:
        decode = self._items if self._items is not None else _no_items
        return ChunkRecords(data, entry, self.index, name, decode=decode, block_size=self.block_size)

    # -- reading ----------------------------------------------------------------------------------
    def __call__(self, shard: Any, start: int) -> Iterator[Any]:
        """Records from record number ``start``; reads nothing of the chunk before it but its header."""
        records = self._open(shard, wait=start == 0)  # a restore reads by ranges until it is cached
        if start > records.count:
            raise ResumeError(
                f"litdata chunk {str(shard)!r} has {records.count} records but the cursor is at record {start}: "
                "the chunk is shorter than when the checkpoint was written (truncated or replaced?)"
            )
        return self._read(records, range(start, records.count))

    def read_records(self, shard: Any, offsets: Sequence[int]) -> list[Any]:
        """The records at ``offsets`` (ascending), the chunk opened once for all of them: what a shuffle
        buffer's restore calls."""
        records = self._open(shard, wait=False)
        if offsets and (offsets[0] < 0 or offsets[-1] >= records.count):
            bad = offsets[-1] if offsets[-1] >= records.count else offsets[0]
            raise ResumeError(
                f"litdata chunk {str(shard)!r} has {records.count} records but the checkpoint needs record {bad}: "
                "the chunk is shorter than when the checkpoint was written (truncated or replaced?)"
            )
        return list(self._read(records, offsets))

    def _read(self, records: ChunkRecords, offsets: Sequence[int]) -> Iterator[Any]:
        try:
            yield from records.records(offsets)
        except (ValueError, IndexError, struct.error) as exc:  # UnicodeDecodeError is a ValueError
            raise ResumeError(
                f"litdata chunk {records.name!r} holds an item that does not decode (truncated or rewritten?): {exc}"
            ) from exc
        finally:
            if isinstance(records.data, _Ranged):
                records.data.file.close()


def _no_items(_: bytes) -> Any:  # pragma: no cover - token chunks never decode items
    raise ResumeError("a TokensLoader chunk has no items to decode")


def litdata_stream(
    location: str | os.PathLike[str],
    *,
    block_size: int | None = None,
    decode: Callable[[str, bytes], Any] | None = None,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | None = None,
    prefetch: int = 2,
    **kwargs: Any,
) -> ShardedIterable:
    """A :class:`ShardedIterable` over the chunks of the litdata dataset at ``location``, read by a
    :class:`LitdataReader` (see it for the arguments): the chunks and their record counts come from
    ``index.json``, so no chunk is opened here.

    Args:
        location: the dataset's folder (litdata's ``output_dir``) or its ``index.json``, a path or a URL.
        **kwargs: the other arguments of :class:`ShardedIterable` (``seed``, ``shuffle``, ``growth``...).

    Example::

        stream = litdata_stream("s3://bucket/tokens", block_size=2049, cache_dir="/tmp/cache", seed=0)
        loader = StreamLoader(stream.shuffle_window(100_000, seed=1), batch_size=8, num_workers=2)
    """
    reader = LitdataReader(
        location,
        block_size=block_size,
        decode=decode,
        allow_pickle=allow_pickle,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_limit=cache_limit,
        prefetch=prefetch,
    )
    return ShardedIterable(reader.shards, read_shard=reader, **kwargs)
