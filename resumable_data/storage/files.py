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
connect and read timeouts bound each attempt, so a dead server is an error, never a hang. s3fs
also repeats a request whose attempts all timed out (5 times, a class setting with no option), so
each operation here (a HEAD, a listing, a batch of ranged reads, an index read) is bounded as a
whole by its *retry budget*, botocore's attempts x (connect + read timeout), through fsspec's
``timeout=`` of its blocking calls (:func:`retry_budget`): a stalled server (it accepts the connection
and never answers) fails within that budget. ``http(s)://`` has no retries; aiohttp's ``sock_connect``
and ``sock_read`` timeouts (10 s and 30 s unless ``client_kwargs["timeout"]`` says otherwise) bound
its one attempt. Once the retries are spent a read raises :class:`StorageError` naming the URL, the
time spent and the cause (refused credentials: that access was denied, and where credentials go); a
missing object stays a :class:`FileNotFoundError` (the readers name the shard).

Secrets. A URL may carry credentials (``https://user:password@host/...``, a signed query); every
message and repr made here shows it through :func:`redact`, and a client error whose text holds
them is not chained (its redacted text is in the message). The keys of ``storage_options`` are never
formatted into a message.
"""

from __future__ import annotations

import copy
import errno
import glob as local_glob
import hashlib
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, BinaryIO

__all__ = [
    "GLOB_CHARS",
    "HTTP_TIMEOUTS",
    "S3_DEFAULTS",
    "Remote",
    "StorageError",
    "expand_shards",
    "in_listing",
    "is_url",
    "redact",
    "retry_budget",
]

GLOB_CHARS = "*?["
# botocore's client settings for s3:// unless storage_options' config_kwargs says otherwise: bounded
# attempts (standard mode: 503/5xx/throttling/connection errors, exponential backoff with jitter)
# and timeouts on each attempt; botocore's max_attempts counts retries, so 5 attempts of at most
# 10 + 30 s: a retry budget of 200 s per operation (retry_budget).
S3_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 30,
    "retries": {"mode": "standard", "max_attempts": 4},
}
# aiohttp's timeouts (seconds) of an http(s):// request unless client_kwargs gives a "timeout": an idle
# socket, not the whole transfer (a large shard may take long), so a server that stops answering fails.
HTTP_TIMEOUTS = {"sock_connect": 10, "sock_read": 30}
_BOTOCORE_ATTEMPTS = {"standard": 3, "legacy": 5, "adaptive": 3}  # botocore's total attempts by mode
# A URL's credentials: the user-info before the host, and query values named like a secret (a
# presigned S3 URL's signature and credential, an Azure SAS's sig, a token).
_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#@\s'\"]+@")
_SECRET_QUERY = re.compile(
    r"([?&][^=&#\s'\"]*(?:signature|sig|token|secret|password|passwd|credential|key)[^=&#\s'\"]*=)[^&#\s'\"]+",
    re.IGNORECASE,
)
REDACTED = "<redacted>"
# Where each scheme's client takes credentials from, for the message refusing them.
_CREDENTIALS = {
    "s3": "storage_options (key= and secret=, or profile=) or the environment (AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)",
    "gs": "storage_options (token=: a service-account file or 'google_default') or the environment "
    "(GOOGLE_APPLICATION_CREDENTIALS)",
    "az": "storage_options (account_name= with account_key= or sas_token=, or connection_string=) or the "
    "environment (AZURE_STORAGE_CONNECTION_STRING)",
    "http": "storage_options (client_kwargs={'auth': aiohttp.BasicAuth(...)} or headers=) or the URL",
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
        elif url.split("://", 1)[0] in ("http", "https") and "timeout" not in options.get("client_kwargs", {}):
            options = {**options, "client_kwargs": {**options.get("client_kwargs", {}), "timeout": _http_timeout()}}
        try:
            fs, path = _fsspec().core.url_to_fs(url, **options)
        except ImportError as exc:
            # fsspec raises its own ImportError from the client's ModuleNotFoundError, which names it
            missing = getattr(exc.__cause__, "name", None) or getattr(exc, "name", None)
            needs = f"it needs the package {missing!r}: " if missing else ""
            install = missing if missing and missing not in _IN_EXTRA else "'resumable-data[remote]'"
            raise ImportError(f"cannot read {redact(url)!r}: {needs}pip install {install} ({exc})") from exc
        _RESOLVED.setdefault(id(fs), fs)
        return fs, path

    def budget(self, url: str) -> float | None:
        """:func:`retry_budget` of ``url`` with these options (None where it has none)."""
        return retry_budget(url, self.storage_options)

    def _call(self, fs: Any, url: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<method>(*args, **kwargs)``, bounded by the retry budget of ``url`` as a whole.

        fsspec's blocking calls of an async filesystem take ``timeout=`` (seconds; on expiry the
        request is cancelled and ``FSTimeoutError`` raised); a filesystem of another kind is called
        as it is.
        """
        budget = self.budget(url)
        if budget is not None and isinstance(fs, _fsspec().asyn.AsyncFileSystem):
            kwargs["timeout"] = budget
        return getattr(fs, method)(*args, **kwargs)

    @contextmanager
    def _failing(self, url: str, what: str) -> Iterator[None]:
        """Turn a failure of the storage client into a :class:`StorageError` naming ``url``.

        Every exception is the client's last word once its retries are spent (botocore and aiohttp
        raise types of their own, not only OSError); a missing object stays a FileNotFoundError.
        Refused credentials say so and where credentials go; a stall says which budget it spent.
        The URL is shown redacted, and a client error whose text holds a secret is not chained.
        """
        started = time.monotonic()
        try:
            yield
        except FileNotFoundError as exc:
            text = str(exc)
            if redact(text) == text:
                raise
            raise FileNotFoundError(errno.ENOENT, f"no such object: {redact(text)}") from None
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            cause = _denied(exc, url) or _stalled(exc, self.budget(url))
            message = f"{what} {redact(url)!r} failed after {time.monotonic() - started:.1f} s: {redact(text)}{cause}"
            if redact(text) != text:
                raise StorageError(message) from None
            raise StorageError(message) from exc

    def size_and_tag(self, url: str) -> tuple[int, str | None]:
        """The object's size in bytes and its version tag (its ETag, else an HTTP server's Last-Modified;
        None where it has neither), asked now."""
        fs, path = self.resolve(url)
        with self._failing(url, "reading the size of"):
            fs.invalidate_cache(path)  # a listing cached by a glob may predate a rewrite
            info = self._call(fs, url, "info", path)
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
                listed = self._call(fs, folder, "ls", path, detail=True)
                entries = {str(entry["name"]).rsplit("/", 1)[-1]: entry for entry in listed}
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
            blocks = self._call(fs, url, "cat_ranges", [path] * len(starts), list(starts), list(ends), on_error="raise")
        for start, end, block in zip(starts, ends, blocks, strict=True):
            if len(block) != end - start:
                raise StorageError(
                    f"a ranged read of {redact(url)!r} returned {len(block)} bytes for [{start}, {end}): the object is "
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

    def read(self, url: str) -> bytes:
        """The whole object at ``url`` (a small one: an index file), within its retry budget."""
        fs, path = self.resolve(url)
        with self._failing(url, "reading"):
            fs.invalidate_cache(path)
            return bytes(self._call(fs, url, "cat_file", path))

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
            urls = [fs.unstrip_protocol(p) for p in self._call(fs, pattern, "glob", path)]
        return sorted(url if url.startswith(f"{scheme}://") else f"{scheme}://{url.split('://', 1)[1]}" for url in urls)


def redact(text: object) -> str:
    """``str(text)`` with the credentials of every URL in it replaced by ``<redacted>``: the user-info
    (``https://user:password@host`` -> ``https://<redacted>@host``) and query values named like a
    secret (``X-Amz-Signature``, ``sig``, ``token``...)."""
    return _SECRET_QUERY.sub(rf"\1{REDACTED}", _USERINFO.sub(rf"\1{REDACTED}@", str(text)))


def retry_budget(url: str, storage_options: Mapping[str, Any] | None = None) -> float | None:
    """Seconds one operation on ``url`` may take, retries included: for ``s3://`` botocore's total
    attempts x (connect + read timeout) of the options over :data:`S3_DEFAULTS` (200 s by default);
    None for other schemes (their clients' timeouts bound each request; see the module docstring).

    botocore's ``max_attempts`` counts retries after the first attempt, ``total_max_attempts`` all
    of them; without either, its mode's default.
    """
    if url.split("://", 1)[0] not in ("s3", "s3a"):
        return None
    config = {**S3_DEFAULTS, **(storage_options or {}).get("config_kwargs", {})}
    retries = config.get("retries") or {}
    if "total_max_attempts" in retries:
        attempts = int(retries["total_max_attempts"])
    elif "max_attempts" in retries:
        attempts = int(retries["max_attempts"]) + 1
    else:
        attempts = _BOTOCORE_ATTEMPTS.get(str(retries.get("mode", "legacy")), 5)
    # botocore's own defaults where a timeout is left out (60 s each)
    per_attempt = float(config.get("connect_timeout", 60)) + float(config.get("read_timeout", 60))
    return max(1, attempts) * per_attempt


def _http_timeout() -> Any:
    import aiohttp  # the remote extra's; fsspec's HTTP filesystem needs it anyway

    return aiohttp.ClientTimeout(total=None, **HTTP_TIMEOUTS)


def _denied(exc: BaseException, url: str) -> str:
    """The clause saying that the server refused the credentials, when ``exc`` says it did (s3fs
    raises PermissionError for a 403; aiohttp a ClientResponseError with the status); else ""."""
    status = getattr(exc, "status", None)
    if not isinstance(exc, PermissionError) and status not in (401, 403):
        return ""
    code = ""
    response = getattr(exc.__cause__, "response", None)  # botocore's ClientError: the S3 error code
    if isinstance(response, Mapping):
        error, meta = response.get("Error") or {}, response.get("ResponseMetadata") or {}
        code = " ".join(str(part) for part in (meta.get("HTTPStatusCode"), error.get("Code")) if part)
    scheme = url.split("://", 1)[0]
    scheme = {"s3a": "s3", "gcs": "gs", "abfs": "az", "https": "http"}.get(scheme, scheme)
    where = _CREDENTIALS.get(scheme, "storage_options (as the scheme's fsspec filesystem takes them)")
    codes = " (S3 answers 403 InvalidAccessKeyId, SignatureDoesNotMatch or AccessDenied)" if scheme == "s3" else ""
    return (
        f"; access was denied (HTTP {code or status or 403}: the server refused these credentials{codes}): give "
        f"credentials it accepts in {where}"
    )


def _stalled(exc: BaseException, budget: float | None) -> str:
    """The clause saying which time limit a request that got no answer ran out of, when ``exc`` is
    fsspec's timeout."""
    if not isinstance(exc, _fsspec().exceptions.FSTimeoutError):
        return ""
    if budget is None:
        return (
            "no answer within the client's timeouts (for http(s):// aiohttp's sock_connect and sock_read, "
            f"{HTTP_TIMEOUTS} unless storage_options['client_kwargs']['timeout'] says otherwise)"
        )
    return (
        f"no answer within the retry budget of {budget:g} s (botocore's attempts x (connect_timeout + "
        "read_timeout), set in storage_options['config_kwargs']): the server took the connection and did not "
        "answer"
    )


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
        raise FileNotFoundError(f"the shard pattern {redact(shards)!r} matches no file{listed}")
    return matched
