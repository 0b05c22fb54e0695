"""Shards addressed by URL: which names are URLs, listing a glob, sizes and identities, ranged reads.

A shard named ``scheme://...`` (``s3://``, ``gs://``, ``az://``, ``https://``, ``file://``) is read
through fsspec, the convention Hugging Face datasets, pyarrow and pandas share: s3fs for ``s3://``
(and S3-compatible servers via ``storage_options={"client_kwargs": {"endpoint_url": ...}}``),
gcsfs for ``gs://``, adlfs for ``az://``, aiohttp for ``http(s)://``. Credentials come the way
those libraries take them (environment, profiles, ``storage_options=``). Any other name is a local
path, and the readers keep their local code paths (memmap, ``open``) for it.

Retries are the client's own, configured here rather than repeated: for ``s3://`` botocore retries
throttling (503 SlowDown), 5xx and connection errors in its ``standard`` mode with exponential
backoff, and s3fs retries interrupted bodies and SlowDown a bounded number of times on top. The
connect and read timeouts bound each attempt, so a dead server is an error, never a hang. Once
the retries are spent a read raises :class:`StorageError` naming the URL, the time spent and the
cause; a missing object stays a :class:`FileNotFoundError` (the readers name the shard).
"""

from __future__ import annotations

import copy
import glob as local_glob
import hashlib
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, BinaryIO

__all__ = ["GLOB_CHARS", "S3_DEFAULTS", "Remote", "StorageError", "expand_shards", "in_listing", "is_url"]

GLOB_CHARS = "*?["
# botocore's client settings for s3:// unless storage_options' config_kwargs says otherwise: bounded
# attempts (standard mode: 503/5xx/throttling/connection errors, exponential backoff with jitter)
# and timeouts on each attempt, so that a fault ends in an error within about a minute.
S3_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 30,
    "retries": {"mode": "standard", "max_attempts": 4},
}
_EDGE = 4096  # bytes read at each end of an object without an ETag, for its identity
# Every filesystem this process resolved, kept alive for the life of the process. A DataLoader
# worker forked after the main process read by URL inherits fsspec's instances; fsspec starts a fresh
# cache in the child, and were an inherited s3fs instance then collected there, its session cleanup
# would close the parent's pooled connections through the event loop both share since the fork (the
# parent's next request then waits out the read timeout: tests/remote/test_remote_fork.py). Held
# here, they are never collected.
_RESOLVED: dict[int, Any] = {}
_IN_EXTRA = ("fsspec", "s3fs", "aiohttp")  # the clients the remote extra installs (gcsfs, adlfs are not)
_LISTED = ("s3", "s3a", "gs", "gcs", "az", "abfs")  # object stores whose listings give sizes and ETags
_DOWNLOAD_BLOCK = 16 << 20  # bytes a download asks for per request (and copies at a time)


class StorageError(OSError):
    """A remote shard could not be read once the storage client's retries were spent (or it refused
    the credentials): the message names the URL, the operation, the time spent and the cause."""


def is_url(shard: Any) -> bool:
    """Whether ``shard`` names a remote object (a string with a ``scheme://``), not a local path."""
    return isinstance(shard, str) and "://" in shard


def in_listing(url: str) -> bool:
    """Whether a listing of ``url``'s folder gives its size and ETag (an object store's URL without
    options of its own): :meth:`Remote.identities` asks such objects together."""
    return url.split("://", 1)[0] in _LISTED and "?" not in url


def _fsspec() -> Any:
    """Import fsspec on first use: the library reads local files without it."""
    try:
        import fsspec
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "reading shards by URL needs fsspec (and s3fs for s3://, gcsfs for gs://, adlfs for az://): "
            "pip install 'resumable-data[remote]'"
        ) from exc
    return fsspec


class Remote:
    """Reads objects by URL with ``storage_options`` (as fsspec takes them, e.g. ``{"anon": True}``
    or ``{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}``).

    Holds only the options: fsspec keeps (and, after a fork, renews) the filesystem instances, so a
    reader carrying one pickles to worker processes as plain data.
    """

    def __init__(self, storage_options: Mapping[str, Any] | None = None) -> None:
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
        self.storage_options = dict(storage_options or {})

    def resolve(self, url: str) -> tuple[Any, str]:
        """The fsspec filesystem for ``url`` and the path within it."""
        options = self.storage_options
        if url.split("://", 1)[0] in ("s3", "s3a"):
            # A copy: botocore rewrites the retries dict it is given (max_attempts to
            # total_max_attempts), and fsspec's instance for these options would then be another
            # one at the next call (another client to build: tens of ms of CPU on a restore's path).
            config = copy.deepcopy({**S3_DEFAULTS, **options.get("config_kwargs", {})})
            options = {**options, "config_kwargs": config}
        try:
            fs, path = _fsspec().core.url_to_fs(url, **options)
        except ImportError as exc:
            # fsspec raises its own ImportError from the client's ModuleNotFoundError, which names it
            missing = getattr(exc.__cause__, "name", None) or getattr(exc, "name", None)
            needs = f"it needs the package {missing!r}: " if missing else ""
            install = missing if missing and missing not in _IN_EXTRA else "'resumable-data[remote]'"
            raise ImportError(f"cannot read {url!r}: {needs}pip install {install} ({exc})") from exc
        _RESOLVED.setdefault(id(fs), fs)
        return fs, path

    @contextmanager
    def _failing(self, url: str, what: str) -> Iterator[None]:
        """Turn a failure of the storage client into a :class:`StorageError` naming ``url``.

        Every exception is the client's last word once its retries are spent (botocore and aiohttp
        raise types of their own, not only OSError); a missing object stays a FileNotFoundError.
        """
        started = time.monotonic()
        try:
            yield
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise StorageError(
                f"{what} {url!r} failed after {time.monotonic() - started:.1f} s: {type(exc).__name__}: {exc}"
            ) from exc

    def size_and_tag(self, url: str) -> tuple[int, str | None]:
        """The object's size in bytes and its version tag (its ETag, else an HTTP server's Last-Modified;
        None where it has neither), asked now."""
        fs, path = self.resolve(url)
        with self._failing(url, "reading the size of"):
            fs.invalidate_cache(path)  # a listing cached by a glob may predate a rewrite
            info = fs.info(path)
        return int(info["size"]), _version_tag(info)

    def identity(self, url: str) -> str:
        """``"size:tag"`` of the object (a rewrite changes its ETag, or an HTTP server's
        Last-Modified), or, where the server gives neither, ``"size:digest"`` of its first and last
        4 KiB as for a local file."""
        size, tag = self.size_and_tag(url)
        if tag is not None:
            return f"{size}:{tag}"
        starts = [0] if size <= _EDGE else [0, max(_EDGE, size - _EDGE)]
        edges = self.read_ranges(url, starts, [min(size, s + _EDGE) for s in starts])
        return f"{size}:{hashlib.blake2b(b''.join(edges), digest_size=8).hexdigest()}"

    def identities(self, urls: Sequence[str]) -> dict[str, str]:
        """:meth:`identity` of each URL. Where ``urls`` name several objects of one folder of an object
        store (S3, GCS, Azure: their listings carry sizes and ETags), they come from one listing of
        it (up to 1,000 objects a request) rather than a request each; any object the listing lacks,
        and any other URL, is asked on its own (a missing one is a FileNotFoundError)."""
        found: dict[str, str] = {}
        folders: dict[str, list[str]] = {}
        for url in urls:
            if in_listing(url):
                folders.setdefault(url.rsplit("/", 1)[0], []).append(url)
        for folder, members in folders.items():
            if len(members) < 2:
                continue
            fs, path = self.resolve(folder)
            with self._failing(folder, "listing"):
                fs.invalidate_cache(path)
                entries = {str(entry["name"]).rsplit("/", 1)[-1]: entry for entry in fs.ls(path, detail=True)}
            for url in members:
                entry = entries.get(url.rsplit("/", 1)[1], {})
                tag = _version_tag(entry) if entry.get("type") == "file" else None
                if tag is not None:
                    found[url] = f"{int(entry['size'])}:{tag}"
        return {url: found[url] if url in found else self.identity(url) for url in urls}

    def read_ranges(self, url: str, starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        """The bytes ``[start, end)`` of each range, requested concurrently; a short range (the object
        shrank) is a StorageError."""
        fs, path = self.resolve(url)
        with self._failing(url, "a ranged read of"):
            blocks = fs.cat_ranges([path] * len(starts), list(starts), list(ends), on_error="raise")
        for start, end, block in zip(starts, ends, blocks, strict=True):
            if len(block) != end - start:
                raise StorageError(
                    f"a ranged read of {url!r} returned {len(block)} bytes for [{start}, {end}): the object is "
                    "shorter than its size said (rewritten during the read?)"
                )
        return list(blocks)

    def download(self, url: str, dest: str) -> str:
        """Write the object at ``url`` to the local file ``dest`` and return its identity as
        :meth:`identity` gives it, taken from the download itself so that it names the bytes written.

        The ETag is the one the file was opened with (for ``s3://`` every ranged request of the
        download is conditional on it, so a rewrite during the download fails it); over
        ``http(s)://`` the tag read as the download starts; without a tag, the digest of the written
        file's edges. The default ``download`` of
        :class:`~resumable_data.storage.ShardCache` for the readers' ``cache_dir=``.
        """
        fs, path = self.resolve(url)
        with self._failing(url, "downloading"):
            fs.invalidate_cache(path)
            with fs.open(path, "rb", block_size=_DOWNLOAD_BLOCK, cache_type="none") as source:
                details = getattr(source, "details", None) or {}
                if _version_tag(details) is None:  # fsspec's HTTP file keeps only the size
                    details = fs.info(path)
                with open(dest, "wb") as out:
                    shutil.copyfileobj(source, out, _DOWNLOAD_BLOCK)
        size, tag = int(details["size"]), _version_tag(details)
        if tag is not None:
            return f"{size}:{tag}"
        with open(dest, "rb") as written:
            starts = [0] if size <= _EDGE else [0, max(_EDGE, size - _EDGE)]
            edges = []
            for start in starts:
                written.seek(start)
                edges.append(written.read(_EDGE))
        return f"{size}:{hashlib.blake2b(b''.join(edges), digest_size=8).hexdigest()}"

    def open(self, url: str, **kwargs: Any) -> BinaryIO:
        """A seekable binary file object on the object (reads by ranged requests, read-ahead cached)."""
        fs, path = self.resolve(url)
        with self._failing(url, "opening"):
            return fs.open(path, "rb", **kwargs)

    def glob(self, pattern: str) -> list[str]:
        """The URLs matching ``pattern``, sorted (the listing order of a store is not an order to rely
        on), in the pattern's scheme: ``az://`` names stay ``az://``, not adlfs's ``abfs://``."""
        fs, path = self.resolve(pattern)
        scheme = pattern.split("://", 1)[0]
        with self._failing(pattern, "listing"):
            urls = [fs.unstrip_protocol(p) for p in fs.glob(path)]
        return sorted(url if url.startswith(f"{scheme}://") else f"{scheme}://{url.split('://', 1)[1]}" for url in urls)


def _version_tag(info: Mapping[str, Any]) -> str | None:
    """The version tag in an fsspec ``info`` of an object, which a rewrite changes: its ETag (S3,
    GCS, Azure and most HTTP servers), else an HTTP server's ``Last-Modified`` (whole seconds: a
    rewrite within the second it was written is not seen), else None."""
    for field in ("ETag", "etag", "Last-Modified"):
        if info.get(field):
            return str(info[field]).strip('"')
    return None


def expand_shards(shards: Any, storage_options: Mapping[str, Any] | None = None) -> list[Any]:
    """The shard list ``ShardedIterable(shards)`` reads: one string with a glob character (``*?[``) is
    expanded (a local pattern by :mod:`glob`, a URL by its filesystem) in sorted order, any other
    string is one shard, and any other iterable is listed as it is.

    Raises:
        FileNotFoundError: the pattern matches nothing.
    """
    if isinstance(shards, os.PathLike):
        shards = os.fspath(shards)
    if not isinstance(shards, str):
        return list(shards)
    if not any(c in shards for c in GLOB_CHARS):
        return [shards]
    matched = Remote(storage_options).glob(shards) if is_url(shards) else sorted(local_glob.glob(shards))
    if not matched:
        listed = ""
        if shards.split("://", 1)[0] in ("http", "https"):
            listed = " (over http(s), a pattern is matched against the links of the folder's index page: list the URLs)"
        raise FileNotFoundError(f"the shard pattern {shards!r} matches no file{listed}")
    return matched
