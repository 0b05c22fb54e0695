"""The index file of a folder of token shards: what :func:`write_token_shards` writes last and
:meth:`ShardedIterable.from_index` reads instead of counting (or being told) each shard's size.

It is plain JSON, so any tool can write or read it::

    {
        "version": 1,
        "format": "bin",
        "dtype": "uint16",
        "eos": 50256,
        "tokens": 2500,
        "shards": [{"path": "shard-00000.bin", "tokens": 1024, "bytes": 2048, "sha256": "9f86d0..."}, ...],
    }

``shards`` lists the shards in order: ``path`` relative to the index's folder (so the folder can be
moved, or copied to a bucket, as a whole), the shard's ``tokens`` and file size in ``bytes``, and
the SHA-256 of the file (an identity a cache or a copy can be checked against). ``format`` is
``"bin"`` (raw little-endian tokens) or ``"npy"``; ``dtype`` is the numpy name of the token type;
``eos`` the token appended after each document (null for none). An index that is there was
written after every shard it lists: a folder whose writing stopped part way has none.

A URL (``s3://bucket/data/index.json``, ``file:///...``) is read and written through fsspec (the
``remote`` extra), which takes credentials as it always does (environment, profiles,
``storage_options``).
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.state import brief
from ..errors import ResumeError
from ..storage.files import Remote, StorageError, is_url, redact

__all__ = [
    "FORMATS",
    "INDEX_NAME",
    "INDEX_VERSION",
    "ShardEntry",
    "ShardIndex",
    "index_location",
    "is_url",
    "sibling",
    "url_fs",
]

INDEX_NAME = "index.json"
INDEX_VERSION = 1
FORMATS = ("bin", "npy")
# The keys of the index file, declared once.
VERSION = "version"
FORMAT = "format"
DTYPE = "dtype"
EOS = "eos"
TOKENS = "tokens"
SHARDS = "shards"
PATH = "path"
BYTES = "bytes"
SHA256 = "sha256"

_WHAT = "shard index"


def url_fs(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path in it, resolved as the readers resolve a URL
    (:class:`~resumable_data.storage.files.Remote`), or an ImportError naming the extra to install."""
    return Remote(storage_options).resolve(url)


def index_location(path: str | os.PathLike[str]) -> str:
    """The index file that ``path`` names: a local folder or a URL ending in ``/`` means its ``index.json``."""
    text = os.fspath(path)
    if is_url(text):
        return text + INDEX_NAME if text.endswith("/") else text
    return os.path.join(text, INDEX_NAME) if os.path.isdir(text) else text


def sibling(index: str, name: str) -> str:
    """The location of ``name`` (relative, with ``/``) in the folder of the index file ``index``."""
    if is_url(index):
        return posixpath.join(index.rsplit("/", 1)[0], name)
    return os.path.join(os.path.dirname(index), *name.split("/"))


def _int(data: Mapping[str, Any], key: str, where: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ResumeError(f"{_WHAT} {where}: {key!r} should be an integer >= 0, but got {brief(value)}")
    return value


@dataclass(frozen=True)
class ShardEntry:
    """One shard of a :class:`ShardIndex`: its path (relative to the index), tokens, bytes and SHA-256."""

    path: str
    tokens: int
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {PATH: self.path, TOKENS: self.tokens, BYTES: self.bytes, SHA256: self.sha256}


@dataclass(frozen=True)
class ShardIndex:
    """The parsed index file of a folder of token shards (see the module docstring for the format).

    Args:
        shards: the shards, in order.
        dtype: numpy name of the token type (``"uint16"``).
        format: ``"bin"`` or ``"npy"``.
        eos: the token appended after each document, or None.
        location: where the index was read from (a path or URL): shard paths are relative to its folder.

    Example::

        index = ShardIndex.load("tokens/")  # or "s3://bucket/tokens/index.json"
        index.tokens, len(index.shards)  # without opening a shard
        stream = ShardedIterable.from_index(index, read_shard=TokenShardReader(1025), seed=0)
    """

    shards: tuple[ShardEntry, ...]
    dtype: str
    format: str
    eos: int | None = None
    location: str = ""

    def __repr__(self) -> str:
        # the dataclass's repr but for the location's credentials
        return (
            f"ShardIndex(shards={self.shards!r}, dtype={self.dtype!r}, format={self.format!r}, "
            f"eos={self.eos!r}, location={redact(self.location)!r})"
        )

    @property
    def tokens(self) -> int:
        """Tokens in all the shards together."""
        return sum(entry.tokens for entry in self.shards)

    @property
    def locations(self) -> list[str]:
        """Each shard's path or URL: its ``path`` in the folder the index was read from."""
        return [sibling(self.location, entry.path) for entry in self.shards]

    def records(self, reader: Any) -> list[int]:
        """The record count of each shard for ``reader``: its windows, from the index's token counts.

        Raises:
            ResumeError: the reader does not count windows of tokens (``count_windows``), or reads
                raw ``.bin`` shards with another dtype than the index's.
        """
        count = getattr(reader, "count_windows", None)
        if count is None:
            raise ResumeError(
                f"an index of token shards gives token counts, which need a reader that counts windows of "
                f"tokens (TokenShardReader), but got {type(reader).__name__}"
            )
        if self.format == "bin" and np.dtype(reader.dtype) != np.dtype(self.dtype):
            raise ResumeError(
                f"{_WHAT} {redact(self.location)!r} says the .bin shards hold {self.dtype} tokens, but the reader reads "
                f"{np.dtype(reader.dtype)}: build it as TokenShardReader(window, dtype={self.dtype!r})"
            )
        return [count(entry.tokens) for entry in self.shards]

    def to_dict(self) -> dict[str, Any]:
        """The index file's content (``location`` is where it is, not part of it)."""
        return {
            VERSION: INDEX_VERSION,
            FORMAT: self.format,
            DTYPE: self.dtype,
            EOS: self.eos,
            TOKENS: self.tokens,
            SHARDS: [entry.to_dict() for entry in self.shards],
        }

    def to_json(self) -> bytes:
        """The index file's bytes: the same index always gives the same bytes."""
        return (json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def parse(cls, data: Any, location: str = "") -> ShardIndex:
        """The index that the index file's JSON ``data`` holds, read from ``location``.

        Raises:
            ResumeError: a key is missing or wrong (named with what was expected), or another version.
        """
        where = repr(redact(location))
        if not isinstance(data, Mapping):
            raise ResumeError(f"{_WHAT} {where} should hold a JSON object, but holds {brief(data)}")
        if data.get(VERSION) != INDEX_VERSION:
            raise ResumeError(
                f"{_WHAT} {where} has version {brief(data.get(VERSION))}, this release reads version {INDEX_VERSION}"
            )
        if data.get(FORMAT) not in FORMATS:
            raise ResumeError(
                f"{_WHAT} {where}: {FORMAT!r} should be one of {FORMATS}, but got {brief(data.get(FORMAT))}"
            )
        dtype = data.get(DTYPE)
        try:
            integer = isinstance(dtype, str) and np.issubdtype(np.dtype(dtype), np.integer)
        except TypeError:
            integer = False
        if not integer:
            raise ResumeError(f"{_WHAT} {where}: {DTYPE!r} should name a numpy integer type, but got {brief(dtype)}")
        eos = data.get(EOS)
        if eos is not None:
            eos = _int(data, EOS, where)
        shards = data.get(SHARDS)
        if not isinstance(shards, Sequence) or isinstance(shards, str) or not shards:
            raise ResumeError(f"{_WHAT} {where}: {SHARDS!r} should be a non-empty list, but got {brief(shards)}")
        entries = tuple(_entry(shard, f"{where} shard {i}") for i, shard in enumerate(shards))
        index = cls(entries, np.dtype(dtype).name, data[FORMAT], eos, location)
        if data.get(TOKENS) != index.tokens:
            raise ResumeError(
                f"{_WHAT} {where}: {TOKENS!r} is {brief(data.get(TOKENS))}, but its shards hold {index.tokens}"
            )
        return index

    @classmethod
    def load(
        cls, path: str | os.PathLike[str] | ShardIndex, *, storage_options: Mapping[str, Any] | None = None
    ) -> ShardIndex:
        """Read an index file: a local path (a folder means its ``index.json``) or a URL through fsspec.

        Args:
            path: the index file, its folder, or a URL (a URL ending in ``/`` means its ``index.json``);
                a ShardIndex is returned as it is.
            storage_options: passed to ``fsspec.open`` for a URL (credentials, endpoint).

        Raises:
            ResumeError: the file is missing, cannot be read (refused credentials, no answer within the
                retry budget: the message says which), is not JSON, or is not an index (see :meth:`parse`).
            ImportError: a URL without fsspec installed.
        """
        if isinstance(path, ShardIndex):
            return path
        location = index_location(path)
        shown = redact(location)  # a URL's credentials are never printed
        try:
            if is_url(location):
                raw = Remote(storage_options).read(location)
            else:
                with open(location, "rb") as file:
                    raw = file.read()
        except FileNotFoundError as exc:
            raise ResumeError(
                f"{_WHAT} {shown!r} is missing: write the shards with write_token_shards (it writes the index "
                f"last, so a folder whose writing stopped part way has none): {exc}"
            ) from exc
        except StorageError as exc:  # refused credentials, a server that does not answer...
            raise ResumeError(f"{_WHAT} {shown!r} cannot be read: {exc}") from exc
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ResumeError(f"{_WHAT} {shown!r} is not JSON: {exc}") from exc
        return cls.parse(data, location)


def _entry(shard: Any, where: str) -> ShardEntry:
    if not isinstance(shard, Mapping):
        raise ResumeError(f"{_WHAT} {where} should be a JSON object, but got {brief(shard)}")
    path, digest = shard.get(PATH), shard.get(SHA256)
    # A relative path inside the index's folder: an index (from a bucket, say) never points elsewhere.
    if (
        not isinstance(path, str)
        or not path
        or path.startswith("/")
        or "\\" in path
        or is_url(path)
        or ".." in path.split("/")
    ):
        raise ResumeError(
            f"{_WHAT} {where}: {PATH!r} should be a path relative to the index's folder, but got {brief(path)}"
        )
    if not isinstance(digest, str):
        raise ResumeError(f"{_WHAT} {where}: {SHA256!r} should be a hex digest string, but got {brief(digest)}")
    return ShardEntry(path, _int(shard, TOKENS, where), _int(shard, BYTES, where), digest)
