"""An item of a litdata chunk, from its bytes back to what the user gave ``litdata.optimize``.

An item is the leaves of the user's pytree (``config.data_spec``), each written by the serializer
``config.data_format`` names for it, behind a header of one little-endian ``uint32`` size per leaf.
The leaves decoded here are the ones whose bytes are plain data: ``int`` (int64), ``float``
(float64), ``bool``, ``str``/``text`` (UTF-8), ``bytes``, numpy arrays (``no_header_numpy:K``
1-D, ``numpy`` with a dtype/shape header) and torch tensors (``no_header_tensor:K`` 1-D,
``tensor`` with a big-endian dtype/rank/shape header), and ``json`` (litdata's compact encoding of
nested lists and dicts). ``pickle`` would run code from the file, so it is refused unless the
caller allows it; images, audio and the other media serializers are left to a ``decode`` hook.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...errors import ResumeError

__all__ = ["TOKEN_DTYPES", "ItemDecoder"]

# litdata's dtype tables (litdata.constants): the index a no_header_*:K format and a header name.
_TORCH_DTYPES = [torch.float32, torch.float, torch.float64, torch.double, torch.complex64, torch.cfloat]
_TORCH_DTYPES += [torch.complex128, torch.cdouble, torch.float16, torch.half, torch.bfloat16, torch.uint8]
_TORCH_DTYPES += [torch.int8, torch.int16, torch.short, torch.int32, torch.int, torch.int64, torch.long]
_TORCH_DTYPES += [torch.bool, torch.uint16]
# Indices 14-17 are object, bytes, str and void: not data a buffer holds by value, never decoded.
_NUMPY_DTYPES = [np.dtype(t) for t in ("i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8")]
_NUMPY_DTYPES += [np.dtype("c8"), np.dtype("c16"), np.dtype("bool")]
TOKEN_DTYPES: dict[str, list[Any]] = {"no_header_tensor": _TORCH_DTYPES, "no_header_numpy": _NUMPY_DTYPES}
_PLAIN = (
    "int",
    "float",
    "bool",
    "str",
    "text",
    "bytes",
    "numpy",
    "tensor",
    "json",
    "no_header_numpy",
    "no_header_tensor",
)

Decode = Callable[[bytes], Any]


def token_dtype(data_format: str, where: str) -> Any:
    """The torch or numpy dtype of a ``no_header_tensor:K`` / ``no_header_numpy:K`` format."""
    name, _, index = data_format.partition(":")
    table = TOKEN_DTYPES[name]
    if not index.isdigit() or int(index) >= len(table):
        raise ResumeError(
            f"{where}: data_format {data_format!r} names no dtype litdata writes ({name}:0..{len(table) - 1})"
        )
    return table[int(index)]


def _tensor(data: bytes) -> torch.Tensor:
    """litdata's ``tensor``: big-endian uint32 dtype index and rank, the shape, then the data."""
    index, rank = struct.unpack_from(">II", data, 0)
    shape = struct.unpack_from(f">{rank}I", data, 8)
    if index >= len(_TORCH_DTYPES):
        raise ValueError(f"tensor dtype index {index} is not one litdata writes")
    dtype, start = _TORCH_DTYPES[index], 8 + 4 * rank
    tensor = torch.empty(shape, dtype=dtype)
    if len(data) - start != tensor.numel() * tensor.element_size():
        raise ValueError(f"a tensor of shape {list(shape)} ({dtype}) with {len(data) - start} bytes of data")
    return torch.frombuffer(bytearray(data[start:]), dtype=dtype).reshape(shape) if tensor.numel() else tensor


def _numpy(data: bytes) -> np.ndarray:
    """litdata's ``numpy``: native uint32 dtype index, ndim and shape, then the data."""
    index, ndim = struct.unpack_from("<II", data, 0)
    if index >= len(_NUMPY_DTYPES):
        raise ValueError(f"numpy dtype index {index} is not a plain-data dtype")
    shape = struct.unpack_from(f"<{ndim}I", data, 8)
    return np.frombuffer(data, dtype=_NUMPY_DTYPES[index], offset=8 + 4 * ndim).copy().reshape(shape)


def _leaf(data_format: str, field: str, allow_pickle: bool, decode: Callable[[str, bytes], Any] | None) -> Decode:
    """The decoder of one leaf; refuses (naming the field) what it would not decode safely."""
    name = data_format.split(":", 1)[0]
    if name in ("no_header_tensor", "no_header_numpy"):
        dtype = token_dtype(data_format, f"field {field!r}")
        if name == "no_header_numpy":
            return lambda data: np.frombuffer(data, dtype=dtype).copy()
        return lambda data: torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
    simple: dict[str, Decode] = {
        "int": lambda data: struct.unpack("<q", data)[0],
        "float": lambda data: struct.unpack("<d", data)[0],
        "bool": lambda data: data[0] != 0,
        "str": lambda data: data.decode("utf-8"),
        "text": lambda data: data.decode("utf-8"),
        "bytes": bytes,
        "tensor": _tensor,
        "numpy": _numpy,
        "json": nested_loads,
    }
    if name in simple:
        return simple[name]
    if name == "pickle" and allow_pickle:
        return pickle.loads  # the caller vouched for the data: allow_pickle=True
    if decode is not None:
        return lambda data: decode(data_format, data)
    if name == "pickle":
        raise ResumeError(
            f"litdata field {field!r} is stored with pickle, and unpickling runs code from the file, so it is "
            "refused by default (as torch.load(weights_only=True) refuses it); pass allow_pickle=True if you "
            "trust the data, or decode=callable(data_format, bytes)"
        )
    raise ResumeError(
        f"litdata field {field!r} is stored with litdata's {data_format!r} serializer, which this reader does not "
        f"decode (it decodes {', '.join(_PLAIN)}); pass decode=callable(data_format, bytes) to decode it"
    )


# -- the pytree ---------------------------------------------------------------------------------
_CONTAINERS = ("builtins.dict", "collections.OrderedDict", "builtins.list", "builtins.tuple")


def _unflattener(node: Any, path: str, fields: list[str], where: str) -> Callable[[Any], Any]:
    """What builds ``node``'s value from an iterator of leaves, appending its leaves' paths to ``fields``."""
    if not isinstance(node, dict) or not isinstance(node.get("children_spec"), list):
        raise ResumeError(f"{where}: config.data_spec has a node {str(node)[:80]!r}, not one of litdata's treespec")
    kind, children = node.get("type"), node["children_spec"]
    if kind is None:
        fields.append(path or "<item>")
        return next
    if kind not in _CONTAINERS:
        raise ResumeError(
            f"{where}: config.data_spec holds a {kind!r} at {path or 'the root'}; this reader rebuilds {_CONTAINERS}"
        )
    if kind.endswith("dict") or kind.endswith("OrderedDict"):
        keys = json.loads(node.get("context") or "[]")
        if not isinstance(keys, list) or len(keys) != len(children):
            raise ResumeError(f"{where}: config.data_spec's dict at {path or 'the root'} has keys {keys!r}")
        parts = [
            _unflattener(c, f"{path}.{k}" if path else str(k), fields, where)
            for k, c in zip(keys, children, strict=True)
        ]
        mapping = OrderedDict if kind == "collections.OrderedDict" else dict
        if all(part is next for part in parts):  # a dict of leaves: the common item
            # The item's leaves iterator goes on past this dict's: zip stops at the last key.
            return lambda leaves: mapping(zip(keys, leaves, strict=False))
        return lambda leaves: mapping((key, part(leaves)) for key, part in zip(keys, parts, strict=True))
    parts = [_unflattener(child, f"{path}[{i}]", fields, where) for i, child in enumerate(children)]
    container = list if kind == "builtins.list" else tuple
    return lambda leaves: container(part(leaves) for part in parts)


class ItemDecoder:
    """Decodes an item of a chunk (its header of leaf sizes, then the leaves) into the user's pytree.

    Args:
        data_format: the serializer of each leaf (``config.data_format``).
        data_spec: the pytree (``config.data_spec``, litdata's ``treespec_dumps``), or None.
        allow_pickle: decode ``pickle`` leaves (runs code from the file).
        decode: ``decode(data_format, bytes)`` for the leaves not decoded here (see the module docstring).
        where: what names the dataset in errors.

    Raises:
        ResumeError: the spec is not one litdata writes, its leaves do not match ``data_format``, or
            a leaf's serializer is refused (see the module docstring), naming the field.
    """

    def __init__(
        self,
        data_format: tuple[str, ...],
        data_spec: str | None,
        *,
        allow_pickle: bool,
        decode: Callable[[str, bytes], Any] | None,
        where: str,
    ) -> None:
        # What a worker process rebuilds it from (its decoders are closures, which do not pickle).
        self._args: dict[str, Any] = {"data_format": data_format, "data_spec": data_spec}
        self._args.update(allow_pickle=allow_pickle, decode=decode, where=where)
        self.fields: list[str] = []
        try:
            spec = json.loads(data_spec) if data_spec is not None else [1, {"type": None, "children_spec": []}]
        except ValueError as exc:
            raise ResumeError(f"{where}: config.data_spec is not litdata's treespec JSON: {exc}") from exc
        if not isinstance(spec, list) or len(spec) != 2 or spec[0] != 1:
            raise ResumeError(
                f"{where}: config.data_spec should be [1, <treespec>] (treespec protocol 1), got {spec!r:.80}"
            )
        build = _unflattener(spec[1], "", self.fields, where)
        if len(self.fields) != len(data_format):
            raise ResumeError(
                f"{where}: config.data_spec has {len(self.fields)} leaves but config.data_format lists "
                f"{len(data_format)} serializers"
            )
        self._unflatten = build
        self._leaves = [
            _leaf(f, field, allow_pickle, decode) for f, field in zip(data_format, self.fields, strict=True)
        ]
        self._sizes = struct.Struct("<" + "I" * len(data_format))

    def __getstate__(self) -> dict[str, Any]:
        return self._args

    def __setstate__(self, args: dict[str, Any]) -> None:
        self.__init__(**args)  # type: ignore[misc]

    def __call__(self, item: bytes) -> Any:
        """The user's item from its bytes (a ValueError or struct.error when they are not an item)."""
        sizes = self._sizes.unpack_from(item, 0)
        start = self._sizes.size
        if start + sum(sizes) != len(item):
            raise ValueError(f"its leaves' sizes {list(sizes)} do not add up to the item's {len(item)} bytes")
        leaves = []
        for size, leaf in zip(sizes, self._leaves, strict=True):
            end = start + size
            leaves.append(leaf(item[start:end]))
            start = end
        return self._unflatten(iter(leaves))


# -- litdata's ``json`` leaves (serializers.JsonSerializer) --------------------------------------
_U32, _I64, _F64 = struct.Struct("<I"), struct.Struct("<q"), struct.Struct("<d")
_RECORD = {0x10: None, 0x11: "str", 0x12: "i64", 0x13: "f64", 0x14: "bool"}


def nested_loads(data: bytes) -> Any:
    """A ``json`` leaf: litdata's tagged binary encoding of lists and dicts, or JSON text (older chunks)."""
    if not data or data[0] > 0x20:
        return json.loads(data)
    value, _ = _nested_at(data, 0)
    return value


def _utf8(data: bytes, at: int) -> tuple[str, int]:
    n = _U32.unpack_from(data, at)[0]
    return data[at + 4 : at + 4 + n].decode("utf-8"), at + 4 + n


def _nested_at(data: bytes, at: int) -> tuple[Any, int]:
    tag = data[at]
    if tag in (0, 1, 2, 3, 4, 5, 6):  # the tags with a uint32 count
        n = _U32.unpack_from(data, at + 1)[0]
        at += 5
    if tag == 0:  # JSON text
        return json.loads(data[at : at + n]), at + n
    if tag == 1:  # list of str
        out = []
        for _ in range(n):
            text, at = _utf8(data, at)
            out.append(text)
        return out, at
    if tag in (2, 3):  # list of int64 / float64
        return np.frombuffer(data, dtype="<i8" if tag == 2 else "<f8", count=n, offset=at).tolist(), at + 8 * n
    if tag == 4:  # list of bool
        return [bool(b) for b in data[at : at + n]], at + n
    if tag == 5:  # dict
        mapping = {}
        for _ in range(n):
            key, at = _utf8(data, at)
            mapping[key], at = _nested_at(data, at)
        return mapping, at
    if tag == 6:  # list of records with the same keys
        return _records(data, at, n)
    scalars: dict[int, Callable[[], tuple[Any, int]]] = {
        7: lambda: _utf8(data, at + 1),
        8: lambda: (_I64.unpack_from(data, at + 1)[0], at + 9),
        9: lambda: (_F64.unpack_from(data, at + 1)[0], at + 9),
        10: lambda: (bool(data[at + 1]), at + 2),
        11: lambda: (None, at + 1),
    }
    if tag not in scalars:
        raise ValueError(f"unknown litdata json tag {tag}")
    return scalars[tag]()


def _records(data: bytes, at: int, n: int) -> tuple[list[dict[str, Any]], int]:
    count = _U32.unpack_from(data, at)[0]
    at += 4
    keys = []
    for _ in range(count):
        key, at = _utf8(data, at)
        keys.append(key)
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        row: dict[str, Any] = {}
        for key in keys:
            kind = _RECORD.get(data[at], "?")
            at += 1
            if kind is None:
                row[key] = None
            elif kind == "str":
                row[key], at = _utf8(data, at)
            elif kind in ("i64", "f64"):
                row[key] = (_I64 if kind == "i64" else _F64).unpack_from(data, at)[0]
                at += 8
            elif kind == "bool":
                row[key], at = bool(data[at]), at + 1
            else:
                raise ValueError(f"unknown litdata json record tag {data[at - 1]}")
        rows.append(row)
    return rows, at
