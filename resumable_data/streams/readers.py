"""Ready-made shard readers that seek in O(1): token windows from memmapped arrays, text lines.

Both raise :class:`~resumable_data.ResumeError` naming the shard and the offset when a shard is
missing, or shorter than a saved cursor (truncated or replaced since the checkpoint), before
yielding anything. Both read URLs (``s3://bucket/x.bin``, see :mod:`resumable_data.storage`): token
windows by ranged reads, text lines by seeking in the remote file, or either from a node-local
cache with ``cache_dir=``; local paths are read as files.
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, BinaryIO

import numpy as np
import torch

from ..core.state import check_int_arg
from ..errors import ResumeError
from ..storage.cached import RemoteReading
from ..storage.files import StorageError, is_url, redact

__all__ = ["TextLineReader", "TokenShardReader", "file_identity"]

_EDGE = 4096  # bytes read at each end of a shard for its identity
_MAPPED_SHARDS = 64  # token shards a reader keeps mapped
_CHUNK = 32  # windows a reader makes at a time (see TokenShardReader._windows)
# Remote token shards: windows closer than _GAP bytes are fetched in one ranged read, of at most
# _RANGE bytes. The ranges of one read go out at once, so a second request costs no round trip, only
# its headers (_REQUEST bytes, about): a gap is read through only where it costs less than they do.
# (A gap of 64 KiB, before, made a window's every read by key fetch most of a shard again: issue 48.)
_REQUEST = 1 << 10  # what a request costs beyond the bytes it reads (also TokenShardReader._ranged_bytes)
_GAP = _REQUEST
_RANGE = 8 << 20
# A shard downloading in this process is read by ranges only until those reads have fetched, headers
# counted, this share of it; later reads wait for the download (see TokenShardReader._reads_much).
_RANGED_SHARE = 8
_NPY_HEAD = 64 << 10  # bytes fetched to read a remote .npy header (numpy's are far smaller)
_TEXT_BLOCK = 2 << 20  # read-ahead of a remote text file: a restore fetches one block, not the file


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


def _path_identity(shard: Any, what: str, remote_identity: Callable[[str], str]) -> str:
    """The identity of a local file (:func:`file_identity`) or of a remote object (size and ETag)."""
    try:
        if is_url(shard):
            return remote_identity(shard)
        with open(os.fspath(shard), "rb") as file:
            return file_identity(file)
    except FileNotFoundError as exc:
        raise ResumeError(f"{what} shard {redact(shard)!r} is missing: {exc}") from exc


def _npy_header(file: BinaryIO, size: int) -> tuple[int, int, np.dtype] | None:
    """Where the data of the ``.npy`` file of ``size`` bytes starts, its length and dtype, from its
    header alone (None for a format version other than 1.0 and 2.0, which numpy writes only for
    exotic dtypes).

    Raises:
        ValueError: the header is not one numpy reads, or the data is shorter than it says.
    """
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
    return data, int(shape[0]), dtype


class TokenShardReader(RemoteReading):
    """Fixed-length token windows from a ``.npy`` file or a raw ``.bin`` token file, via memmap.

    Record ``i`` of a shard is ``tokens[i * stride : i * stride + window]`` as an int64 tensor; a
    tail shorter than ``window`` is not a record. Seeking to record ``i`` is a slice of the memmap:
    O(1), and only the pages of the records actually read are touched. A shard named by a URL
    (``s3://bucket/x.bin``) is read by ranged requests instead: a window is one byte range, records
    read in order come a few MiB per request, and neighbouring offsets of :meth:`read_records`
    share one request; its count comes from the object's size (and a ``.npy`` header), its
    identity from its size and ETag. With ``cache_dir``, a remote shard is downloaded once per
    machine into a local cache and memmapped from there (see :mod:`resumable_data.storage`):
    a :class:`ShardedIterable` tells the reader the shards its slot reads next, so the next
    ``prefetch`` download in the background and eviction drops the shard needed furthest
    ahead; records read before their shard is cached (a restore's first batch) come by ranged
    requests meanwhile.

    Args:
        window: tokens per record (e.g. ``block_size + 1`` for next-token targets).
        stride: tokens between record starts (default ``window``: non-overlapping windows).
        dtype: element type of raw ``.bin`` files (``.npy`` files carry their own).
        storage_options: for URLs, the filesystem's options as fsspec takes them (credentials,
            ``{"client_kwargs": {"endpoint_url": ...}}`` for an S3-compatible server); see
            :mod:`resumable_data.storage`.
        cache_dir: a local directory to keep remote shards in, shared by every process on the
            machine that passes it (None: no cache, every read is a ranged request).
        cache_limit: bytes the cache may take (None: no bound); the same in every process.
        prefetch: with a cache, how many of the slot's next shards download in the background.

    Example::

        reader = TokenShardReader(1025)  # 1024 inputs + 1 shifted target
        stream = ShardedIterable(sorted(glob("tokens/*.bin")), read_shard=reader)
        window = next(iter(stream))  # torch.int64 tensor of 1025 tokens
    """

    # Calls for different shards may come from several threads at once (no user code runs here):
    # a restore's re-read of records from several remote shards fetches them all in one round trip.
    reads_concurrently = True

    def __init__(
        self,
        window: int,
        *,
        stride: int | None = None,
        dtype: Any = np.uint16,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        prefetch: int = 2,
    ) -> None:
        self.window = check_int_arg("window", window, minimum=1)
        self.stride = window if stride is None else check_int_arg("stride", stride, minimum=1)
        self.dtype = np.dtype(dtype)
        super().__init__(storage_options, cache_dir, cache_limit, prefetch)
        self._mapped: OrderedDict[tuple[str, int, int], np.ndarray] = OrderedDict()
        # Sizes of remote shards as this process last read them (identity(), a first read): a later
        # read of the shard takes it instead of asking again (a restore checks the shard, then reads
        # from its cursor; a shuffle re-reads records of a shard a few at a time). A ranged read
        # past the end of a shard that shrank since is an error of its own (StorageError).
        self._sizes: dict[str, int] = {}
        # Bytes fetched by ranged reads of each remote shard since this process last read it from
        # the cache (see _reads_much); calls for one shard come from one thread at a time.
        self._ranged: dict[str, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        # A worker maps the files (and checks the shards) itself; mappings, sizes and counts stay here.
        return {**self.__dict__, "_mapped": OrderedDict(), "_sizes": {}, "_ranged": {}}

    def tokens(self, shard: Any) -> np.ndarray:
        """The shard's tokens as a read-only array over a memory mapping (empty for an empty file).

        The last few shards' mappings are kept, keyed by path, size and modification time: a
        shuffled read fetches a handful of records from each of many shards at a time, and mapping
        a file costs far more than reading a window from it. A file rewritten since is mapped anew.
        """
        path = os.fspath(shard)
        try:
            stat = os.stat(path)
        except FileNotFoundError as exc:
            raise ResumeError(f"token shard {redact(path)!r} is missing: {exc}") from exc
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

    def _map(self, path: str, size: int, name: str | None = None) -> np.ndarray:
        """Map the file at ``path``; ``name`` (default ``path``) is the shard named in errors, whose
        suffix tells a ``.npy`` file (a cached copy's local name has none)."""
        name = path if name is None else name
        try:
            if name.endswith(".npy"):
                return np.load(path, mmap_mode="r")
            if size % self.dtype.itemsize:
                raise ResumeError(
                    f"token shard {redact(name)!r} holds {size} bytes, not a multiple of {self.dtype.itemsize} "
                    f"({self.dtype}): it is truncated or written with another dtype"
                )
            if size == 0:  # an empty file cannot be mapped
                return np.empty(0, dtype=self.dtype)
            # mmap and a read-only view: a few times cheaper than np.memmap, and a shuffle reading
            # by key maps a cached shard each time it moves to it (see storage.cached).
            with open(path, "rb") as file:
                return np.frombuffer(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), dtype=self.dtype)
        except FileNotFoundError as exc:
            raise ResumeError(f"token shard {redact(name)!r} is missing: {exc}") from exc
        except ValueError as exc:  # np.load on a .npy whose data is shorter than its header says
            raise ResumeError(f"token shard {redact(name)!r} is unreadable or truncated: {exc}") from exc

    def num_records(self, shard: Any) -> int:
        """Windows in the shard, from its size (and a ``.npy`` file's header): the file is not mapped.

        What a :class:`ShardedIterable` asks of every shard when it is built, so it costs one
        ``stat`` per raw shard; the checks are those of mapping it (:meth:`tokens`).
        """
        if is_url(shard):
            return self._count(self._remote_layout(shard)[1])
        path = os.fspath(shard)
        try:
            size = os.stat(path).st_size
            if path.endswith(".npy"):
                with open(path, "rb") as file:
                    header = _npy_header(file, size)
                return self._count(len(self.tokens(shard)) if header is None else header[1])
        except FileNotFoundError as exc:
            raise ResumeError(f"token shard {redact(path)!r} is missing: {exc}") from exc
        except ResumeError:
            raise
        except ValueError as exc:  # a header numpy cannot read, as np.load would refuse it
            raise ResumeError(f"token shard {redact(path)!r} is unreadable or truncated: {exc}") from exc
        self._check_size(path, size)
        return self._count(size // self.dtype.itemsize)

    def _check_size(self, name: str, size: int) -> None:
        if size % self.dtype.itemsize:
            raise ResumeError(
                f"token shard {redact(name)!r} holds {size} bytes, not a multiple of {self.dtype.itemsize} "
                f"({self.dtype}): it is truncated or written with another dtype"
            )

    def _remote_layout(self, url: str) -> tuple[int, int, np.dtype]:
        """Where a remote shard's tokens start, how many it holds and their dtype: one HEAD request
        (none right after :meth:`identity` read the size), and for a ``.npy`` file one ranged read
        of its header."""
        try:
            size = self._sizes.get(url)
            if size is None:
                size, tag = self._remote.size_and_tag(url)
                self._sizes[url] = size
                if self._shard_cache is not None:
                    self._shard_cache.note(url, size, tag)
            if not url.endswith(".npy"):
                self._check_size(url, size)
                return 0, size // self.dtype.itemsize, self.dtype
            with self._remote.open(url, block_size=_NPY_HEAD) as file:
                header = _npy_header(file, size)
        except FileNotFoundError as exc:
            raise ResumeError(f"token shard {redact(url)!r} is missing: {exc}") from exc
        except ValueError as exc:
            raise ResumeError(f"token shard {redact(url)!r} is unreadable or truncated: {exc}") from exc
        if header is None:
            raise ResumeError(
                f"token shard {redact(url)!r} is a .npy file of a format version other than 1.0 or 2.0, which is read "
                "only from a local path; write it with np.save of a plain integer array"
            )
        return header

    def identity(self, shard: Any) -> str:
        """The shard's size and a digest of its first and last bytes (see :func:`file_identity`), or for
        a URL its size and ETag (the size is then kept for the shard's next read)."""
        identity = _path_identity(shard, "token", self._remote_identity)
        if is_url(shard):
            self._sizes[str(shard)] = int(identity.split(":", 1)[0])
        return identity

    def _cached(self, shard: Any, *, wait: bool, join: bool = False) -> np.ndarray | None:
        """The remote shard's tokens memmapped from the cache (downloaded first with ``wait``; with
        ``join``, once this process's download of it in flight is in), or None."""

        def load(path: str) -> np.ndarray:
            return self._map(path, os.stat(path).st_size, str(shard))

        return self._local_copy(shard, load, wait=wait, join=join)

    def count_windows(self, n_tokens: int) -> int:
        """Records in a shard of ``n_tokens`` tokens: how an index file's token counts give the sizes
        (:meth:`ShardedIterable.from_index`) without opening a shard."""
        return self._count(n_tokens)

    def _count(self, n_tokens: int) -> int:
        return 0 if n_tokens < self.window else (n_tokens - self.window) // self.stride + 1

    def __call__(self, shard: Any, start: int) -> Iterator[torch.Tensor]:
        """Windows from record offset ``start``."""
        tokens = self._cached(shard, wait=start == 0)  # a restore reads by ranges until it is cached
        remote = tokens is None and is_url(shard)
        if remote:
            base, n_tokens, dtype = self._remote_layout(shard)
            n = self._count(n_tokens)
        else:
            tokens = self.tokens(shard) if tokens is None else tokens
            n = self._count(len(tokens))
        if start > n:
            raise ResumeError(
                f"token shard {redact(shard)!r} has {n} windows but the cursor is at offset {start}: "
                "the shard is shorter than when the checkpoint was written (truncated or replaced?)"
            )
        if tokens is None:
            return self._remote_windows(shard, base, dtype, range(start, n))
        return self._windows(tokens.view(np.ndarray), range(start, n))

    def read_records(self, shard: Any, offsets: Sequence[int]) -> list[torch.Tensor]:
        """The windows at record ``offsets`` (ascending), with the shard mapped once for all of them.

        What a shuffle buffer's restore calls: up to a buffer's worth of scattered windows cost one
        open and one slice each, not one open each. Each window gets its own tensor storage, as
        from :meth:`__call__`. A remote shard not in the cache (if any) is read by ranged requests.
        """
        # Counted only for a remote shard read through the cache: local reads by key stay one slice each.
        fetched = self._ranged_bytes(offsets) if self._shard_cache is not None and is_url(shard) else 0
        tokens = self._cached(shard, wait=False, join=self._reads_much(shard, fetched))
        if tokens is None and is_url(shard):
            url = str(shard)
            if self._shard_cache is not None:
                self._ranged[url] = self._ranged.get(url, 0) + fetched
            if url.endswith(".npy") or url in self._sizes:
                base, n_tokens, dtype = self._remote_layout(url)
                self._check_offsets(url, self._count(n_tokens), offsets)
                return list(self._run_windows(url, base, dtype, list(self._runs(offsets, dtype.itemsize))))
            # A raw shard's records start at byte 0: read them without asking its size first (one
            # round trip, not two); a read past its end is then checked against the size.
            try:
                return list(self._run_windows(url, 0, self.dtype, list(self._runs(offsets, self.dtype.itemsize))))
            except StorageError:
                self._check_offsets(url, self._count(self._remote_layout(url)[1]), offsets)
                raise
        self._ranged.pop(str(shard), None)
        tokens = self.tokens(shard) if tokens is None else tokens
        self._check_offsets(shard, self._count(len(tokens)), offsets)
        return list(self._windows(tokens.view(np.ndarray), offsets))

    def _ranged_bytes(self, offsets: Sequence[int]) -> int:
        """What ranged reads of ``offsets`` would fetch, each request's headers counted."""
        itemsize = self.dtype.itemsize
        step, span = self.stride * itemsize, self.window * itemsize
        return sum((run[-1] - run[0]) * step + span + _REQUEST for run in self._runs(offsets, itemsize))

    def _reads_much(self, shard: Any, fetched: int) -> bool:
        """Whether a download of a remote shard in flight should be waited for rather than read by
        ranges: when this process read it by ranges already since it last read it from the cache,
        and ``fetched`` more bytes would bring those reads to 1/_RANGED_SHARE of the shard or more.
        So a window's reads of small records by key, each a request, take at most about that share
        of a shard, plus one read, on top of its download (they took 1.8 D over three epochs before:
        issue 48), and a restore's first read of each shard comes by ranges at once, however many
        records it asks (a batch of 32 scattered 16-byte records is 32 requests)."""
        if self._shard_cache is None or not is_url(shard) or str(shard) not in self._ranged:
            return False
        size = self._sizes.get(str(shard)) or self._shard_cache.known_size(str(shard))
        if not size:
            return False
        return _RANGED_SHARE * (self._ranged[str(shard)] + fetched) >= size

    @staticmethod
    def _check_offsets(shard: Any, n: int, offsets: Sequence[int]) -> None:
        if offsets and (offsets[0] < 0 or offsets[-1] >= n):
            bad = offsets[-1] if offsets[-1] >= n else offsets[0]
            raise ResumeError(
                f"token shard {redact(shard)!r} has {n} windows but the checkpoint needs the one at "
                f"offset {bad}: the shard is shorter than when the checkpoint was written (truncated or replaced?)"
            )

    def _runs(self, offsets: Iterable[int], itemsize: int) -> Iterator[list[int]]:
        """Ascending record offsets grouped into runs that one ranged read fetches: windows less than
        ``_GAP`` bytes apart, at most ``_RANGE`` bytes a run."""
        step, span = self.stride * itemsize, self.window * itemsize
        run: list[int] = []
        for offset in offsets:
            if run and ((offset - run[-1]) * step - span > _GAP or (offset - run[0]) * step + span > _RANGE):
                yield run
                run = []
            run.append(offset)
        if run:
            yield run

    def _run_windows(self, url: str, base: int, dtype: np.dtype, runs: list[list[int]]) -> Iterator[torch.Tensor]:
        """The windows of ``runs``, each run fetched by one ranged read (all of them concurrently)."""
        step, span = self.stride * dtype.itemsize, self.window * dtype.itemsize
        starts = [base + run[0] * step for run in runs]
        blocks = self._remote.read_ranges(url, starts, [base + run[-1] * step + span for run in runs])
        for run, block in zip(runs, blocks, strict=True):
            yield from self._windows(np.frombuffer(block, dtype=dtype), [offset - run[0] for offset in run])

    def _remote_windows(self, url: str, base: int, dtype: np.dtype, offsets: range) -> Iterator[torch.Tensor]:
        """Windows at ``offsets`` in order, a run (a few MiB) per request as the iteration reaches it,
        or from the cache as soon as a background download has put the shard there."""
        for run in self._runs(offsets, dtype.itemsize):
            tokens = self._cached(url, wait=False)
            if tokens is not None:
                yield from self._windows(tokens.view(np.ndarray), range(run[0], offsets.stop))
                return
            yield from self._run_windows(url, base, dtype, [run])

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


class TextLineReader(RemoteReading):
    """Lines of a text or JSONL file; the cursor is a byte offset, so a restore seeks, not replays.

    Each line (without its newline) is decoded and passed to ``parse`` (e.g. ``json.loads``).
    Offsets are bytes: a restore checks that the saved offset is at a line start of the file and
    ``seek``\\ s there. A shard named by a URL is read through a seekable fsspec file (ranged
    requests of a few MiB each), so a restore fetches the block it seeks to, not the file. With
    ``cache_dir``, a remote shard read from its start is read from the node-local cache (downloaded
    once per machine, the slot's next ``prefetch`` shards in the background, as for
    :class:`TokenShardReader`); a read from another offset takes the cached copy if it is there.

    Args:
        parse: applied to each decoded line; the line string itself when None.
        encoding: text encoding of the file.
        storage_options: for URLs, the filesystem's options as fsspec takes them (see
            :mod:`resumable_data.storage`).
        cache_dir: a local directory to keep remote shards in, shared by every process on the
            machine that passes it (None: no cache).
        cache_limit: bytes the cache may take (None: no bound); the same in every process.
        prefetch: with a cache, how many of the slot's next shards download in the background.

    Example::

        stream = ShardedIterable(["a.jsonl", "b.jsonl"], read_shard=TextLineReader(json.loads))
        stream.state_dict()["remaining"]  # [[shard index, name, byte offset], ...]
    """

    def __init__(
        self,
        parse: Callable[[str], Any] | None = None,
        *,
        encoding: str = "utf-8",
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        prefetch: int = 2,
    ) -> None:
        self.parse = parse
        self.encoding = encoding
        super().__init__(storage_options, cache_dir, cache_limit, prefetch)

    def identity(self, shard: Any) -> str:
        """The file's size and a digest of its first and last bytes (see :func:`file_identity`), or for
        a URL its size and ETag."""
        return _path_identity(shard, "text", self._remote_identity)

    def read_from(self, shard: Any, start: int) -> Iterator[tuple[int, Any]]:
        """``(byte offset after the line, parsed line)`` from byte offset ``start``."""
        path = str(shard) if is_url(shard) else os.fspath(shard)
        with self._open(path, start, wait=start == 0) as file:  # a restore seeks remotely until it is cached
            self._seek_line(file, path, start)
            offset = start
            for line in file:
                offset += len(line)
                yield offset, self._decode(line)

    def read_records(self, shard: Any, offsets: Sequence[int]) -> list[Any]:
        """The parsed lines at byte ``offsets`` (ascending), from one open of the file.

        What a shuffle buffer's restore calls; consecutive lines are read without seeking.
        """
        path = str(shard) if is_url(shard) else os.fspath(shard)
        if not offsets:
            return []
        records = []
        with self._open(path, offsets[0], wait=False) as file:
            position = -1
            for offset in offsets:
                if offset != position:
                    self._seek_line(file, path, offset)
                line = file.readline()
                if not line:
                    raise ResumeError(
                        f"text shard {redact(path)!r} has no line at byte {offset} (it ends there): it is shorter "
                        "than when the checkpoint was written (truncated or replaced?)"
                    )
                position = offset + len(line)
                records.append(self._decode(line))
        return records

    def _open(self, path: str, start: int, *, wait: bool) -> BinaryIO:
        """The shard's file: the cached copy of a remote one if cached (downloaded first with ``wait``),
        else a seekable remote file or the local file."""
        try:
            cached = self._local_copy(path, str, wait=wait)
            if cached is not None:
                return open(cached, "rb")
            return self._remote.open(path, block_size=_TEXT_BLOCK) if is_url(path) else open(path, "rb")
        except FileNotFoundError as exc:
            raise ResumeError(f"text shard {redact(path)!r} is missing (cursor at byte {start}): {exc}") from exc

    @staticmethod
    def _seek_line(file: BinaryIO, path: str, start: int) -> None:
        """Seek to byte ``start``, refusing one past the end or inside a line. The end of the file is
        a line start even when its last line has no newline: it is where reading that line left off."""
        size = file.seek(0, os.SEEK_END)  # a local file's or a remote object's size
        if start > size:
            raise ResumeError(
                f"text shard {redact(path)!r} has {size} bytes but the cursor is at byte {start}: "
                "it is shorter than when the checkpoint was written (truncated or replaced?)"
            )
        if 0 < start < size:
            file.seek(start - 1)
            if file.read(1) != b"\n":
                raise ResumeError(
                    f"text shard {redact(path)!r}: byte offset {start} is not at the start of a line, so "
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
