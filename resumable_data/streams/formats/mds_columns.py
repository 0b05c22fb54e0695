"""The column encodings of Mosaic Streaming's MDS shards, decoded as Mosaic's own reader decodes them.

A sample of an MDS shard is its columns' encoded values one after another (columns in the sorted
order the writer keeps), preceded by the byte length of each column whose encoding has no fixed
size, as little-endian uint32. Each encoding turns its bytes into the value Mosaic's
``mds_decode`` returns: a Python ``int`` for ``int``, a NumPy scalar for ``uint8`` ... ``float64``,
``str``, ``bytes``, a read-only NumPy array for ``ndarray`` (its dtype and shape either in the
encoding, ``ndarray:int32:2,3``, or before the values), the JSON value for ``json``.

Two kinds of column are never decoded silently: ``pkl`` (unpickling runs whatever code the file
names, so it takes ``allow_pickle=True``, as ``torch.load`` takes ``weights_only=False``) and the
encodings that need an image library (``jpeg``, ``png``, ``pil``, their lists), which take a
``decode=`` function of the bytes.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from typing import Any

import numpy as np

from ...errors import ResumeError

__all__ = ["PICKLE", "SampleLengthError", "sample_decoder"]

PICKLE = "pkl"
# The dtype codes of an ndarray column without a dtype in its encoding (Mosaic's NDArray).
_VALUE_DTYPES = {
    8: "uint8",
    9: "int8",
    16: "uint16",
    17: "int16",
    18: "float16",
    32: "uint32",
    33: "int32",
    34: "float32",
    64: "uint64",
    65: "int64",
    66: "float64",
}
_SHAPE_DTYPES = ("uint8", "uint16", "uint32", "uint64")  # by the low 2 bits of the shape byte
_SCALARS = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16", "float32", "float64")


def _scalar(dtype: str) -> Callable[[bytes], Any]:
    kind = np.dtype(dtype)
    return lambda data: np.frombuffer(data, kind)[0]


def _ndarray(config: str) -> Callable[[bytes], Any]:
    """Mosaic's ``ndarray[:dtype[:d0,d1,...]]``: what the encoding leaves out precedes the values."""
    parts = config.split(":") if config else []
    if len(parts) > 2 or (parts and parts[0] not in _VALUE_DTYPES.values()):
        raise ValueError(f"expected ndarray, ndarray:DTYPE or ndarray:DTYPE:D0,D1,... with DTYPE one of {_SCALARS}")
    dtype = parts[0] if parts else None
    shape = tuple(int(d) for d in parts[1].split(",")) if len(parts) == 2 else None

    def decode(data: bytes) -> np.ndarray:
        index, kind = 0, dtype
        dims: Any = shape
        if kind is None:
            kind, index = _VALUE_DTYPES[data[0]], 1
        if dims is None:
            ndim, width = data[index] >> 2, data[index] & 3
            length = ndim << width  # ndim dimensions of 2**width bytes each
            dims = np.frombuffer(data[index + 1 : index + 1 + length], _SHAPE_DTYPES[width])
            index += 1 + length
        return np.frombuffer(data[index:], kind).reshape(dims)

    return decode


_DECODERS: dict[str, Callable[[bytes], Any]] = {
    "bytes": bytes,
    "str": lambda data: data.decode("utf-8"),
    "int": lambda data: int.from_bytes(data, "little", signed=True),
    "str_int": lambda data: int(data.decode("utf-8")),
    "str_float": lambda data: float(data.decode("utf-8")),
    "str_decimal": lambda data: Decimal(data.decode("utf-8")),
    "json": lambda data: json.loads(data.decode("utf-8")),
    **{dtype: _scalar(dtype) for dtype in _SCALARS},
}


def column_decoder(
    shard: str,
    column: str,
    encoding: str,
    *,
    decode: Mapping[str, Callable[[bytes], Any]],
    allow_pickle: bool,
) -> Callable[[bytes], Any]:
    """What turns the bytes of ``column`` (of ``encoding``) into its value: the user's ``decode`` for
    the column or the encoding if it names one, else the encoding's own.

    Raises:
        ResumeError: a ``pkl`` column without ``allow_pickle``, or an encoding this module does not
            decode (an image, or unknown) and ``decode`` does not name.
    """
    hook = decode.get(column, decode.get(encoding))
    if hook is not None:
        return hook
    if encoding == PICKLE:
        if not allow_pickle:
            raise ResumeError(
                f"column {column!r} of MDS shard {shard!r} is pickled ('pkl'): unpickling runs whatever code the "
                "file names, so MDSReader never does it by default (like torch.load(weights_only=True)); pass "
                "allow_pickle=True if you trust these files, or leave the column out with columns=[...]"
            )
        return pickle.loads
    if encoding in _DECODERS:
        return _DECODERS[encoding]
    if encoding == "ndarray" or encoding.startswith("ndarray:"):
        try:
            return _ndarray(encoding[len("ndarray:") :])
        except ValueError as exc:
            raise ResumeError(f"column {column!r} of MDS shard {shard!r} has the encoding {encoding!r}: {exc}") from exc
    raise ResumeError(
        f"column {column!r} of MDS shard {shard!r} has the encoding {encoding!r}, which MDSReader does not decode "
        f"itself; pass decode={{{encoding!r}: a function of the bytes}} (for an image, e.g. "
        "lambda b: PIL.Image.open(io.BytesIO(b)); bytes keeps them as they are), or leave the column out "
        "with columns=[...]"
    )


class SampleLengthError(ValueError):
    """A sample's bytes are not as long as its columns say: the offsets that cut it out of the shard
    are wrong (or its bytes). The reader names the shard and the sample."""


def sample_decoder(
    shard: str,
    names: Sequence[str],
    encodings: Sequence[str],
    sizes: Sequence[int | None],
    *,
    columns: Sequence[str] | None,
    decode: Mapping[str, Callable[[bytes], Any]],
    allow_pickle: bool,
) -> Callable[[bytes], dict[str, Any]]:
    """What turns one sample's bytes (``bytes``) into its ``{column: value}``
    dict, with only ``columns`` (all when None) decoded.

    Raises:
        ResumeError: a column of ``columns`` the shard lacks, or a column that cannot be decoded
            (see :func:`column_decoder`).

    The function it returns raises :class:`SampleLengthError` for bytes that are not one sample's.
    """
    if columns is not None:
        missing = [c for c in columns if c not in names]
        if missing:
            raise ResumeError(f"MDS shard {shard!r} lacks the column(s) {missing}; its columns are {list(names)}")
    wanted = set(names if columns is None else columns)
    # A column's slot: its name, fixed size (None: read from the sample's head), and decoder (None: skipped).
    slots = [
        (name, size or None, column_decoder(shard, name, encoding, decode=decode, allow_pickle=allow_pickle))
        if name in wanted
        else (name, size or None, None)
        for name, encoding, size in zip(names, encodings, sizes, strict=True)
    ]
    head = struct.Struct(f"<{sum(size is None for _, size, _ in slots)}I")
    fixed = head.size + sum(size for _, size, _ in slots if size is not None)

    def decode_sample(data: bytes) -> dict[str, Any]:
        if len(data) < head.size:
            raise SampleLengthError(
                f"is {len(data)} bytes long, shorter than the {head.size} bytes of its column lengths"
            )
        variable = head.unpack_from(data, 0)
        if fixed + sum(variable) != len(data):
            raise SampleLengthError(f"is {len(data)} bytes long but its columns take {fixed + sum(variable)}")
        lengths = iter(variable)
        position, sample = head.size, {}
        for name, size, decoder in slots:
            length = next(lengths) if size is None else size
            if decoder is not None:
                sample[name] = decoder(data[position : position + length])
            position += length
        return sample

    return decode_sample
