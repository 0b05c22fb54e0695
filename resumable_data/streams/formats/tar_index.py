"""The sample index of a WebDataset tar shard: where each sample's members are, built once from the
tar headers, so a restore seeks to sample ``i`` instead of reading the ``i`` samples before it.

A tar file is a sequence of members, each a 512-byte header followed by its data padded to 512
bytes; it has no table of contents. WebDataset groups consecutive members whose names share a key
(``images/0001.jpg`` and ``images/0001.cls`` are the fields ``jpg`` and ``cls`` of the sample
``images/0001``) into samples. :func:`scan` reads the headers only (a seek over each member's data)
and :func:`grouped` groups them as WebDataset's ``group_by_keys`` does, keeping per member
its data offset, size and field: reading a sample is then a few slices of the file, with no
header parsed again.

The header parser mirrors Python's ``tarfile`` (which WebDataset reads and writes with) for what a
WebDataset shard holds: POSIX (ustar/pax) and GNU headers, pax ``path``/``size`` records (Python
writes a pax header before every member whose mtime is a float, as ``webdataset.TarWriter``'s
are), GNU long names, and the ustar name prefix. It is stricter than ``tarfile`` about damage.
``tarfile`` (so WebDataset) ends the archive silently, with fewer samples, wherever a member's
header should start but the file has a bad header, a zero block followed by more data, a part of a
header, or nothing (a file cut on a block boundary, as a partial copy leaves it: it lacks only the
end-of-archive marker, which ``tarfile`` does not ask for); here each is an error naming the shard
and the offset. A member whose data runs past the end of the file is an error naming the member
(``tarfile``'s says "unexpected end of data", or "empty header" after a pax header). So a cut shard
reads whole (cut after the first block of its end-of-archive marker) or is refused, never read short. A
file whose tail was zero-filled at its full size (preallocated, then partly written) ends like a
whole one where a member ends: only a hash could tell. Compressed tars (``.tar.gz``...) and sparse
members are refused: neither has an O(1) seek.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import ResumeError

__all__ = ["Member", "Sample", "TarIndex", "grouped", "scan"]

BLOCK = 512
# Of a saved index (TarIndex.arrays); another version is rebuilt, not read. 2: version 1 indexes
# were built by a scan that read a tar cut at a member's header short, so they are not trusted.
INDEX_VERSION = 2
_ZERO = bytes(BLOCK)
_END_CHUNK = 1 << 20  # bytes after the end-of-archive marker checked at a time (all zeros in a whole tar)
_REGULAR = (b"0", b"\0", b"7")  # tarfile's regular types, but the sparse one (refused)
_DIRECTORY, _SPARSE = b"5", b"S"
_GNU = (b"L", b"K", b"S")  # headers whose ustar prefix field holds other data
_PAX, _SOLARIS_PAX, _GLOBAL_PAX, _LONG_NAME, _LONG_LINK = b"x", b"X", b"g", b"L", b"K"
_EXTENDED = (_PAX, _SOLARIS_PAX, _GLOBAL_PAX, _LONG_NAME, _LONG_LINK)  # headers describing the next one
# Members whose data tarfile skips: regular files and types it does not know; the others (links,
# directories, devices) have none, whatever their size field says.
_KNOWN = (*_REGULAR, _SPARSE, b"1", b"2", b"3", b"4", b"5", b"6")
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")
_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}
# WebDataset's grouping (webdataset.tariterators): a key is the name up to the first dot of its last
# part, the field what follows (lower-cased); names of the form __x__ are metadata, skipped.
_KEY_AND_FIELD = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")

Sample = tuple[str, list[tuple[int, int, str]]]  # a sample's key, and its members' data offset, size and field


@dataclass(frozen=True)
class Member:
    """One member of a tar file as its headers describe it."""

    header: int  # offset of its first header (a pax or long-name header before it counts)
    name: str
    regular: bool
    data: int  # offset of its data
    size: int


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _text(field: bytes) -> str:
    """A NUL-terminated header field, decoded as tarfile decodes names (UTF-8, surrogateescape)."""
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _number(field: bytes) -> int:
    """A numeric header field: octal digits, or GNU's base-256 for large values (as tarfile's ``nti``)."""
    if field[:1] in (b"\x80", b"\xff"):
        value = int.from_bytes(field[1:], "big")
        return value - 256 ** (len(field) - 1) if field[:1] == b"\xff" else value
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _signed_checksum(block: bytes) -> int:
    """The header checksum with bytes read as signed, which some old tars wrote (tarfile accepts both)."""
    rest = block[:148] + block[156:]
    return 256 + sum(rest) - 256 * sum(1 for byte in rest if byte > 127)


def _header(block: bytes, shard: str, at: int) -> tuple[bytes, str, int]:
    """The type, name and size a 512-byte header holds; a ResumeError when it is not a tar header."""
    try:
        checksum, size = _number(block[148:156]), _number(block[124:136])
    except ValueError:
        checksum, size = -1, 0
    if checksum != sum(block) - sum(block[148:156]) + 256 and checksum != _signed_checksum(block):
        if at == 0:
            compression = next((name for magic, name in _COMPRESSED.items() if block.startswith(magic)), None)
            if compression is not None:
                raise ResumeError(
                    f"tar shard {shard!r} is {compression}-compressed: a compressed tar cannot be read from a sample "
                    "without decompressing everything before it, so it has no O(1) seek; decompress it first"
                )
            raise ResumeError(f"tar shard {shard!r} is not a tar file: its first 512 bytes are not a tar header")
        raise ResumeError(
            f"tar shard {shard!r} is damaged: the bytes at offset {at} should be a tar header (bad checksum); "
            "the file was cut or overwritten"
        )
    kind, name = block[156:157], _text(block[0:100])
    if kind == b"\0" and name.endswith("/"):  # a directory in the old V7 format
        kind = _DIRECTORY
    if kind == _DIRECTORY:
        name = name.rstrip("/")
    prefix = _text(block[345:500])
    if prefix and kind not in _GNU:
        name = prefix + "/" + name
    return kind, name, size


def _pax(data: bytes, shard: str, at: int) -> dict[str, str]:
    """The records of a pax extended header (``"%d %s=%s\\n"``, the length counting the whole record)."""
    records: dict[str, str] = {}
    position = 0
    while match := _PAX_RECORD.match(data, position):
        length = int(match.group(1))
        if length == 0:
            raise ResumeError(f"tar shard {shard!r} is damaged: the pax header at offset {at} has a 0-length record")
        value = data[match.end(2) + 1 : match.start(1) + length - 1]
        records[match.group(2).decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        position += length
    return records


def scan(read: Callable[[int, int], bytes], size: int, shard: str) -> Iterator[Member]:
    """The members of the tar file of ``size`` bytes that ``read(offset, n)`` reads, in order, from
    their headers alone (no member's data is read).

    Raises:
        ResumeError: the file is not a tar file (compressed, or another format), is damaged (a bad
            header, a zero block followed by more data) or cut (data past its end, no end-of-archive
            marker), or holds a sparse member.
    """
    position, global_pax, last = 0, {}, None
    if size == 0:
        raise ResumeError(f"tar shard {shard!r} is empty (0 bytes): not a tar file")
    while position < size:
        start, overrides = position, []
        block = read(position, BLOCK)
        if block == _ZERO:
            _check_end(read, size, shard, position)
            return
        if len(block) < BLOCK:
            where = "its end-of-archive marker" if block == _ZERO[: len(block)] else "the header"
            raise ResumeError(f"tar shard {shard!r} is cut: it ends inside {where} at offset {position}")
        kind, name, length = _header(block, shard, position)
        while kind in _EXTENDED:  # a header that describes the next one
            if position + BLOCK + length > size:
                break  # reported below, as data past the end
            body = read(position + BLOCK, length)
            if kind == _GLOBAL_PAX:
                global_pax.update(_pax(body, shard, position))
            elif kind in (_PAX, _SOLARIS_PAX):
                overrides.append({**global_pax, **_pax(body, shard, position)})
            elif kind == _LONG_NAME:
                overrides.append({"path": _text(body)})
            position += BLOCK + _padded(length)
            block = read(position, BLOCK)
            if len(block) < BLOCK or block == _ZERO:
                raise ResumeError(
                    f"tar shard {shard!r} is damaged: the extended header at offset {start} describes no member"
                )
            kind, name, length = _header(block, shard, position)
        # tarfile patches a member with the extended headers before it, the outermost last (it wins)
        for override in reversed(overrides):
            name = override.get("path", name)
            if "size" in override:
                if not override["size"].isdigit():
                    raise ResumeError(
                        f"tar shard {shard!r} is damaged: the pax size of member {name!r} is {override['size']!r}"
                    )
                length = int(override["size"])
        if kind == _SPARSE or any(key.startswith("GNU.sparse.") for override in overrides for key in override):
            raise ResumeError(
                f"tar shard {shard!r}: member {name!r} is a sparse file, which WebDataset shards never hold"
            )
        offset = position + BLOCK
        regular = kind in _REGULAR
        if regular or kind not in _KNOWN:
            if offset + length > size:
                raise ResumeError(
                    f"tar shard {shard!r} is cut: member {name!r} needs bytes up to offset {offset + length}, "
                    f"the file holds {size}"
                )
            position = offset + _padded(length)
        else:
            position, length = offset, 0
        last = name
        yield Member(start, name, regular, offset, length)
    # A file cut where a member's header would start (a block boundary: what a partial copy leaves)
    # is whole up to there; only the missing end marker tells that the archive went on.
    raise ResumeError(
        f"tar shard {shard!r} is cut: it ends at offset {size}, after member {last!r}, without the end-of-archive "
        "marker (a zero block) that ends a whole tar; the rest of the archive is missing: copy the shard again "
        "(or write it again, if its writer was stopped before closing it)"
    )


def _check_end(read: Callable[[int, int], bytes], size: int, shard: str, at: int) -> None:
    """That the bytes after the zero block at ``at`` are zeros too: the end-of-archive marker and its
    padding (tarfile pads to 10 KiB). Anything else means a header zeroed where it stood, or another
    archive after this one (``cat a.tar b.tar``): tarfile, so WebDataset, stops at the zero block."""
    position = at + BLOCK
    while position < size:
        chunk = read(position, min(_END_CHUNK, size - position))
        if chunk.count(0) != len(chunk):
            found = position + len(chunk) - len(chunk.lstrip(b"\0"))
            raise ResumeError(
                f"tar shard {shard!r} is damaged: a zero block at offset {at} ends the archive, but non-zero bytes "
                f"follow at offset {found}: a header overwritten with zeros, or tars were concatenated (tar and "
                "WebDataset read only the first); write the shard again as one archive"
            )
        position += len(chunk)


def sample_key(name: str) -> tuple[str, str] | None:
    """``(key, field)`` of a member name as WebDataset groups it, or None for a member it skips
    (metadata ``__x__`` names, names without an extension)."""
    if ("/" not in name and name.startswith("__") and name.endswith("__")) or _META.match(name):
        return None
    match = _KEY_AND_FIELD.match(name)
    return None if match is None else (match.group(1), match.group(2).lower())


def grouped(members: Iterable[Member], shard: str) -> Iterator[Sample]:
    """The samples of ``members`` as WebDataset's ``group_by_keys`` makes them: consecutive regular
    members with the same key form a sample; a sample whose ``__bad__`` field is not empty is
    dropped, as WebDataset drops it. Each sample comes when the next one starts (or at the end).

    Raises:
        ResumeError: a sample has two members of one field (WebDataset raises there too), or
            :func:`scan`'s errors.
    """
    key, bad = "", False
    rows: list[tuple[int, int, str]] = []
    seen: set[str] = set()
    for member in members:
        split = sample_key(member.name) if member.regular else None
        if split is None:
            continue
        if split[0] != key or not rows:
            if rows and not bad:
                yield key, rows
            key, rows, bad = split[0], [], False
            seen = {"__key__", "__url__", "__local_path__"}
        field = split[1]
        if field in seen:
            raise ResumeError(
                f"tar shard {shard!r}: sample {key!r} has two members of field {field!r} (at offset "
                f"{member.header}); WebDataset refuses such a shard too"
            )
        seen.add(field)
        bad = bad or (field == "__bad__" and member.size > 0)
        rows.append((member.data, member.size, field))
    if rows and not bad:
        yield key, rows


@dataclass(frozen=True)
class TarIndex:
    """Where the samples of one tar shard are: per sample its key and members, per member its data
    offset, size and field.

    Args:
        keys: each sample's ``__key__``.
        first: int64 array of ``len(keys) + 1`` rows: sample ``i``'s members are rows
            ``first[i]:first[i + 1]`` of ``members``.
        members: int64 array of shape ``(m, 3)``: data offset, size and field number of each member.
        fields: the field names the field numbers stand for (extensions: ``"jpg"``, ``"seg.png"``).
    """

    keys: tuple[str, ...]
    first: np.ndarray
    members: np.ndarray
    fields: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def build(cls, samples: Iterable[Sample]) -> TarIndex:
        """The index of ``samples`` (:func:`grouped`), in order."""
        keys: list[str] = []
        first: list[int] = []
        rows: list[tuple[int, int, int]] = []
        fields: dict[str, int] = {}
        for key, members in samples:
            keys.append(key)
            first.append(len(rows))
            rows += [(offset, size, fields.setdefault(field, len(fields))) for offset, size, field in members]
        first.append(len(rows))
        table = np.array(rows, dtype=np.int64).reshape(len(rows), 3)
        return cls(tuple(keys), np.array(first, dtype=np.int64), table, tuple(fields))

    def samples(self, start: int, stop: int) -> list[Sample]:
        """``(key, [(data offset, size, field), ...])`` of samples ``start`` to ``stop``."""
        fields = self.fields
        rows = [
            (offset, size, fields[field])
            for offset, size, field in self.members[self.first[start] : self.first[stop]].tolist()
        ]
        bounds = (self.first[start : stop + 1] - self.first[start]).tolist()
        return [(self.keys[start + i], rows[bounds[i] : bounds[i + 1]]) for i in range(stop - start)]

    def arrays(self) -> dict[str, np.ndarray]:
        """The index as plain arrays (``np.savez`` writes them, ``np.load`` reads them without pickle)."""
        keys = [key.encode("utf-8", "surrogateescape") for key in self.keys]
        fields = [field.encode("utf-8", "surrogateescape") for field in self.fields]
        return {
            "version": np.array(INDEX_VERSION),
            "first": self.first,
            "members": self.members,
            "keys": np.frombuffer(b"".join(keys), dtype=np.uint8),
            "key_ends": np.cumsum([len(key) for key in keys], dtype=np.int64),
            "fields": np.frombuffer(b"".join(fields), dtype=np.uint8),
            "field_ends": np.cumsum([len(field) for field in fields], dtype=np.int64),
        }

    @classmethod
    def from_arrays(cls, arrays: Any) -> TarIndex | None:
        """The index :meth:`arrays` gave, or None when they are of another version."""
        if int(arrays["version"]) != INDEX_VERSION:
            return None
        return cls(
            _strings(arrays["keys"], arrays["key_ends"]),
            np.asarray(arrays["first"], dtype=np.int64),
            np.asarray(arrays["members"], dtype=np.int64).reshape(-1, 3),
            _strings(arrays["fields"], arrays["field_ends"]),
        )


def _strings(blob: np.ndarray, ends: np.ndarray) -> tuple[str, ...]:
    data = blob.tobytes()
    return tuple(data[a:b].decode("utf-8", "surrogateescape") for a, b in itertools.pairwise([0, *ends.tolist()]))
