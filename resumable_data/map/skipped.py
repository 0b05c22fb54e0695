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

from ..core.ranges import Ranges, require_ranges
from ..errors import ResumeError

__all__ = ["SKIPPED", "SKIPPED_STATE_VERSION", "Ranges", "require_skipped"]

SKIPPED = "skipped"
SKIPPED_STATE_VERSION = 4


def require_skipped(state: Mapping[str, Any], what: str, *, position: int) -> Ranges:
    """Read :data:`SKIPPED`: ``[[start, end], ...]``, ascending, disjoint, none past ``position``."""
    if SKIPPED not in state:
        raise ResumeError(f"{what} state has version {SKIPPED_STATE_VERSION} but is missing the key {SKIPPED!r}")
    return require_ranges(state[SKIPPED], f"{what} state field {SKIPPED!r}", limit=position, unit="position")
