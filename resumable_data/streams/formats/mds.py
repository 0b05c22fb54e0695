"""MDSReader: samples of Mosaic Streaming's MDS shards, as its ``MDSWriter`` wrote them, with an O(1) seek.

An MDS shard (``shard.00000.mds``) starts with its sample count and a table of the byte offset of
every sample (uint32), so sample ``i`` is the bytes between offsets ``i`` and ``i + 1``: a restore
at sample ``i`` reads two table entries and the samples from there on, never the samples before it.
A local shard is memory-mapped; a remote one (``s3://...``) is read by ranged requests (the table's
part from the cursor on, then the samples a few MiB at a time), or from a node-local cache with
``cache_dir=``. A compressed shard (``shard.00000.mds.zstd``) is decompressed whole when it is
opened (the last few are kept), as Mosaic's own reader does.

The record counts come from ``index.json``'s ``samples``, so a stream is sized without opening a
shard, and the index's file sizes (and, with ``verify_hashes``, its hashes) are checked against each
file read: a truncated or rewritten shard is a :class:`~resumable_data.ResumeError` naming it. So is
a damaged offset table, which keeps the file's size (and Mosaic writes no hashes by default): the
entries a read uses must lie after the table and within the file, each after the one before; a
shard opened whole must have its column config (one JSON object) between the table and its first
sample; and each sample's bytes must be as long as its columns' lengths say.
"""

from __future__ import annotations

import glob as local_glob
import itertools
import json
import mmap
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ...core.state import check_int_arg
from ...errors import ResumeError
from ...storage.cached import RemoteReading
from ...storage.files import is_url
from ..readers import file_identity
from ..sharded import ShardedIterable
from .mds_columns import SampleLengthError, sample_decoder
from .mds_index import INDEX, MDSShard, decompress, decompressor, hash_of, index_files, parse_index

__all__ = ["MDSReader", "mds_stream"]

_CHUNK = 1024  # offsets read from the table at a time (a restore reads the ones it needs, not all)
_BLOCK = 8 << 20  # most bytes of a remote shard's samples fetched by one ranged read
_OFFSET = np.dtype("<u4")


def _check_offsets(name: str, offsets: np.ndarray, first: int, samples: int, table: int, size: int) -> None:
    """That entries ``first, first + 1, ...`` of the offset table of a shard of ``samples`` samples
    and ``size`` bytes point past the table (``table`` bytes with the count), within the file, each
    after the one before (a sample of Mosaic's is never empty: it holds at least its columns'
    lengths or fixed-size values), and that the last entry, where it is in the span, is the file's end.

    Raises:
        ResumeError: naming the shard, the entry and what is wrong with it.
    """
    values = offsets.astype(np.int64)

    def entry(k: int) -> str:
        return f"sample {k} starts" if k < samples else "its last sample ends"

    def damaged(what: str) -> ResumeError:
        return ResumeError(
            f"MDS shard {name!r} is damaged: its offset table says {what}: the table was overwritten; write the "
            "shard again (verify_hashes=True checks each shard against the hashes its writer put in index.json, "
            "where it put any)"
        )

    outside = np.flatnonzero((values < table) | (values > size))
    if outside.size:
        k, value = first + int(outside[0]), int(values[outside[0]])
        where = (
            f"inside the offset table (bytes 0 to {table})"
            if value < table
            else f"past the end of the file ({size} bytes)"
        )
        raise damaged(f"{entry(k)} at byte {value}, {where}")
    steps = np.flatnonzero(np.diff(values) <= 0)
    if steps.size:
        k = first + int(steps[0])
        before, after = int(values[steps[0]]), int(values[steps[0] + 1])
        if after < before:
            raise damaged(f"{entry(k + 1)} at byte {after}, before sample {k} (at {before})")
        raise damaged(f"sample {k} is empty (it starts and ends at byte {before})")
    if first + len(values) == samples + 1 and int(values[-1]) != size:
        raise ResumeError(
            f"MDS shard {name!r}: its offset table ends at byte {int(values[-1])} but it holds {size} bytes "
            "(truncated, rewritten, or the table damaged?)"
        )


def _check_config(name: str, buffer: Any, table: int, start: int) -> None:
    """That the bytes between the offset table and the first sample are one JSON object, the column
    config Mosaic's writer puts there: where the first sample starts is checked by nothing else."""
    try:
        text = bytes(buffer[table:start]).decode("utf-8")
        config, end = json.JSONDecoder().raw_decode(text)
        whole = isinstance(config, dict) and end == len(text)
    except ValueError:  # not UTF-8 (UnicodeDecodeError) or not JSON
        whole = False
    if not whole:
        raise ResumeError(
            f"MDS shard {name!r} is damaged: the column config before the samples (bytes {table} to {start}) is "
            "not one JSON object, so the offset table's first entry (where sample 0 starts), or the config, was "
            "overwritten; write the shard again"
        )


def _decoded(
    name: str, decoder: Callable[[Any], dict[str, Any]], numbers: Iterable[int], samples: Iterable[Any]
) -> Iterator[dict[str, Any]]:
    """The samples decoded; one whose bytes are not as long as its columns say (its offsets in the
    table moved) is an error naming the shard and the sample."""
    for number, data in zip(numbers, samples, strict=True):
        try:
            yield decoder(data)
        except SampleLengthError as exc:
            raise ResumeError(
                f"MDS shard {name!r} is damaged: sample {number} {exc}: its offsets in the offset table (or its "
                "bytes) were overwritten; write the shard again"
            ) from None


class _Opened:
    """A whole shard in memory (``bytes``) or memory-mapped (``mmap``): a sample is a slice of it, a
    copy of its bytes only."""

    def __init__(self, name: str, buffer: Any, samples: int) -> None:
        count = int.from_bytes(buffer[:4], "little") if len(buffer) >= 4 else None
        if count != samples:
            raise ResumeError(
                f"MDS shard {name!r} holds {count} samples but index.json says {samples}: the shard or the index "
                "was rewritten since the other was written"
            )
        table = 4 * (samples + 2)
        if len(buffer) < table:
            raise ResumeError(f"MDS shard {name!r} holds {len(buffer)} bytes, less than its offset table: truncated")
        offsets = np.frombuffer(buffer, _OFFSET, count=samples + 1, offset=4)
        _check_offsets(name, offsets, 0, samples, table, len(buffer))
        _check_config(name, buffer, table, int(offsets[0]))
        self.offsets, self.buffer = offsets, buffer

    def samples(self, indices: Iterable[int]) -> Iterator[bytes]:
        """The bytes of the samples at ``indices`` (a range read in order, or ascending offsets)."""
        buffer, offsets = self.buffer, self.offsets
        if isinstance(indices, range):
            for first in range(indices.start, indices.stop, _CHUNK):
                bounds = offsets[first : min(first + _CHUNK, indices.stop) + 1].tolist()
                for begin, end in itertools.pairwise(bounds):
                    yield buffer[begin:end]
            return
        for i in indices:
            yield buffer[int(offsets[i]) : int(offsets[i + 1])]


class _Ranged:
    """A remote uncompressed shard read by ranged requests: the offsets it needs, then the samples."""

    def __init__(self, reader: MDSReader, url: str, samples: int, size: int) -> None:
        self.remote, self.url, self.count, self.size = reader._remote, url, samples, size

    def _offsets(self, starts: list[int], ends: list[int]) -> list[np.ndarray]:
        """Spans of the offset table (entry indices ``[start, end)``), with the sample count and the
        entries checked (:func:`_check_offsets`)."""
        blocks = self.remote.read_ranges(self.url, [0] + [4 + 4 * s for s in starts], [4] + [4 + 4 * e for e in ends])
        count = int.from_bytes(blocks[0], "little")
        if count != self.count:
            raise ResumeError(
                f"MDS shard {self.url!r} holds {count} samples but index.json says {self.count}: the shard or the "
                "index was rewritten since the other was written"
            )
        spans = []
        for start, end, block in zip(starts, ends, blocks[1:], strict=True):
            if len(block) != 4 * (end - start):
                raise ResumeError(f"MDS shard {self.url!r} ends inside its offset table: truncated")
            spans.append(np.frombuffer(block, _OFFSET))
            _check_offsets(self.url, spans[-1], start, count, 4 * (count + 2), self.size)
        return spans

    def samples(self, indices: Iterable[int]) -> Iterator[bytes]:
        if isinstance(indices, range):
            if not indices:
                return
            bounds = self._offsets([indices.start], [indices.stop + 1])[0].tolist()
            first = 0  # the index in `bounds` of the next sample to fetch
            while first < len(bounds) - 1:
                last = first + 1  # samples [first, last) make one request of at most _BLOCK bytes
                while last < len(bounds) - 1 and bounds[last + 1] - bounds[first] <= _BLOCK:
                    last += 1
                block = self.remote.read_ranges(self.url, [bounds[first]], [bounds[last]])[0]
                for begin, end in itertools.pairwise(bounds[first : last + 1]):
                    yield block[begin - bounds[first] : end - bounds[first]]
                first = last
            return
        wanted = list(indices)
        pairs = [p.tolist() for p in self._offsets(wanted, [i + 2 for i in wanted])]
        yield from self.remote.read_ranges(self.url, [p[0] for p in pairs], [p[1] for p in pairs])


class MDSReader(RemoteReading):
    """Samples of MDS shards (Mosaic Streaming's ``MDSWriter``) as ``{column: value}`` dicts; the
    cursor is a sample number and a restore reads from there (see the module docstring).

    Use it as ``read_shard`` of a :class:`~resumable_data.streams.ShardedIterable` over the shard
    files (or build both with :func:`mds_stream`). Each shard's ``index.json`` (the one in its
    folder) gives its sample count, columns, compression and file sizes; it is read once per
    folder. Values are what Mosaic's reader returns for each column encoding (an ``int``, NumPy
    scalars, ``str``, ``bytes``, read-only NumPy arrays, JSON values; see
    :mod:`~resumable_data.streams.formats.mds_columns`).

    Args:
        columns: columns to decode (all when None); the others are skipped unread.
        decode: ``{column or encoding: function of the bytes}``, for the encodings this reader does
            not decode itself (``jpeg``, ``png``, ``pil``...: ``{"jpeg": lambda b:
            PIL.Image.open(io.BytesIO(b))}``, or ``bytes`` to keep them encoded) or to replace one.
        allow_pickle: decode ``pkl`` columns with :func:`pickle.loads`. Off by default: unpickling a
            file runs whatever code it names (a shard with such a column is refused, naming it).
        verify_hashes: check each file against the hashes in ``index.json`` the first time this
            process reads it whole (a local file, a cached copy, a compressed remote one): a read of
            the whole file on top of the sizes always checked. A remote uncompressed shard read by
            ranges is checked by its size.
        keep_open: shards kept open (memory-mapped, or decompressed in memory) for the re-reads of
            a shuffle buffer; each decompressed one costs its raw size in memory.
        storage_options: for URLs, the filesystem's options as fsspec takes them.
        cache_dir: a local directory to keep remote shards in, shared by every process on the
            machine that passes it (None: no cache), as for :class:`TokenShardReader`.
        cache_limit: bytes the cache may take (None: no bound); the same in every process.
        prefetch: with a cache, how many of the slot's next shards download in the background.

    Example::

        reader = MDSReader(["tokens", "label"])
        stream = ShardedIterable(sorted(glob("mds/shard.*.mds")), read_shard=reader, seed=0)
        stream = mds_stream("mds/", read_shard=reader, seed=0)  # the same, in the index's order
    """

    def __init__(
        self,
        columns: Sequence[str] | None = None,
        *,
        decode: Mapping[str, Callable[[bytes], Any]] | None = None,
        allow_pickle: bool = False,
        verify_hashes: bool = False,
        keep_open: int = 4,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        prefetch: int = 2,
    ) -> None:
        if isinstance(columns, str):
            raise TypeError(f"columns must be a list of column names, got the string {columns!r}; pass [{columns!r}]")
        self.columns = None if columns is None else list(columns)
        if decode is not None and not (
            isinstance(decode, Mapping) and all(isinstance(k, str) and callable(f) for k, f in decode.items())
        ):
            raise TypeError(f"decode must map column or encoding names to functions of the bytes, got {decode!r}")
        self.decode = dict(decode or {})
        self.allow_pickle = bool(allow_pickle)
        self.verify_hashes = bool(verify_hashes)
        self.keep_open = check_int_arg("keep_open", keep_open, minimum=0)
        super().__init__(storage_options, cache_dir, cache_limit, prefetch)
        self._entries: dict[str, tuple[MDSShard, str]] = {}  # shard name -> its index entry, the file's basename
        self._opened: OrderedDict[tuple[Any, ...], _Opened] = OrderedDict()
        self._decoders: dict[tuple[Any, ...], Callable[[Any], dict[str, Any]]] = {}
        self._verified: set[tuple[Any, ...]] = set()

    def __getstate__(self) -> dict[str, Any]:
        # A worker gets the index entries (plain data), not this process's mappings and decoders.
        return {**self.__dict__, "_opened": OrderedDict(), "_decoders": {}, "_verified": set()}

    # -- the index ------------------------------------------------------------------------------
    def _read(self, path: str) -> bytes:
        try:
            if is_url(path):
                with self._remote.open(path) as file:
                    return bytes(file.read())
            with open(path, "rb") as local:
                return local.read()
        except FileNotFoundError as exc:
            raise ResumeError(f"MDS index {path!r} is missing: {exc}") from exc

    def _load_index(self, index: str) -> list[tuple[MDSShard, list[str]]]:
        """The shards ``index`` lists, each with the names of its raw and compressed files, noted."""
        folder = index.rsplit("/", 1)[0] if is_url(index) else os.path.dirname(index)
        listed = []
        for entry in parse_index(self._read(index), repr(index)):
            names = []
            for basename in (entry.raw_basename, entry.zip_basename):
                if basename is not None:
                    name = f"{folder}/{basename}" if is_url(index) else os.path.normpath(os.path.join(folder, basename))
                    self._entries[name] = (entry, basename)
                    names.append(name)
            listed.append((entry, names))
        return listed

    def _entry(self, shard: Any) -> tuple[str, MDSShard, str]:
        """The shard's name as read, its index entry and its file's basename (from the index in its
        folder, read on first use)."""
        name = str(shard) if is_url(shard) else os.path.normpath(os.fspath(shard))
        if name not in self._entries:
            folder = name.rsplit("/", 1)[0] if is_url(name) else os.path.dirname(name)
            index = f"{folder}/{INDEX}" if is_url(name) else os.path.join(folder, INDEX)
            self._load_index(index)
            if name not in self._entries:
                raise ResumeError(f"MDS shard {name!r} is not listed in {index!r}")
        entry, basename = self._entries[name]
        return name, entry, basename

    def shards(self, location: str | os.PathLike[str]) -> list[str]:
        """The shard files of the MDS dataset at ``location`` (a folder or a URL; a multi-stream
        root's subfolders in sorted order), in its index's order, each checked for what this reader
        will decode (columns, pickles, compression) before anything is read.

        A compressed shard is named by its compressed file, unless a local folder holds the
        decompressed one (Mosaic's local cache), which is then read as it is.

        Raises:
            ResumeError: no index, a malformed one, or a shard this reader refuses (see the class).
        """
        location = os.fspath(location)
        if is_url(location):
            indexes = index_files(location, self._remote.glob, lambda url: self._remote.resolve(url)[0].exists(url))
        else:
            indexes = index_files(location, lambda p: local_glob.glob(p, recursive=True), os.path.isfile)
        names = []
        for index in indexes:
            for entry, files in self._load_index(index):
                # The compressed file where there is one, but a local decompressed copy first.
                name = files[-1] if is_url(files[-1]) or not os.path.isfile(files[0]) else files[0]
                self._decoder(name, entry)
                if name != files[0]:
                    decompressor(name, entry.compression or "")  # fail here, not at the first read
                names.append(name)
        return names

    def num_records(self, shard: Any) -> int:
        """The shard's sample count, from its index (no byte of the shard is read)."""
        return self._entry(shard)[1].samples

    def identity(self, shard: Any) -> str:
        """``"size:digest"`` of the file (its size and a digest of its first and last 4 KiB), or for a URL
        its size and ETag; a size other than the index's is refused, naming the shard."""
        name, entry, basename = self._entry(shard)
        try:
            if is_url(name):
                identity = self._remote_identity(name)
            else:
                with open(name, "rb") as file:
                    identity = file_identity(file)
        except FileNotFoundError as exc:
            raise ResumeError(f"MDS shard {name!r} is missing: {exc}") from exc
        self._check_size(name, int(identity.split(":", 1)[0]), entry.expected_bytes(basename))
        return identity

    @staticmethod
    def _check_size(name: str, size: int, expected: int) -> None:
        if size != expected:
            raise ResumeError(
                f"MDS shard {name!r} holds {size} bytes but index.json says {expected}: truncated or rewritten "
                "since the index was written"
            )

    # -- opening --------------------------------------------------------------------------------
    def _decoder(self, name: str, entry: MDSShard) -> Callable[[Any], dict[str, Any]]:
        key = (entry.column_names, entry.column_encodings, entry.column_sizes)
        decoder = self._decoders.get(key)
        if decoder is None:
            decoder = sample_decoder(
                name,
                entry.column_names,
                entry.column_encodings,
                entry.column_sizes,
                columns=self.columns,
                decode=self.decode,
                allow_pickle=self.allow_pickle,
            )
            self._decoders[key] = decoder
        return decoder

    def _keep(self, key: tuple[Any, ...], load: Callable[[], _Opened]) -> _Opened:
        opened = self._opened.get(key)
        if opened is None:
            opened = load()
            if self.keep_open:
                self._opened[key] = opened
                while len(self._opened) > self.keep_open:
                    self._opened.popitem(last=False)
        else:
            self._opened.move_to_end(key)
        return opened

    def _verify(
        self, name: str, entry: MDSShard, basename: str, key: tuple[Any, ...], read: Callable[[], bytes]
    ) -> None:
        if not self.verify_hashes or key in self._verified:
            return
        checked = hash_of(name, entry.hashes.get(basename, {}), read)
        if checked is not None and checked[1] != checked[2]:
            algorithm, expected, actual = checked
            raise ResumeError(
                f"MDS shard {name!r}: its {algorithm} is {actual} but index.json says {expected}: rewritten or "
                "corrupt since the index was written"
            )
        self._verified.add(key)

    def _load_file(self, name: str, path: str, entry: MDSShard, basename: str) -> _Opened:
        """The shard's file at ``path`` (the shard itself, or its cached copy) checked and opened."""
        try:
            with open(path, "rb") as file:
                stat = os.fstat(file.fileno())
                self._check_size(name, stat.st_size, entry.expected_bytes(basename))
                key = (path, stat.st_size, stat.st_mtime_ns)
                self._verify(name, entry, basename, key, lambda: file.read())
                if basename != entry.raw_basename:
                    file.seek(0)
                    raw = decompress(name, entry.compression or "", file.read(), entry.raw_bytes)
                    return _Opened(name, raw, entry.samples)
                if stat.st_size == 0:
                    return _Opened(name, b"", entry.samples)
                return _Opened(name, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), entry.samples)
        except FileNotFoundError as exc:
            raise ResumeError(f"MDS shard {name!r} is missing: {exc}") from exc

    def _open(self, name: str, entry: MDSShard, basename: str, *, wait: bool) -> _Opened | _Ranged:
        cached = self._local_copy(name, lambda path: self._load_file(name, path, entry, basename), wait=wait)
        if cached is not None:
            return cached
        if not is_url(name):
            try:
                stat = os.stat(name)
            except FileNotFoundError as exc:
                raise ResumeError(f"MDS shard {name!r} is missing: {exc}") from exc
            return self._keep(
                (name, stat.st_size, stat.st_mtime_ns), lambda: self._load_file(name, name, entry, basename)
            )
        if basename == entry.raw_basename:
            return _Ranged(self, name, entry.samples, entry.raw_bytes)
        size, tag = self._remote.size_and_tag(name)  # a compressed shard is fetched whole
        self._check_size(name, size, entry.expected_bytes(basename))

        def fetch() -> _Opened:
            data = self._remote.read_ranges(name, [0], [size])[0] if size else b""
            self._verify(name, entry, basename, (name, size, tag), lambda: data)
            return _Opened(name, decompress(name, entry.compression or "", data, entry.raw_bytes), entry.samples)

        return self._keep((name, size, tag), fetch) if tag is not None else fetch()

    # -- reading --------------------------------------------------------------------------------
    def __call__(self, shard: Any, start: int) -> Iterator[dict[str, Any]]:
        """Samples from sample number ``start``; reads no sample before it."""
        name, entry, basename = self._entry(shard)
        if start > entry.samples:
            raise ResumeError(
                f"MDS shard {name!r} has {entry.samples} samples but the cursor is at sample {start}: the shard is "
                "shorter than when the checkpoint was written (replaced?)"
            )
        decoder = self._decoder(name, entry)
        if start == entry.samples:  # a finished shard's cursor: nothing to open (nor to download)
            return iter(())
        opened = self._open(name, entry, basename, wait=start == 0)  # a restore reads by ranges until cached
        numbers = range(start, entry.samples)
        return _decoded(name, decoder, numbers, opened.samples(numbers))

    def read_records(self, shard: Any, offsets: Sequence[int]) -> list[dict[str, Any]]:
        """The samples at ``offsets`` (ascending), with the shard opened once for all of them (a
        remote one not cached: two rounds of concurrent ranged reads, the offsets then the samples)."""
        name, entry, basename = self._entry(shard)
        if offsets and (offsets[0] < 0 or offsets[-1] >= entry.samples):
            raise ResumeError(
                f"MDS shard {name!r} has {entry.samples} samples but the checkpoint needs sample {offsets[-1]}: "
                "the shard is shorter than when the checkpoint was written (replaced?)"
            )
        if not offsets:
            return []
        decoder = self._decoder(name, entry)
        return list(_decoded(name, decoder, offsets, self._open(name, entry, basename, wait=False).samples(offsets)))


def mds_stream(
    location: str | os.PathLike[str], *, read_shard: MDSReader | None = None, **kwargs: Any
) -> ShardedIterable:
    """A :class:`~resumable_data.streams.ShardedIterable` over the MDS dataset at ``location`` (the
    folder Mosaic's ``MDSWriter`` wrote, a URL of one, or a multi-stream root), its shards and sizes
    from ``index.json``: nothing but the index is read here.

    Args:
        location: the dataset's folder or URL.
        read_shard: the :class:`MDSReader` (columns, decode, cache...); a default one when None
            (named as :class:`~resumable_data.streams.ShardedIterable` names its reader).
        **kwargs: the other arguments of ShardedIterable (``seed``, ``shuffle``, ``growth``...).

    Raises:
        ResumeError: no index, a malformed one (naming the field and what was expected), or a shard
            the reader refuses (a ``pkl`` column without ``allow_pickle``, an image encoding without
            ``decode``).

    Example::

        stream = mds_stream("s3://bucket/mds/train", read_shard=MDSReader(cache_dir="/tmp/cache"), seed=0)
        loader = StreamLoader(stream.shuffle_window(10_000), batch_size=32, num_workers=2)
    """
    reader = MDSReader() if read_shard is None else read_shard
    return ShardedIterable(reader.shards(location), read_shard=reader, **kwargs)
