"""Mosaic Streaming's ``index.json``: the shards of an MDS dataset, their sample counts, sizes, hashes,
compression and columns, read and checked field by field.

Mosaic's ``MDSWriter`` writes, next to ``shard.00000.mds`` ... (or ``shard.00000.mds.zstd`` when
compressed), an ``index.json`` of the form ``{"version": 2, "shards": [{"format": "mds",
"version": 2, "samples": N, "raw_data": {"basename", "bytes", "hashes"}, "zip_data": null or the
same for the compressed file, "compression": null or "zstd[:level]", "hashes": [...],
"column_names": [...], "column_encodings": [...], "column_sizes": [...]}, ...]}``. A multi-stream
root (``merge_index``) has one such index whose basenames name subfolders (``part0/shard.00000.mds``),
or no index of its own and one in each subfolder.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...core.state import brief
from ...errors import ResumeError

__all__ = ["INDEX", "MDSShard", "decompress", "decompressor", "hash_of", "index_files", "parse_index"]

INDEX = "index.json"
# Mosaic's compressions (the name before the ":level") and how to undo them here; brotli and
# snappy need packages of their own and are refused by name.
_DECOMPRESSORS: dict[str, Callable[[bytes, int], bytes]] = {
    "gz": lambda data, size: gzip.decompress(data),
    "bz2": lambda data, size: bz2.decompress(data),
}


@dataclass(frozen=True)
class MDSShard:
    """One shard as ``index.json`` describes it.

    Attributes:
        samples: the samples it holds.
        raw_basename, raw_bytes: the uncompressed file's name (relative to the index's folder) and size.
        zip_basename, zip_bytes: the compressed file's, or None without compression.
        compression: Mosaic's algorithm name (``"zstd"``, ``"zstd:7"``...), or None.
        hashes: ``{file name: {algorithm: hex digest}}`` of whichever files the index has hashes for.
        column_names, column_encodings, column_sizes: the columns, as the reader decodes them.
    """

    samples: int
    raw_basename: str
    raw_bytes: int
    zip_basename: str | None
    zip_bytes: int | None
    compression: str | None
    hashes: dict[str, dict[str, str]]
    column_names: tuple[str, ...]
    column_encodings: tuple[str, ...]
    column_sizes: tuple[int | None, ...]

    def expected_bytes(self, basename: str) -> int:
        """The size the index gives the file ``basename`` (the raw or the compressed one)."""
        return self.raw_bytes if basename == self.raw_basename or self.zip_bytes is None else self.zip_bytes


def _field(where: str, obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], expected: str) -> Any:
    if key not in obj:
        raise ResumeError(f"{where} has no {key!r}: expected {expected}")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ResumeError(f"{where}: {key!r} should be {expected}, but got {brief(value)}")
    return value


def _file_info(where: str, info: Any) -> tuple[str, int, dict[str, str]]:
    if not isinstance(info, Mapping):
        raise ResumeError(f"{where} should be an object with basename, bytes and hashes, but got {brief(info)}")
    basename = _field(where, info, "basename", str, "the file's name")
    size = _field(where, info, "bytes", int, "the file's size in bytes")
    hashes = info.get("hashes") or {}
    if size < 0 or not basename or not isinstance(hashes, Mapping):
        raise ResumeError(f"{where} should have a file name, a size >= 0 and a hashes object, but got {brief(info)}")
    return basename, size, {str(k): str(v) for k, v in hashes.items()}


def _shard(where: str, obj: Any) -> MDSShard:
    if not isinstance(obj, Mapping):
        raise ResumeError(f"{where} should be an object (one shard), but got {brief(obj)}")
    shard_format = _field(where, obj, "format", str, "'mds'")
    if shard_format != "mds":
        raise ResumeError(f"{where}: 'format' is {shard_format!r}; MDSReader reads Mosaic's 'mds' shards only")
    samples = _field(where, obj, "samples", int, "the shard's sample count (an integer >= 0)")
    if samples < 0:
        raise ResumeError(f"{where}: 'samples' should be an integer >= 0, but got {samples}")
    raw_basename, raw_bytes, raw_hashes = _file_info(f"{where}.raw_data", obj.get("raw_data"))
    compression = obj.get("compression")
    if compression is not None and not isinstance(compression, str):
        raise ResumeError(f"{where}: 'compression' should be null or a name like 'zstd', but got {brief(compression)}")
    zip_basename = zip_bytes = None
    hashes = {raw_basename: raw_hashes}
    if compression:
        zip_basename, zip_bytes, zip_hashes = _file_info(f"{where}.zip_data", obj.get("zip_data"))
        hashes[zip_basename] = zip_hashes
    names = _field(where, obj, "column_names", list, "the list of column names")
    encodings = _field(where, obj, "column_encodings", list, "the list of column encodings")
    sizes = _field(where, obj, "column_sizes", list, "the list of column sizes (null: variable)")
    if not (len(names) == len(encodings) == len(sizes)):
        raise ResumeError(
            f"{where}: column_names, column_encodings and column_sizes should have one entry per column, but "
            f"have {len(names)}, {len(encodings)} and {len(sizes)}"
        )
    if not all(isinstance(x, str) for x in names + encodings) or not all(
        x is None or (isinstance(x, int) and not isinstance(x, bool) and x >= 0) for x in sizes
    ):
        raise ResumeError(
            f"{where}: column names and encodings should be strings and sizes integers >= 0 or null, but got "
            f"{brief(names)}, {brief(encodings)}, {brief(sizes)}"
        )
    return MDSShard(
        samples,
        raw_basename,
        raw_bytes,
        zip_basename,
        zip_bytes,
        compression or None,
        hashes,
        tuple(names),
        tuple(encodings),
        tuple(sizes),
    )


def parse_index(text: bytes | str, where: str) -> list[MDSShard]:
    """The shards of an ``index.json``'s text, in its order; ``where`` names it in errors.

    Raises:
        ResumeError: not JSON, or a field missing or not what Mosaic writes (the message names it).
    """
    try:
        obj = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ResumeError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(obj, Mapping):
        raise ResumeError(f"{where} should be an object with 'version' and 'shards', but got {brief(obj)}")
    version = _field(where, obj, "version", int, "2 (Mosaic Streaming's index version)")
    if version != 2:
        raise ResumeError(f"{where}: 'version' is {version}; MDSReader reads Mosaic Streaming's version 2")
    shards = _field(where, obj, "shards", list, "the list of shards")
    return [_shard(f"{where} shards[{i}]", shard) for i, shard in enumerate(shards)]


def decompressor(name: str, compression: str) -> Callable[[bytes, int], bytes]:
    """What undoes Mosaic's ``compression`` (``"zstd"``, ``"zstd:7"``, ``"gz"``...): a function of the
    compressed data and the raw size.

    Raises:
        ImportError: zstd without the ``zstandard`` package.
        ResumeError: an algorithm this module does not undo (brotli, snappy).
    """
    algorithm = compression.split(":", 1)[0]
    if algorithm == "zstd":
        try:
            import zstandard
        except ImportError as exc:  # pragma: no cover - exercised only without the extra
            raise ImportError(
                f"MDS shard {name!r} is zstd-compressed: pip install 'resumable-data[formats]' (or zstandard)"
            ) from exc
        return lambda data, size: zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    if algorithm in _DECOMPRESSORS:
        return _DECOMPRESSORS[algorithm]
    raise ResumeError(
        f"MDS shard {name!r} is compressed with {compression!r}; MDSReader decompresses zstd, gz and bz2 "
        "(read the decompressed .mds files instead: Mosaic's local cache keeps them)"
    )


def decompress(name: str, compression: str, data: bytes, size: int) -> bytes:
    """The raw shard of ``size`` bytes from its compressed file's ``data`` (see :func:`decompressor`).

    Raises:
        ResumeError: data that does not decompress to ``size`` bytes (or see :func:`decompressor`).
    """
    undo = decompressor(name, compression)
    try:
        raw = undo(data, size)
    except Exception as exc:  # each library raises its own error type for corrupt data
        raise ResumeError(f"MDS shard {name!r} does not decompress ({compression}): {exc} (truncated?)") from exc
    if len(raw) != size:
        raise ResumeError(
            f"MDS shard {name!r} decompresses to {len(raw)} bytes but index.json says {size}: rewritten since?"
        )
    return raw


def hash_of(name: str, hashes: Mapping[str, str], read: Callable[[], bytes]) -> tuple[str, str, str] | None:
    """``(algorithm, expected, actual)`` for the first of the index's ``hashes`` this process can
    compute (hashlib's, and xxhash's when it is installed) over ``read()``; None without hashes.

    Raises:
        ResumeError: the index has hashes, but none of an algorithm available here.
    """
    for algorithm, expected in hashes.items():
        function = getattr(hashlib, algorithm, None) if algorithm in hashlib.algorithms_available else None
        if function is None and algorithm.startswith("xxh"):
            try:
                import xxhash

                function = getattr(xxhash, algorithm, None)
            except ImportError:
                function = None
        if function is not None:
            return algorithm, expected, function(read()).hexdigest()
    if hashes:
        raise ResumeError(
            f"MDS shard {name!r}: index.json gives only {sorted(hashes)} hashes, none of which this process "
            "computes (xxh* need the xxhash package); pass verify_hashes=False, or pip install xxhash"
        )
    return None


def index_files(location: str, glob: Callable[[str], list[str]], exists: Callable[[str], bool]) -> list[str]:
    """The ``index.json`` files of an MDS dataset at ``location``: its own, or, for a multi-stream
    root without one, those of the folders under it, in sorted order.

    Raises:
        ResumeError: no index at ``location`` nor under it.
    """
    sep = "/" if "://" in location else os.sep
    root = location.rstrip("/") + sep + INDEX
    if exists(root):
        return [root]
    nested = sorted(glob(location.rstrip("/") + sep + "**" + sep + INDEX))
    if not nested:
        raise ResumeError(
            f"no {INDEX} at {location!r} nor in the folders under it: expected the folder Mosaic's MDSWriter "
            "wrote (its out=), or a root whose subfolders are such folders"
        )
    return nested
