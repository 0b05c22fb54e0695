"""ParquetReader: rows of Parquet files (Hugging Face Hub datasets, Arrow exports) with an O(1) seek.

The cursor is a row number. A Parquet file is stored in *row groups*, and its footer says how many
rows each one holds, so a restore at row ``r`` reads the footer, finds the row group that holds
``r``, reads that one row group and slices it at ``r``: no row group before it is read, and the
cost of a restore is at most one row group (decoding the rows of that group that precede ``r``)
whatever the position in the file. Later row groups are read one at a time as the iteration
reaches them.

Records are rows as ``{column: value}`` dicts of Python values (``table.to_pylist()``), restricted
to ``columns`` when given, or whatever ``parse(row)`` returns. A shuffle buffer restores by
re-reading single rows by key; the last few row groups read are kept decoded
(``cache_row_groups``), so re-reading a buffer's rows costs a few row groups, not one per row.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from ..core.state import check_int_arg
from ..errors import ResumeError
from ..storage.cached import RemoteReading
from ..storage.files import is_url, redact

__all__ = ["ParquetReader"]

# Most rows converted to Python objects at a time: bounds the memory of the Python copy of a group.
_CONVERT_ROWS = 1024
# Read-ahead of a remote Parquet file: pyarrow asks for the footer and for whole column chunks, so
# a larger block would only fetch bytes it does not ask for.
_PARQUET_BLOCK = 1 << 20


def _pyarrow_parquet() -> Any:
    """Import ``pyarrow.parquet`` on first use, so the library itself never needs pyarrow."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "ParquetReader needs pyarrow: pip install 'resumable-data[parquet]' (or pip install pyarrow)"
        ) from exc
    return pq


class ParquetReader(RemoteReading):
    """Rows of a Parquet shard; the cursor is a row number and a restore reads one row group.

    Use it as ``read_shard`` of a :class:`ShardedIterable`, one shard per Parquet file. Works with
    every stream stage (``shuffle_buffer``, ``mix``, ``map``...), :class:`StreamLoader` workers and
    ranks, and a change of layout on resume, like the other readers.

    Args:
        columns: columns to read (all when None); only these are decoded.
        parse: applied to each row dict (e.g. to make tensors); the dict itself when None.
        opener: ``opener(shard)`` returns a binary file object to read the shard from; when None,
            a URL (``s3://bucket/train-0.parquet``) is opened through fsspec with
            ``storage_options`` (the footer and each row group by ranged reads; the identity is
            the object's size and ETag) and pyarrow opens a local path itself.
        cache_row_groups: decoded row groups kept (least recently used dropped first) for the
            single-row re-reads of a shuffle buffer's restore; set it to at least the number of
            row groups a buffer spans (about ``buffer size / rows per group + 1``) so each is
            decoded once. 0 disables the cache. Each entry holds one row group's columns in memory.
        storage_options: for URLs, the filesystem's options as fsspec takes them (see
            :mod:`resumable_data.storage`).
        cache_dir: a local directory to keep remote shards in, shared by every process on the
            machine that passes it (None: no cache). A shard read from its first row is read from
            the cache (downloaded once per machine, the slot's next ``prefetch`` shards in the
            background, as for :class:`TokenShardReader`); a read from another row (a restore, a
            shuffle's rows by key) takes the cached copy if it is there, else reads by ranged
            requests. Not with ``opener``.
        cache_limit: bytes the cache may take (None: no bound); the same in every process.
        prefetch: with a cache, how many of the slot's next shards download in the background.

    Example::

        shards = sorted(glob("my_dataset/data/train-*.parquet"))  # a Hub dataset's files
        reader = ParquetReader(["input_ids"], parse=lambda row: torch.tensor(row["input_ids"]))
        stream = ShardedIterable(shards, read_shard=reader, seed=0).shuffle_buffer(10_000)
        stream.state_dict()["source"]["remaining"]  # [[shard index, name, row], ...]
    """

    def __init__(
        self,
        columns: Sequence[str] | None = None,
        *,
        parse: Callable[[dict[str, Any]], Any] | None = None,
        opener: Callable[[Any], IO[bytes]] | None = None,
        cache_row_groups: int = 4,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        prefetch: int = 2,
    ) -> None:
        if isinstance(columns, str):
            raise TypeError(f"columns must be a list of column names, got the string {columns!r}; pass [{columns!r}]")
        self.columns = None if columns is None else list(columns)
        if parse is not None and not callable(parse):
            raise TypeError(f"parse must be callable, got {type(parse).__name__}")
        self.parse = parse
        if opener is not None and cache_dir is not None:
            raise ValueError(
                "cache_dir= caches the URLs ParquetReader opens itself, not what an opener returns: pass one of them"
            )
        self.opener = opener
        super().__init__(storage_options, cache_dir, cache_limit, prefetch)
        self.cache_row_groups = check_int_arg("cache_row_groups", cache_row_groups, minimum=0)
        self._row_groups: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        _pyarrow_parquet()  # fail at construction, not in a worker, when pyarrow is missing

    def __getstate__(self) -> dict[str, Any]:
        # Worker processes get the reader without the decoded row groups of the main process.
        state = self.__dict__.copy()
        state["_row_groups"] = OrderedDict()
        return state

    # -- opening ----------------------------------------------------------------------------------
    def _open(self, shard: Any, *, wait: bool = False) -> Any:
        """The shard's ``pyarrow.parquet.ParquetFile`` (reads only its footer); with a cache, from the
        cached copy when there is one (downloaded first with ``wait``)."""
        pq = _pyarrow_parquet()
        name = str(shard)
        try:
            # Closed with close(force=True): the file is ours whether pyarrow or the opener opened it.
            parquet = pq.ParquetFile(self._source(shard, wait))
        except FileNotFoundError as exc:
            raise ResumeError(f"parquet shard {redact(name)!r} is missing: {exc}") from exc
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise ResumeError(
                f"parquet shard {redact(name)!r} is not a readable Parquet file (truncated or replaced?): {exc}"
            ) from exc
        if self.columns is not None:
            names = parquet.schema_arrow.names
            missing = [c for c in self.columns if c not in names]
            if missing:
                parquet.close(force=True)
                raise ResumeError(
                    f"parquet shard {redact(name)!r} lacks the column(s) {missing}; its columns are {names}"
                )
        return parquet

    def _source(self, shard: Any, wait: bool) -> Any:
        """What pyarrow reads the shard from: the opener's file, a cached copy, a remote file, or the
        local path."""
        if self.opener is not None:
            return self.opener(shard)
        cached = self._local_copy(shard, str, wait=wait)
        if cached is not None:
            return open(cached, "rb")  # open now: the slot may release the shard before pyarrow reads it
        if is_url(shard):
            return self._remote.open(shard, block_size=_PARQUET_BLOCK)
        return os.fspath(shard)

    def identity(self, shard: Any) -> str:
        """``"size:digest"`` of the file's size and its footer (the row groups' sizes, offsets and
        statistics): what a restore already reads, and no byte of a row group. Through ``opener``
        when given; for a URL without one, the object's size and ETag (one HEAD request)."""
        name = str(shard)
        try:
            if self.opener is None and is_url(shard):
                return self._remote_identity(shard)
            with open(os.fspath(shard), "rb") if self.opener is None else self.opener(shard) as file:
                size = file.seek(0, os.SEEK_END)
                if size < 12:
                    raise ResumeError(f"parquet shard {redact(name)!r} holds {size} bytes: not a Parquet file")
                file.seek(size - 8)
                tail = file.read(8)
                footer = min(int.from_bytes(tail[:4], "little") + 8, size)
                file.seek(size - footer)
                digest = hashlib.blake2b(file.read(footer), digest_size=8).hexdigest()
        except FileNotFoundError as exc:
            raise ResumeError(f"parquet shard {redact(name)!r} is missing: {exc}") from exc
        return f"{size}:{digest}"

    def num_records(self, shard: Any) -> int:
        """Rows in the shard (from its footer)."""
        parquet = self._open(shard)
        try:
            return parquet.metadata.num_rows
        finally:
            parquet.close(force=True)

    # -- reading ----------------------------------------------------------------------------------
    def __call__(self, shard: Any, start: int) -> Iterator[Any]:
        """Rows from row number ``start``; reads nothing before the row group that holds it."""
        parquet = self._open(shard, wait=start == 0)  # a restore reads by ranges until it is cached
        metadata = parquet.metadata
        if start > metadata.num_rows:
            parquet.close(force=True)
            raise ResumeError(
                f"parquet shard {redact(shard)!r} has {metadata.num_rows} rows but the cursor is at row {start}: "
                "the shard is shorter than when the checkpoint was written (truncated or replaced?)"
            )
        group, first = 0, 0  # the row group holding `start`, and its first row number
        while group < metadata.num_row_groups and first + metadata.row_group(group).num_rows <= start:
            first += metadata.row_group(group).num_rows
            group += 1
        return self._rows(shard, parquet, group, start - first)

    def _rows(self, shard: Any, parquet: Any, group: int, skip: int) -> Iterator[Any]:
        try:
            for g in range(group, parquet.metadata.num_row_groups):
                table = self._row_group(shard, parquet, g)
                if skip:
                    table, skip = table.slice(skip), 0
                # Rows become Python objects in chunks that start at one row and double up to
                # _CONVERT_ROWS: a single-row fetch converts one row, a full read few large chunks.
                offset, size = 0, 1
                while offset < table.num_rows:
                    for row in table.slice(offset, size).to_pylist():
                        yield row if self.parse is None else self.parse(row)
                    offset, size = offset + size, min(2 * size, _CONVERT_ROWS)
        finally:  # when the shard is done or the iterator is dropped (a single-row fetch)
            parquet.close(force=True)

    def _row_group(self, shard: Any, parquet: Any, group: int) -> Any:
        """Row group ``group``, decoded (from the cache when it holds it)."""
        metadata = parquet.metadata
        # The footer's sizes identify the file version, so a replaced file is not served from cache.
        key = (
            str(shard),
            group,
            metadata.num_rows,
            metadata.serialized_size,
            metadata.row_group(group).total_byte_size,
        )
        table = self._row_groups.get(key)
        if table is not None:
            self._row_groups.move_to_end(key)
            return table
        try:
            table = parquet.read_row_group(group, columns=self.columns, use_threads=False)
        except (OSError, ValueError) as exc:
            raise ResumeError(
                f"parquet shard {redact(shard)!r}: row group {group} is unreadable (truncated or corrupt?): {exc}"
            ) from exc
        if self.cache_row_groups:
            self._row_groups[key] = table
            while len(self._row_groups) > self.cache_row_groups:
                self._row_groups.popitem(last=False)
        return table
