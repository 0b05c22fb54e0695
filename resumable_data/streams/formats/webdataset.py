"""WebDatasetReader: the samples of WebDataset ``.tar`` shards, read as WebDataset reads them, with an
O(1) seek through a sample index built once per shard.

A record is the sample dict WebDataset's own ``WebDataset(urls)`` yields: ``__key__``, ``__url__``
(and ``__local_path__`` for a local file), and one ``bytes`` value per member, under its extension
(``"jpg"``, ``"cls"``, ``"seg.png"``), or whatever ``decode(sample)`` returns. The cursor is a
sample number: the shard's sample index (:mod:`.tar_index`: each member's data offset, size and
field, from the tar headers alone) turns it into byte offsets, so a restore reads the samples from
its cursor on and nothing before them, and a shuffle buffer's restore reads single samples by
offset. The index is built on a shard's first use in a process and kept: by a header scan (a
seek per member, no data read) when it is counted or read from another sample than its first, or
by the pass that reads it from its first sample (no second read). With ``cache_dir`` it is also
saved there, named by the shard and its identity, so later runs and the other processes of the
machine read it instead of scanning.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ...core.state import brief
from ...errors import ResumeError
from ...storage.cached import RemoteReading
from ...storage.files import Remote, is_url
from ..readers import _path_identity
from ..shard_index import index_location, sibling
from ..sharded import ShardedIterable
from .tar_index import Sample, TarIndex, grouped, scan

__all__ = ["WebDatasetReader", "expand_braces", "webdataset_stream"]

_INDEXED_MEMBERS = 1 << 21  # members of the shard indexes a reader keeps in memory (~50 MiB)
_SAMPLES = 64  # samples assembled at a time when reading in order
# Remote shards without a cache: samples closer than _GAP bytes are fetched by one ranged read of at
# most _RANGE bytes (as TokenShardReader's windows); a scan reads ahead _SCAN_BLOCK bytes at a time.
_GAP = 1 << 10  # read through only a gap that costs less than a request's headers (see readers.py)
_RANGE = 8 << 20
_SCAN_BLOCK = 8 << 20
_INDEX_FOLDER = "tar-index"  # in cache_dir, next to the ShardCache's folders
_BRACES = re.compile(r"\{([^{}]*)\}")
_RANGE_ITEM = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


class WebDatasetReader(RemoteReading):
    """Samples of WebDataset tar shards, grouped by key as WebDataset groups them; the cursor is a
    sample number and a restore seeks to it through the shard's sample index.

    Use it as ``read_shard`` of a :class:`~resumable_data.streams.ShardedIterable`, one shard per
    ``.tar`` file (or :func:`webdataset_stream`). It counts each shard's samples
    (:class:`~resumable_data.streams.RecordCounter`: the index, built when the ShardedIterable is
    built), so the state is a position and ``shuffle_window`` reads by position.

    Counting. A tar file has no table of contents: its headers are spread through it, so a shard's
    index (and count) comes from reading it once: locally a seek per member, remotely the whole
    object (or its download into ``cache_dir``). The ShardedIterable asks every shard's count when
    it is built; for many remote shards give the counts instead: a wids index
    (``webdataset_stream("train.json")``), ``cache_dir`` (the indexes saved once per machine), or
    ``sizes="unknown"`` (a shard is then indexed by the pass that first reads it).

    Read: plain (uncompressed) tar files as ``webdataset.TarWriter``/``ShardWriter``, ``tar`` or
    Python's ``tarfile`` write them. Refused with a :class:`~resumable_data.ResumeError` naming
    the shard: a compressed tar (no O(1) seek: decompress it), a damaged or cut one (a bad or
    zeroed header, or a file that stops without its end-of-archive marker, as a partial copy cut
    on a block boundary leaves it, where WebDataset stops silently with fewer samples; or a cut
    member), a sample with two members of one field, and, at a restore, a shard whose identity
    changed since the checkpoint. A shard is refused when it is counted; one read before it is
    counted (``sizes="unknown"``) yields the samples before the damage, then raises.

    Args:
        decode: applied to each sample dict (``{"__key__": ..., "jpg": b"..."}``); the dict of
            bytes itself when None. WebDataset's own decoder works here
            (``webdataset.autodecode.Decoder([webdataset.imagehandler("torchrgb")])``).
        storage_options: for URLs, the filesystem's options as fsspec takes them (see
            :mod:`resumable_data.storage`).
        cache_dir: a local directory shared by every process on the machine that passes it (None:
            none). Remote shards are kept there (downloaded once per machine, the slot's next
            ``prefetch`` in the background, as for :class:`~resumable_data.streams.TokenShardReader`),
            and every shard's sample index is saved there (``tar-index/``: small files, outside
            ``cache_limit``), local shards' too.
        cache_limit: bytes the shard cache may take (None: no bound); the same in every process.
        prefetch: with a cache, how many of the slot's next shards download in the background.

    Example::

        reader = WebDatasetReader(decode=lambda s: (s["jpg"], int(s["cls"])))
        stream = ShardedIterable(sorted(glob("shards/*.tar")), read_shard=reader, seed=0)
        stream = stream.shuffle_buffer(1000, seed=0)
        loader = StreamLoader(stream, batch_size=64, num_workers=4)
        state = loader.state_dict()  # restore: loader.load_state_dict(state), reads from there
    """

    def __init__(
        self,
        decode: Callable[[dict[str, Any]], Any] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        prefetch: int = 2,
    ) -> None:
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be callable, got {type(decode).__name__}")
        self.decode = decode
        super().__init__(storage_options, cache_dir, cache_limit, prefetch)
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        self._indexes: OrderedDict[tuple[str, str], TarIndex] = OrderedDict()  # (shard, identity) -> index
        self._identities: dict[str, str] = {}  # a remote shard's identity as last asked in this process

    def __getstate__(self) -> dict[str, Any]:
        # A spawned worker reads the indexes from cache_dir, or scans the shards it reads itself.
        return {**self.__dict__, "_indexes": OrderedDict(), "_identities": {}}

    # -- identity and index -----------------------------------------------------------------------
    def identity(self, shard: Any) -> str:
        """The file's size and a digest of its first and last 4 KiB, or for a URL its size and ETag:
        a cut or rewritten shard changes it (see :func:`~resumable_data.streams.readers.file_identity`)."""
        identity = _path_identity(shard, "tar", self._remote_identity)
        if is_url(shard):
            self._identities[str(shard)] = identity
        return identity

    def num_records(self, shard: Any) -> int:
        """The shard's samples, from its index (built now if this process has none for it)."""
        return len(self.index(shard))

    def index(self, shard: Any) -> TarIndex:
        """The shard's sample index: kept from an earlier use, read from ``cache_dir``, or built now
        from the tar headers (and then saved to ``cache_dir``)."""
        key, index = self._known(shard)
        if index is None:
            with self._opened(shard) as (read, size):
                index = TarIndex.build(grouped(scan(read, size, key[0]), key[0]))
            self._keep(key, index)
        return index

    def _known(self, shard: Any) -> tuple[tuple[str, str], TarIndex | None]:
        """``(shard name, identity)``, and the shard's index if this process keeps it or ``cache_dir``
        has it (else None)."""
        name = str(shard)
        identity = self._identities.get(name) if is_url(shard) else None
        key = (name, identity if identity is not None else self.identity(shard))
        index = self._indexes.get(key)
        if index is not None:
            self._indexes.move_to_end(key)
            return key, index
        saved = self._saved_index_path(*key)
        index = _load_index(saved) if saved is not None else None
        if index is not None:
            self._remember(key, index)
        return key, index

    def _keep(self, key: tuple[str, str], index: TarIndex) -> None:
        """Keep a new index in this process, and save it in ``cache_dir``."""
        saved = self._saved_index_path(*key)
        if saved is not None:
            _save_index(saved, index)
        self._remember(key, index)

    def _remember(self, key: tuple[str, str], index: TarIndex) -> None:
        self._indexes[key] = index
        held = sum(len(kept.members) for kept in self._indexes.values())
        while held > _INDEXED_MEMBERS and len(self._indexes) > 1:
            held -= len(self._indexes.popitem(last=False)[1].members)

    def _saved_index_path(self, name: str, identity: str) -> str | None:
        if self.cache_dir is None:
            return None
        digest = hashlib.sha256(f"{name}\0{identity}".encode()).hexdigest()[:32]
        return os.path.join(self.cache_dir, _INDEX_FOLDER, f"{digest}.npz")

    @contextlib.contextmanager
    def _opened(self, shard: Any) -> Iterator[tuple[Callable[[int, int], bytes], int]]:
        """``(read(offset, n), size)`` of the whole shard: mapped (a local file, or a remote shard's
        cached copy, downloaded first), or a remote file read ahead a few MiB a request."""
        mapped = self._mapped(shard, wait=True)
        if mapped is not None:
            yield _slices(mapped), len(mapped)
            return
        with self._remote.open(str(shard), block_size=_SCAN_BLOCK) as file:
            size = file.seek(0, os.SEEK_END)

            def read(at: int, n: int) -> bytes:
                file.seek(at)
                return file.read(n)

            yield read, size

    def _mapped(self, shard: Any, *, wait: bool) -> Any:
        """The shard's bytes mapped in memory (a local file, or a remote shard's cached copy; with
        ``wait`` downloaded first), or None for a remote shard not cached."""
        if is_url(shard):
            return self._local_copy(shard, _map, wait=wait)
        try:
            return _map(os.fspath(shard))
        except FileNotFoundError as exc:
            raise ResumeError(f"tar shard {str(shard)!r} is missing: {exc}") from exc

    # -- reading ----------------------------------------------------------------------------------
    def __call__(self, shard: Any, start: int) -> Iterator[Any]:
        """Samples from sample number ``start``; reads nothing before it."""
        key, index = self._known(shard)
        if index is None and start == 0:
            return self._first_read(shard, key)
        index = self.index(shard) if index is None else index
        if start > len(index):
            raise ResumeError(
                f"tar shard {str(shard)!r} has {len(index)} samples but the cursor is at sample {start}: the "
                "shard is shorter than when the checkpoint was written (cut or replaced?)"
            )
        return self._samples(shard, index, start)

    def _first_read(self, shard: Any, key: tuple[str, str]) -> Iterator[Any]:
        """A shard with no index yet, read in one pass: each sample as its headers are scanned, and
        the index kept once the pass is through (an index built first would read the shard twice)."""
        samples: list[Sample] = []
        with self._opened(shard) as (read, size):
            for sample in grouped(scan(read, size, key[0]), key[0]):
                samples.append(sample)
                yield self._record(shard, sample, read)
        self._keep(key, TarIndex.build(samples))

    def _samples(self, shard: Any, index: TarIndex, start: int) -> Iterator[Any]:
        mapped = self._mapped(shard, wait=start == 0)  # a restore reads by ranges until it is cached
        for first in range(start, len(index), _SAMPLES):
            if mapped is None:
                mapped = self._mapped(shard, wait=False)  # a background download may have finished
            chunk = index.samples(first, min(first + _SAMPLES, len(index)))
            if mapped is not None:
                yield from (self._record(shard, sample, _slices(mapped)) for sample in chunk)
            else:
                yield from self._fetched(shard, chunk)

    def read_records(self, shard: Any, offsets: Sequence[int]) -> list[Any]:
        """The samples at sample numbers ``offsets`` (ascending), from one open of the shard (or, for
        a remote shard not cached, ranged reads of neighbouring samples together): what a shuffle
        buffer's restore calls."""
        index = self.index(shard)
        if offsets and (offsets[0] < 0 or offsets[-1] >= len(index)):
            raise ResumeError(
                f"tar shard {str(shard)!r} has {len(index)} samples but the checkpoint needs sample "
                f"{offsets[-1] if offsets[-1] >= len(index) else offsets[0]}: the shard is shorter than when the "
                "checkpoint was written (cut or replaced?)"
            )
        chunk = [index.samples(offset, offset + 1)[0] for offset in offsets]
        mapped = self._mapped(shard, wait=False)
        if mapped is not None:
            return [self._record(shard, sample, _slices(mapped)) for sample in chunk]
        return list(self._fetched(shard, chunk))

    def _fetched(self, shard: Any, chunk: list[Sample]) -> Iterator[Any]:
        """The samples of ``chunk`` read by ranged requests, neighbours together (all runs at once).
        Every sample has a member (a sample is made by its first one)."""
        starts: list[int] = []
        ends: list[int] = []
        runs: list[list[Sample]] = []
        for sample in chunk:
            rows = sample[1]
            lo, hi = rows[0][0], rows[-1][0] + rows[-1][1]
            if runs and 0 <= lo - ends[-1] <= _GAP and hi - starts[-1] <= _RANGE:
                ends[-1] = hi
                runs[-1].append(sample)
            else:
                starts.append(lo)
                ends.append(hi)
                runs.append([sample])
        blocks = self._remote.read_ranges(str(shard), starts, ends)
        for base, samples, block in zip(starts, runs, blocks, strict=True):
            yield from (self._record(shard, sample, _slices(block, base)) for sample in samples)

    def _record(self, shard: Any, sample: Sample, read: Callable[[int, int], bytes]) -> Any:
        """The sample dict (WebDataset's: ``__key__``, ``__url__``, ``__local_path__`` for a local
        file, then each field's bytes, ``read(offset, size)``), decoded."""
        key, rows = sample
        record: dict[str, Any] = {"__key__": key, "__url__": str(shard)}
        if not is_url(shard):
            record["__local_path__"] = os.fspath(shard)
        for offset, size, field in rows:
            record[field] = read(offset, size)
        return record if self.decode is None else self.decode(record)


def _slices(data: Any, base: int = 0) -> Callable[[int, int], bytes]:
    """``read(offset, n)`` of the bytes ``data`` (a mapping, or a block read from offset ``base``) holds."""
    return lambda at, n: data[at - base : at - base + n]


def _map(path: str) -> Any:
    """A read-only mapping of the file at ``path`` (an empty file: empty bytes, which cannot be mapped)."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return b""
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)


def _load_index(path: str) -> TarIndex | None:
    """A saved index, or None when there is none (or it is unreadable: it is then built again)."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            return TarIndex.from_arrays(arrays)
    except (OSError, ValueError, KeyError):  # none yet, or one a full disk cut: built (and saved) again
        return None


def _save_index(path: str, index: TarIndex) -> None:
    """Save ``index`` at ``path`` atomically (written aside, then renamed), so a reader sees a whole
    index or none."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".partial")
    try:
        with os.fdopen(handle, "wb") as file:
            savez: Any = np.savez  # numpy's stubs type its keyword arrays as its options
            savez(file, **index.arrays())
        os.replace(partial, path)
    except BaseException:
        os.unlink(partial)
        raise


# -- a stream over a set of shards ------------------------------------------------------------------
def expand_braces(pattern: str) -> list[str]:
    """The names a WebDataset brace pattern stands for, in order: ``{000..002}`` a numeric range
    (zero-padded as written), ``{a,b}`` alternatives; several groups multiply.

    Example::

        >>> expand_braces("shards/train-{000..002}.tar")
        ['shards/train-000.tar', 'shards/train-001.tar', 'shards/train-002.tar']
    """
    match = _BRACES.search(pattern)
    if match is None:
        return [pattern]
    body, head, tail = match.group(1), pattern[: match.start()], pattern[match.end() :]
    numbers = _RANGE_ITEM.match(body)
    if numbers is not None:
        lo, hi = int(numbers.group(1)), int(numbers.group(2))
        width = max(len(numbers.group(1)), len(numbers.group(2))) if body.startswith("0") else 0
        step = 1 if hi >= lo else -1
        items = [str(n).zfill(width) for n in range(lo, hi + step, step)]
    else:
        items = body.split(",")
    return [name for item in items for name in expand_braces(head + item + tail)]


def read_wids_index(
    location: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> tuple[list[str], list[int]]:
    """The shards and sample counts a wids dataset description lists (``{"wids_version": 1,
    "shardlist": [{"url": ..., "nsamples": ...}, ...]}``), each ``url`` relative to the file's folder
    unless it is absolute.

    Raises:
        ResumeError: the file is missing, not JSON, or a field is missing or of the wrong type.
    """
    where = index_location(location)
    try:
        if is_url(where):
            fs, path = Remote(storage_options).resolve(where)
            raw = fs.cat_file(path)
        else:
            with open(where, "rb") as file:
                raw = file.read()
        data = json.loads(raw)
    except FileNotFoundError as exc:
        raise ResumeError(f"wids index {where!r} is missing: {exc}") from exc
    except ValueError as exc:
        raise ResumeError(f"wids index {where!r} is not JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("wids_version") != 1:
        raise ResumeError(
            f'wids index {where!r} should be a JSON object with "wids_version": 1, but got '
            f"{brief(data.get('wids_version') if isinstance(data, dict) else data)}"
        )
    if data.get("datasets"):
        raise ResumeError(f'wids index {where!r} lists sub-datasets ("datasets"); list their shards in "shardlist"')
    shards = data.get("shardlist")
    if not isinstance(shards, list) or not shards:
        raise ResumeError(f'wids index {where!r}: "shardlist" should be a non-empty list, but got {brief(shards)}')
    urls, sizes = [], []
    for i, entry in enumerate(shards):
        url = entry.get("url") if isinstance(entry, dict) else None
        count = entry.get("nsamples") if isinstance(entry, dict) else None
        if not isinstance(url, str) or not url:
            raise ResumeError(f'wids index {where!r} shard {i}: "url" should be a path or URL, but got {brief(url)}')
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ResumeError(
                f'wids index {where!r} shard {i}: "nsamples" should be an integer >= 0, but got {brief(count)}'
            )
        urls.append(url if is_url(url) or os.path.isabs(url) else sibling(where, url))
        sizes.append(count)
    return urls, sizes


def webdataset_stream(
    shards: Sequence[Any] | str | os.PathLike[str],
    *,
    read_shard: WebDatasetReader | None = None,
    storage_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> ShardedIterable:
    """A :class:`~resumable_data.streams.ShardedIterable` over WebDataset tar shards.

    Args:
        shards: a list of paths or URLs; a glob (``"shards/*.tar"``); a WebDataset brace pattern
            (``"s3://bucket/train-{000000..000099}.tar"``, see :func:`expand_braces`); or a wids
            dataset description (a ``.json`` file: its ``shardlist`` gives the shards and their
            ``nsamples``, so no shard is opened here).
        read_shard: the reader (default: ``WebDatasetReader(storage_options=storage_options)``).
        storage_options: for reading a wids description or listing a glob at a URL; by default
            the reader's.
        **kwargs: the other arguments of ShardedIterable (``seed``, ``shuffle``, ...).

    Raises:
        ResumeError: a wids description is missing or malformed, or a shard cannot be counted.

    Example::

        stream = webdataset_stream("shards/train-{0000..0099}.tar", seed=0).shuffle_buffer(1000, seed=0)
    """
    reader = WebDatasetReader(storage_options=storage_options) if read_shard is None else read_shard
    options = reader.storage_options if storage_options is None else storage_options
    if isinstance(shards, os.PathLike):
        shards = os.fspath(shards)
    if isinstance(shards, str) and shards.endswith(".json"):
        urls, sizes = read_wids_index(shards, options)
        return ShardedIterable(urls, read_shard=reader, sizes=sizes, storage_options=options, **kwargs)
    if isinstance(shards, str) and _BRACES.search(shards):
        shards = expand_braces(shards)
    return ShardedIterable(shards, read_shard=reader, storage_options=options, **kwargs)
