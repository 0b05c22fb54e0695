"""litdata's ``index.json``: the chunks ``litdata.optimize`` wrote, their sizes, and how their items are laid out.

``optimize(output_dir=...)`` writes ``chunk-<rank>-<n>.bin`` files (``.zstd.bin`` when compressed
whole) and one ``index.json``::

    {"chunks": [{"filename": "chunk-0-0.bin", "chunk_size": 7, "chunk_bytes": 584, "dim": null}, ...],
     "config": {"item_loader": "PyTreeLoader", "data_format": ["int", "str", ...],
                "data_spec": "<the items' pytree, as litdata's treespec_dumps writes it>",
                "compression": null | "zstd" | "zstd:N", "compression_level": null | "chunk" | "batch" | "sample",
                "encryption": null, ...}}

``chunk_size`` is the chunk's item count, ``chunk_bytes`` its size on disk, ``dim`` (``TokensLoader``)
its token count. This module reads and checks that file; the chunks are read by
:class:`~resumable_data.streams.formats.LitdataReader`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...core.state import brief
from ...errors import ResumeError
from ...storage.files import Remote, is_url

__all__ = ["INDEX_FILE", "LitdataChunk", "LitdataIndex"]

INDEX_FILE = "index.json"
PYTREE, TOKENS = "PyTreeLoader", "TokensLoader"  # the item loaders whose chunks are read here
_LEVELS = ("chunk", "batch", "sample")  # litdata's compression_level: whole file, frames of items, each item


@dataclass(frozen=True)
class LitdataChunk:
    """One chunk as ``index.json`` lists it.

    Attributes:
        filename: the chunk's file name in the dataset's folder.
        items: items written in it (``chunk_size``).
        nbytes: its size in bytes as written (``chunk_bytes``): a file of another size was truncated
            or rewritten since.
        dim: tokens in it (``TokensLoader`` chunks), else None.
    """

    filename: str
    items: int
    nbytes: int
    dim: int | None


@dataclass(frozen=True)
class LitdataIndex:
    """A litdata dataset's ``index.json``, checked (see the module docstring).

    Attributes:
        location: the dataset's folder (a path or a URL), where the chunks are.
        chunks: the chunks in the index's order (litdata's own order without shuffle).
        loader: ``"PyTreeLoader"`` (items) or ``"TokensLoader"`` (token chunks).
        data_format: the serializer of each leaf of an item, in the pytree's leaf order.
        data_spec: the items' pytree as litdata serialized it (None: an item is one leaf).
        compression: ``"zstd"`` (or ``"zstd:N"``) or None.
        level: where the compression applies: ``"chunk"`` (the whole file), ``"batch"`` (frames of
            items) or ``"sample"`` (each item).
    """

    location: str
    chunks: tuple[LitdataChunk, ...]
    loader: str
    data_format: tuple[str, ...]
    data_spec: str | None
    compression: str | None
    level: str

    @classmethod
    def load(cls, location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> LitdataIndex:
        """Read ``index.json`` of the dataset at ``location`` (its folder, or the file itself; a path
        or a URL, read through fsspec with ``storage_options``).

        Raises:
            ResumeError: the file is missing, not JSON, or not a litdata index this reader reads.
        """
        where = os.fspath(location)
        if where.rstrip("/").endswith(INDEX_FILE):
            where = where.rstrip("/")[: -len(INDEX_FILE)]
        where = where.rstrip("/") or "/"
        path = f"{where}/{INDEX_FILE}" if is_url(where) else os.path.join(where, INDEX_FILE)
        try:
            if is_url(path):
                with Remote(storage_options).open(path) as file:
                    raw = file.read()
            else:
                with open(path, "rb") as file:
                    raw = file.read()
        except FileNotFoundError as exc:
            raise ResumeError(
                f"litdata index {path!r} is missing: point at the folder litdata.optimize wrote (its output_dir)"
            ) from exc
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ResumeError(f"litdata index {path!r} is not JSON: {exc}") from exc
        return cls.parse(data, where, path)

    @classmethod
    def parse(cls, data: Any, location: str, name: str) -> LitdataIndex:
        """Check the loaded JSON of an index (``name`` in errors) of the dataset at ``location``.

        Raises:
            ResumeError: a field is missing or of the wrong type, or names what is not read here
                (encryption, another item loader or compression), with the field and what was expected.
        """
        where = f"litdata index {name!r}"
        if not isinstance(data, Mapping):
            raise ResumeError(f"{where} should be a JSON object with 'chunks' and 'config', but got {brief(data)}")
        config, chunks = data.get("config"), data.get("chunks")
        if not isinstance(config, Mapping):
            raise ResumeError(f"{where}: 'config' should be a JSON object, but got {brief(config)}")
        if not isinstance(chunks, list):
            raise ResumeError(f"{where}: 'chunks' should be a list of chunk entries, but got {brief(chunks)}")
        loader = config.get("item_loader", PYTREE)
        if loader not in (PYTREE, TOKENS):
            raise ResumeError(
                f"{where}: config.item_loader is {brief(loader)}; this reader reads chunks of {PYTREE!r} (items) "
                f"and {TOKENS!r} (tokens)"
            )
        data_format = config.get("data_format")
        if not isinstance(data_format, list) or not data_format or not all(isinstance(f, str) for f in data_format):
            raise ResumeError(
                f"{where}: config.data_format should be a non-empty list of serializer names, but got {brief(data_format)}"
            )
        spec = config.get("data_spec")
        if spec is not None and not isinstance(spec, str):
            raise ResumeError(
                f"{where}: config.data_spec should be a string (litdata's treespec) or null, got {brief(spec)}"
            )
        if config.get("encryption") is not None:
            raise ResumeError(f"{where}: the chunks are encrypted (config.encryption); this reader reads plain chunks")
        compression = config.get("compression")
        if compression is not None and not (isinstance(compression, str) and compression.split(":")[0] == "zstd"):
            raise ResumeError(
                f"{where}: config.compression should be null, 'zstd' or 'zstd:N', but got {brief(compression)}"
            )
        level = config.get("compression_level") or "chunk"
        if level not in _LEVELS:
            raise ResumeError(
                f"{where}: config.compression_level should be one of {_LEVELS} or null, got {brief(level)}"
            )
        if loader == TOKENS and (len(data_format) != 1 or data_format[0].split(":")[0] not in _TOKEN_FORMATS):
            raise ResumeError(
                f"{where}: a {TOKENS} index should have data_format ['no_header_tensor:K'] or ['no_header_numpy:K'], "
                f"but got {data_format}"
            )
        entries = tuple(_chunk(entry, f"{where}: chunks[{i}]", loader) for i, entry in enumerate(chunks))
        if len({entry.filename for entry in entries}) != len(entries):
            raise ResumeError(f"{where}: 'chunks' lists a file name twice")
        return cls(location, entries, loader, tuple(data_format), spec, compression, level)

    def chunk_location(self, chunk: LitdataChunk) -> str:
        """Where ``chunk`` is: a path in the dataset's folder, or a URL under it."""
        if is_url(self.location):
            return f"{self.location}/{chunk.filename}"
        return os.path.join(self.location, chunk.filename)


_TOKEN_FORMATS = ("no_header_tensor", "no_header_numpy")


def _chunk(entry: Any, where: str, loader: str) -> LitdataChunk:
    if not isinstance(entry, Mapping):
        raise ResumeError(f"{where} should be a JSON object, but got {brief(entry)}")
    filename = entry.get("filename")
    # A bare name in the dataset's folder: an index (from a bucket, say) never points elsewhere.
    if not isinstance(filename, str) or not filename or "/" in filename or "\\" in filename or filename in (".", ".."):
        raise ResumeError(f"{where}.filename should be a file name in the dataset's folder, but got {brief(filename)}")
    counts = {}
    for field in ("chunk_size", "chunk_bytes"):
        value = entry.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ResumeError(f"{where}.{field} should be an integer >= 0, but got {brief(value)}")
        counts[field] = value
    dim = entry.get("dim")
    if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool) or dim < 0):
        raise ResumeError(f"{where}.dim should be an integer >= 0 or null, but got {brief(dim)}")
    if loader == TOKENS and dim is None:
        raise ResumeError(f"{where}.dim should be the chunk's token count (a {TOKENS} index), but it is null")
    return LitdataChunk(filename, counts["chunk_size"], counts["chunk_bytes"], dim)
