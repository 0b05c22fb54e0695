"""Ranges ``[start, end)`` of an epoch that a ``skip`` moved past: parsed from a state, and extended.

A map-style state records global positions (``map.skipped``), a StreamLoader state each rank's batch
numbers (``streams.skipped``); both keep them as ``[[start, end], ...]``, ascending, disjoint and not
adjacent (adjacent skips merge), at most :data:`MAX_RANGES` of them, none past what was consumed.
"""

from __future__ import annotations

from typing import Any

from ..errors import ResumeError
from .state import INT64_MAX, brief, is_int

__all__ = ["MAX_RANGES", "Ranges", "add_range", "require_ranges"]

MAX_RANGES = 1024  # keeps the state small; adjacent skips merge into one range

Ranges = tuple[tuple[int, int], ...]


def require_ranges(raw: Any, what: str, *, limit: int, unit: str) -> Ranges:
    """``raw`` as ranges (see the module docstring) ending at or before ``limit``; ``what`` names the
    field and ``unit`` what the numbers count, for the error."""
    ranges: list[tuple[int, int]] = []
    ok = isinstance(raw, (list, tuple)) and 0 < len(raw) <= MAX_RANGES
    for item in raw if ok else ():
        pair = isinstance(item, (list, tuple)) and len(item) == 2 and all(is_int(v) for v in item)
        if not pair or not 0 <= item[0] < item[1] <= min(limit, INT64_MAX) or (ranges and item[0] <= ranges[-1][1]):
            ok = False
            break
        ranges.append((int(item[0]), int(item[1])))
    if not ok:
        raise ResumeError(
            f"{what} must be a list of 1 to {MAX_RANGES} [start, end] {unit} ranges, ascending, disjoint and not "
            f"adjacent, with 0 <= start < end <= {limit}, but got {brief(raw)}; pass a state_dict() unchanged"
        )
    return tuple(ranges)


def add_range(ranges: Ranges, start: int, end: int) -> Ranges:
    """``ranges`` with ``[start, end)`` added after them (merged with the last one when adjacent)."""
    if ranges and ranges[-1][1] == start:
        return (*ranges[:-1], (ranges[-1][0], end))
    return (*ranges, (start, end))
