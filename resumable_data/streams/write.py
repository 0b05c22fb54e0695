"""Write token shards once, where training reads them: ``.bin``/``.npy`` files and their index.

:func:`write_token_shards` concatenates the documents' tokens (each followed by ``eos``, when
given) into one stream and cuts it into shards of exactly ``shard_tokens`` tokens (the last one
shorter): a document may span two shards. That is the usual layout of LLM pretraining data, and
what :class:`TokenShardReader` reads: fixed windows over a shard's tokens, blind to documents (a
shard's tail shorter than a window is not read, so a ``shard_tokens`` that is a multiple of the
window loses nothing). Equal shards also give every worker and rank the same share.

Crash safety: each shard is written whole to a temporary name and renamed (fsynced, for a local
folder), and the index file (:mod:`.shard_index`) is written last, so a folder whose writing
stopped part way has no index and :meth:`ShardedIterable.from_index` refuses it; no file under a
shard's final name is ever partial. A URL goes through fsspec (the ``remote`` extra), each file in
its own transaction: an object store makes an object visible only when its upload completes.

The output is deterministic: the same documents and arguments give the same bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import posixpath
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint.durable import durable_file, fsync_dir, make_dirs
from ..core.state import brief, check_int_arg
from .shard_index import FORMATS, INDEX_NAME, ShardEntry, ShardIndex, is_url, url_fs

__all__ = ["jsonl_documents", "write_token_shards"]

SHARD_NAME = "shard-{index:05d}"  # the default name pattern of the shards, without the suffix


class _Folder:
    """Where the shards and the index go: a local folder (atomic renames, fsynced) or a URL (fsspec)."""

    def __init__(self, dest: str, storage_options: Mapping[str, Any] | None) -> None:
        self._fs: Any = None
        if is_url(dest):
            fs, path = url_fs(dest, storage_options)
            protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
            if "file" in protocols:  # a local folder after all: written as one, renamed and fsynced
                dest = path
            else:
                self.dest, self._fs, self._path = dest.rstrip("/") + "/", fs, path.rstrip("/")
                fs.makedirs(self._path, exist_ok=True)
        if self._fs is None:
            self.dest = dest
            make_dirs(Path(dest))
        self.index = self.location(INDEX_NAME)

    def location(self, name: str) -> str:
        """The path or URL of file ``name`` in the folder, as a user (and the index) names it."""
        return self.dest + name if self._fs is not None else os.path.join(self.dest, name)

    def _fs_path(self, name: str) -> str:
        return posixpath.join(self._path, name)

    def exists(self, name: str) -> bool:
        if self._fs is not None:
            return bool(self._fs.exists(self._fs_path(name)))
        return os.path.exists(self.location(name))

    def remove(self, name: str) -> None:
        if self._fs is not None:
            self._fs.rm_file(self._fs_path(name))
        else:
            os.remove(self.location(name))
            fsync_dir(Path(self.dest))

    def write(self, name: str, parts: Sequence[bytes]) -> None:
        """Write ``parts`` as the file ``name`` so that it is there whole or not at all."""
        if self._fs is not None:
            # Committed when the block ends without an error, discarded otherwise.
            with self._fs.transaction, self._fs.open(self._fs_path(name), "wb") as file:
                for part in parts:
                    file.write(part)
            return
        where = self.location(name)
        tmp = os.path.join(self.dest, f".{name}.tmp-{os.getpid()}")
        try:
            with durable_file(Path(tmp)) as file:
                for part in parts:
                    file.write(part)
            os.replace(tmp, where)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise

    def sync(self) -> None:
        """Make the renames so far durable (a local folder): the shards are on disk before the index."""
        if self._fs is None:
            fsync_dir(Path(self.dest))


def _tokens(document: Any, number: int, dtype: np.dtype, column: str | None) -> np.ndarray:
    """Document ``number`` as a 1-D array of ``dtype``; a value that does not fit is refused, named."""
    if column is not None:
        if not isinstance(document, Mapping) or column not in document:
            raise ValueError(
                f"document {number} should be a mapping with a {column!r} field, but got {brief(document)}"
            )
        document = document[column]
    array = np.asarray(document)
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise ValueError(
            f"document {number} should be a 1-D sequence of integer token ids, but got {array.dtype} values "
            f"of shape {array.shape}"
        )
    if array.size:
        _check_fits(int(array.min()), int(array.max()), f"document {number} holds token", dtype)
    return array.astype(dtype, copy=False)


def _check_fits(low: int, high: int, what: str, dtype: np.dtype) -> None:
    """Refuse values outside ``dtype``'s range, naming the first such one (``what`` the value)."""
    info = np.iinfo(dtype)
    if low < info.min or high > info.max:
        raise ValueError(
            f"{what} {low if low < info.min else high}, which does not fit dtype={dtype.name} "
            f"({info.min}..{info.max}); pass a wider dtype (e.g. dtype=np.uint32)"
        )


def _shard_parts(tokens: np.ndarray, fmt: str) -> list[bytes]:
    """A shard file's bytes: the raw tokens, after a ``.npy`` header for ``"npy"``."""
    data = np.ascontiguousarray(tokens).tobytes()  # one shard's copy: the writer holds one shard anyway
    if fmt == "bin":
        return [data]
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(tokens))
    return [header.getvalue(), data]


def write_token_shards(
    documents: Iterable[Any],
    dest: str | os.PathLike[str],
    *,
    shard_tokens: int | None = None,
    shard_bytes: int | None = None,
    dtype: Any = np.uint16,
    format: str = "bin",
    eos: int | None = None,
    column: str | None = None,
    name: str = SHARD_NAME,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Write documents' tokens as equal token shards in ``dest``, then their index file; return its location.

    The tokens of all documents, each followed by ``eos``, are cut into shards of ``shard_tokens``
    tokens (the last one shorter; see the module docstring for why documents span shards). One
    shard is held in memory at a time. Read them back with :meth:`ShardedIterable.from_index`,
    whose state is then a position per slot (a few hundred bytes at any number of shards).

    Args:
        documents: token arrays (lists, numpy arrays, CPU tensors of ints), or with ``column``,
            mappings holding them (a tokenized Hugging Face ``datasets.Dataset`` row,
            :func:`jsonl_documents` records).
        dest: a local folder (created if missing) or a URL (``s3://bucket/tokens``: through
            fsspec, the ``remote`` extra; a ``file://`` URL is written as the local folder it names).
        shard_tokens: tokens per shard; a multiple of the reader's window reads every token.
        shard_bytes: or the size of a shard file in bytes (a multiple of the dtype's size);
            give one of the two.
        dtype: the stored token type; a token that does not fit it is refused.
        format: ``"bin"`` (raw little-endian tokens, as nanoGPT writes) or ``"npy"``.
        eos: a token appended after each document (e.g. the tokenizer's end-of-text id).
        column: the field of each document that holds its tokens (e.g. ``"input_ids"``).
        name: the shard file name pattern, without suffix, formatted with ``index``.
        overwrite: replace the dataset in ``dest`` (its index is removed first); otherwise a
            ``dest`` that has an index is refused.
        storage_options: passed to fsspec for a URL (credentials, endpoint).

    Returns:
        The location of the index file written: a path (also for a ``file://`` URL) or a URL.

    Raises:
        ValueError: a bad argument, a document that is not a 1-D sequence of integers or holds a
            token that does not fit ``dtype`` (named, with the document's number), no tokens at
            all, or ``dest`` holding an index without ``overwrite``. Nothing is indexed then.
        ImportError: a URL without fsspec installed.

    Example::

        index = write_token_shards(
            (tokenizer(doc["text"])["input_ids"] for doc in docs), "tokens/", shard_tokens=2**24, eos=50256
        )
        stream = ShardedIterable.from_index(index, read_shard=TokenShardReader(1025), seed=0)
    """
    if format not in FORMATS:
        raise ValueError(f"format should be one of {FORMATS}, but got format={format!r}")
    token_type = np.dtype(dtype)
    if not np.issubdtype(token_type, np.integer):
        raise ValueError(f"dtype should be an integer type (e.g. np.uint16), but got dtype={token_type}")
    token_type = token_type.newbyteorder("<")  # the same bytes on every machine, as np.uint16 reads them
    if (shard_tokens is None) == (shard_bytes is None):
        raise ValueError("pass one of shard_tokens= (tokens per shard) and shard_bytes= (bytes per shard file)")
    if shard_bytes is not None:
        check_int_arg("shard_bytes", shard_bytes, minimum=token_type.itemsize)
        if shard_bytes % token_type.itemsize:
            raise ValueError(
                f"shard_bytes={shard_bytes} is not a multiple of {token_type.itemsize} ({token_type.name})"
            )
        shard_tokens = shard_bytes // token_type.itemsize
    size = check_int_arg("shard_tokens", shard_tokens, minimum=1)
    if eos is not None:
        _check_fits(check_int_arg("eos", eos, minimum=0), eos, "eos is", token_type)
    _check_name(name, format)
    folder = _Folder(os.fspath(dest), storage_options)
    if folder.exists(INDEX_NAME):
        if not overwrite:
            raise ValueError(f"{folder.index} exists: pass overwrite=True to replace that dataset, or another dest")
        folder.remove(INDEX_NAME)  # first: a dataset whose rewriting stops part way must not look whole

    entries: list[ShardEntry] = []

    def flush(tokens: np.ndarray) -> None:
        shard = f"{name.format(index=len(entries))}.{format}"
        parts = _shard_parts(tokens, format)
        folder.write(shard, parts)
        digest = _sha256(parts)
        entries.append(ShardEntry(shard, len(tokens), sum(len(p) for p in parts), digest))

    buffer = np.empty(size, dtype=token_type)
    filled = 0
    for number, document in enumerate(documents):
        pieces = [_tokens(document, number, token_type, column)]
        if eos is not None:
            pieces.append(np.array([eos], dtype=token_type))
        for piece in pieces:
            while len(piece):
                take = min(size - filled, len(piece))
                buffer[filled : filled + take] = piece[:take]
                filled, piece = filled + take, piece[take:]
                if filled == size:
                    flush(buffer)
                    filled = 0
    if filled:
        flush(buffer[:filled])
    if not entries:
        raise ValueError("the documents hold no tokens: nothing to write")
    folder.sync()
    index = ShardIndex(tuple(entries), token_type.name, format, eos, folder.index)
    folder.write(INDEX_NAME, [index.to_json()])
    folder.sync()
    return folder.index


def _check_name(pattern: str, fmt: str) -> None:
    """Refuse a shard name pattern that does not name each shard apart, as a plain file name."""
    try:
        first, second = pattern.format(index=0), pattern.format(index=1)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"name should be a pattern with an {{index}} field, like {SHARD_NAME!r}, but got {pattern!r}"
        ) from exc
    if first == second or "/" in first or "\\" in first or first.startswith(".") or f"{first}.{fmt}" == INDEX_NAME:
        raise ValueError(
            f"name should be a file name pattern with an {{index}} field, like {SHARD_NAME!r}, but got {pattern!r}"
        )


def _sha256(parts: Sequence[bytes]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def jsonl_documents(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    field: str,
    tokenize: Callable[[Any], Any] | None = None,
) -> Iterator[Any]:
    """The documents of JSONL files, in order: each line's ``field``, tokenized when ``tokenize`` is given.

    Args:
        paths: a JSONL file or several, read in the order given.
        field: the key of each line's object that holds the token ids (e.g. ``"input_ids"``), or the
            text that ``tokenize`` turns into them (e.g. ``"text"``).
        tokenize: e.g. ``lambda text: tokenizer(text)["input_ids"]``; None when ``field`` holds ids.

    Raises:
        ValueError: a line that is not a JSON object with ``field`` (named by file and line number).

    Example::

        write_token_shards(jsonl_documents("docs.jsonl", field="input_ids"), "tokens/", shard_tokens=2**24)
    """
    files = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    for path in files:
        with open(path, "rb") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{os.fspath(path)} line {number} is not JSON: {exc}") from exc
                if not isinstance(record, dict) or field not in record:
                    raise ValueError(f"{os.fspath(path)} line {number} should be a JSON object with a {field!r} field")
                yield record[field] if tokenize is None else tokenize(record[field])
