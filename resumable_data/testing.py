"""Check a resume yourself: where two batch streams or two states first differ, bit for bit.

A resumed run is right only if it is *bitwise* the uninterrupted one, so this comparator is exact:
tensors and numpy arrays must have the same type, dtype and shape and the same bytes in every
element (NaNs with the same bits are equal; ``-0.0`` and ``0.0`` are not), numbers must have the same
type and the same bits, and containers the same items (a list equals a tuple with the same items,
as a JSON round trip would make it). It names the first difference by its path
(``[3]['rng']['torch']: ...``), so a failing check says where to look. The library's tests and the
reference trainer use it; so can yours::

    from resumable_data.testing import assert_same

    assert_same(uninterrupted_batches, resumed_batches, "resumed batches")

``torch.testing.assert_close(rtol=0, atol=0)`` is not enough: it compares values rather than bits
(it calls ``-0.0`` equal to ``0.0``) and refuses strings, which states hold (shard names, modes).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from .core.state import brief

__all__ = ["assert_same", "first_difference"]


def first_difference(expected: Any, actual: Any, path: str = "", *, strict_containers: bool = False) -> str | None:
    """Where ``actual`` first differs from ``expected``, or None when they are bitwise the same.

    Compares tensors, numpy arrays (and numpy scalars), python numbers, strings, bytes, None,
    dataclasses (such as :class:`~resumable_data.rng.SampleKey`) and any nesting of dicts, lists and
    tuples. Containers are compared by their items, not their type: mappings by keys and values
    (not key order, nor ``dict`` against ``OrderedDict``), lists and tuples alike (a JSON round
    trip, or torch's distributed optimizer state, turns one into the other). A tensor's device and
    ``requires_grad`` are not compared; its dtype, shape and bytes are.

    Args:
        expected: the reference, e.g. the batches or the state of an uninterrupted run.
        actual: what to check against it, e.g. the resumed run's.
        path: the name of the compared values, put in front of the path in the message.
        strict_containers: also require the same container types (``dict`` vs ``OrderedDict``,
            ``list`` vs ``tuple``) and the same key order: what a checkpoint round trip through
            ``torch.save`` must give back, or a refused load must leave, unchanged.

    Returns:
        ``"PATH: what differs"`` for the first difference found (depth first, in ``expected``'s
        order), or None.

    Example:
        >>> first_difference({"step": 3, "loss": [0.5, 0.25]}, {"step": 3, "loss": [0.5, 0.125]}, "state")
        "state['loss'][1]: 0.25 vs 0.125"
        >>> first_difference(torch.tensor([1.0, -0.0]), torch.tensor([1.0, 0.0]), "batch")
        'batch: 1 of 2 elements differ, first at index (1,): -0.0 vs 0.0'
        >>> first_difference({"b": 1, "a": [2]}, {"a": (2,), "b": 1}, "state", strict_containers=True)
        "state: key order differs: ['b', 'a'] vs ['a', 'b']"
    """
    where = path or "value"
    strict = strict_containers
    if strict and _is_container(expected) and _is_container(actual) and type(expected) is not type(actual):
        return f"{where}: {type(expected).__name__} vs {type(actual).__name__}"
    if isinstance(expected, Mapping) and isinstance(actual, Mapping):
        if expected.keys() != actual.keys():
            missing = ", ".join(sorted(map(repr, expected.keys() - actual.keys()))) or "none"
            extra = ", ".join(sorted(map(repr, actual.keys() - expected.keys()))) or "none"
            return f"{where}: keys differ (missing: {missing}; unexpected: {extra})"
        if strict and list(expected) != list(actual):
            return f"{where}: key order differs: {brief(list(expected))} vs {brief(list(actual))}"
        for key in expected:
            diff = first_difference(expected[key], actual[key], f"{path}[{key!r}]", strict_containers=strict)
            if diff is not None:
                return diff
        return None
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        lengths = f"lengths {len(expected)} vs {len(actual)}"
        # The first differing item says more than the lengths (a resume that skips one item).
        for i, (x, y) in enumerate(zip(expected, actual, strict=False)):
            diff = first_difference(x, y, f"{path}[{i}]", strict_containers=strict)
            if diff is not None:
                return diff if len(expected) == len(actual) else f"{diff} (and {where} has {lengths})"
        return None if len(expected) == len(actual) else f"{where}: {lengths}"
    if type(expected) is not type(actual):
        return f"{where}: {type(expected).__name__} vs {type(actual).__name__} ({brief(expected)} vs {brief(actual)})"
    if isinstance(expected, torch.Tensor):
        return _array_difference(where, expected, actual, _tensor_bytes)
    if isinstance(expected, (np.ndarray, np.generic)):
        if isinstance(expected, np.ndarray) and expected.dtype == object:
            return first_difference(expected.tolist(), actual.tolist(), path, strict_containers=strict)
        return _array_difference(where, np.asarray(expected), np.asarray(actual), _numpy_bytes)
    if dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        for field in dataclasses.fields(expected):
            diff = first_difference(
                getattr(expected, field.name),
                getattr(actual, field.name),
                f"{path}.{field.name}",
                strict_containers=strict,
            )
            if diff is not None:
                return diff
        return None
    if isinstance(expected, (float, complex)):
        same = _float_bits(expected) == _float_bits(actual)
    else:
        same = expected == actual
    return None if same else f"{where}: {brief(expected)} vs {brief(actual)}"


def assert_same(expected: Any, actual: Any, what: str = "", *, strict_containers: bool = False) -> None:
    """Raise ``AssertionError`` naming the first difference unless the two are bitwise the same.

    Args:
        expected: the reference.
        actual: the value to check.
        what: what is compared (e.g. ``"resumed batches"``); it starts the message's path.
        strict_containers: also compare container types and key order (see :func:`first_difference`).

    Raises:
        AssertionError: with :func:`first_difference`'s message.

    Example:
        >>> assert_same([torch.tensor([1, 2])], [torch.tensor([1, 3])], "batches")
        Traceback (most recent call last):
        ...
        AssertionError: batches[0]: 1 of 2 elements differ, first at index (1,): 2 vs 3
    """
    diff = first_difference(expected, actual, what, strict_containers=strict_containers)
    if diff is not None:
        raise AssertionError(diff)


def _is_container(x: Any) -> bool:
    return isinstance(x, (Mapping, list, tuple))


def _float_bits(x: float | complex) -> bytes:
    # Bits, not values: NaN equals a NaN with the same bits, and -0.0 differs from 0.0.
    if isinstance(x, complex):
        return struct.pack("<dd", x.real, x.imag)
    return struct.pack("<d", x)


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """One row of bytes per element (conjugate and negative views resolved, any device)."""
    flat = t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(flat.numel(), flat.element_size()).numpy()


def _numpy_bytes(a: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(a).reshape(-1)
    return flat.view(np.uint8).reshape(flat.size, flat.itemsize)


def _array_difference(where: str, a: Any, b: Any, to_bytes: Callable[[Any], np.ndarray]) -> str | None:
    """Dtype, shape, then bytes element by element; names the first element that differs."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    differs = (to_bytes(a) != to_bytes(b)).any(axis=1)
    if not differs.any():
        return None
    first = int(np.flatnonzero(differs)[0])
    index = tuple(int(i) for i in np.unravel_index(first, tuple(a.shape))) if a.shape else ()
    x, y = (_element(v, first) for v in (a, b))
    return f"{where}: {int(differs.sum())} of {differs.size} elements differ, first at index {index}: {x} vs {y}"


def _element(array: Any, flat_index: int) -> str:
    value = array.reshape(-1)[flat_index]
    value = value.item() if hasattr(value, "item") else value
    return brief(value)
