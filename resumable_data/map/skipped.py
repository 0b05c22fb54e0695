"""Skipped stretches of an epoch: positions a checkpoint moved past without reading them.

``python -m resumable_data skip`` (:func:`resumable_data.position.skip_state`) moves a state's
position forward past a bad stretch of data. The positions it jumps over are *consumed* — every
rank's count of the epoch includes them, so the rest of the epoch is still dealt exactly once, at
any world size — but *not read*. The state says so under :data:`SKIPPED`: the global position
ranges ``[start, end)`` of the current epoch that were skipped, ascending and disjoint. The sampler
keeps them until its epoch ends (the next epoch reads everything again) and writes them back in
every ``state_dict()`` of that epoch, so ``where`` reports those samples as skipped, not read.

A state with skipped ranges has version :data:`SKIPPED_STATE_VERSION` (4), which a release before it
refuses with "state has version 4, but this resumable_data reads version 2": it would otherwise
resume at the moved position but lose the record of what was skipped. Every other state is written
as before (version 2, or 3 for an epoch that grew), so older releases read those as they did.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.state import INT64_MAX, brief, is_int
from ..errors import ResumeError

__all__ = ["MAX_SKIPPED_RANGES", "SKIPPED", "SKIPPED_STATE_VERSION", "add_skipped", "require_skipped"]

SKIPPED = "skipped"
SKIPPED_STATE_VERSION = 4
MAX_SKIPPED_RANGES = 1024  # keeps the state small; adjacent skips merge into one range

Ranges = tuple[tuple[int, int], ...]


def require_skipped(state: Mapping[str, Any], what: str, *, position: int) -> Ranges:
    """Read :data:`SKIPPED`: ``[[start, end], ...]``, ascending, disjoint, none past ``position``."""
    if SKIPPED not in state:
        raise ResumeError(f"{what} state has version {SKIPPED_STATE_VERSION} but is missing the key {SKIPPED!r}")
    raw = state[SKIPPED]
    ranges: list[tuple[int, int]] = []
    ok = isinstance(raw, (list, tuple)) and 0 < len(raw) <= MAX_SKIPPED_RANGES
    for item in raw if ok else ():
        pair = isinstance(item, (list, tuple)) and len(item) == 2 and all(is_int(v) for v in item)
        if not pair or not 0 <= item[0] < item[1] <= min(position, INT64_MAX) or (ranges and item[0] <= ranges[-1][1]):
            ok = False
            break
        ranges.append((int(item[0]), int(item[1])))
    if not ok:
        raise ResumeError(
            f"{what} state field {SKIPPED!r} must be a list of 1 to {MAX_SKIPPED_RANGES} [start, end] position "
            f"ranges, ascending, disjoint and not adjacent, with 0 <= start < end <= position ({position}), but got "
            f"{brief(raw)}; pass a state_dict() unchanged"
        )
    return tuple(ranges)


def add_skipped(ranges: Ranges, start: int, end: int) -> Ranges:
    """``ranges`` with ``[start, end)`` added after them (merged with the last one when adjacent)."""
    if ranges and ranges[-1][1] == start:
        return (*ranges[:-1], (ranges[-1][0], end))
    return (*ranges, (start, end))
