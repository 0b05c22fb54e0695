"""Skipped stretches of a StreamLoader epoch: batches a ``skip`` moved past without reading them.

``python -m resumable_data skip --pipeline`` (:func:`resumable_data.position.skip_stream_state`)
moves every rank's slots of a StreamLoader state forward past a bad stretch of batches. The records
it jumps over are *consumed* — each slot's position moves past them, so the rest of the epoch is
still read exactly once, also after a layout change — but *not read*. The state says so under
:data:`SKIPPED`: per rank, the ranges ``[start, end)`` of the rank's batch numbers in the current
epoch that were skipped (``{"0": [[30, 33]], "1": [[30, 33]]}``, see :mod:`resumable_data.core.ranges`).
The loader keeps its rank's ranges until its epoch ends and writes them back in every
``state_dict()`` of that epoch, so ``where`` reports those batches as skipped, not read. A restore
into another layout drops them: the new ranks' batch numbers count other batches.

A state with skipped ranges has version :data:`SKIPPED_LOADER_VERSION` (2), which a release before
it refuses ("state has version 2, but this resumable_data reads version 1") rather than resume
without the record; every other state is written as version 1, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.ranges import Ranges, require_ranges
from ..core.state import VERSION, brief, require_int, require_mapping
from ..errors import ResumeError

__all__ = [
    "PLAIN_LOADER_VERSION",
    "SKIPPED",
    "SKIPPED_LOADER_VERSION",
    "check_loader_version",
    "rank_skipped",
    "skipped_by_rank",
]

SKIPPED = "skipped"
PLAIN_LOADER_VERSION = 1
SKIPPED_LOADER_VERSION = 2


def check_loader_version(state: Mapping[str, Any], what: str) -> int:
    """The state's version: 1, or 2 with :data:`SKIPPED`; anything else refused."""
    version = require_int(state, VERSION, what)
    if version not in (PLAIN_LOADER_VERSION, SKIPPED_LOADER_VERSION):
        raise ResumeError(
            f"{what} state has version {brief(version)}, but this resumable_data reads versions "
            f"{PLAIN_LOADER_VERSION} and {SKIPPED_LOADER_VERSION}; load the checkpoint with the resumable_data "
            "release that wrote it"
        )
    if version == SKIPPED_LOADER_VERSION and SKIPPED not in state:
        raise ResumeError(f"{what} state has version {version} but is missing the key {SKIPPED!r}")
    return version


def skipped_by_rank(state: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The raw :data:`SKIPPED` mapping of a checked state (empty for version 1)."""
    if state[VERSION] == PLAIN_LOADER_VERSION:
        return {}
    return dict(require_mapping(state[SKIPPED], f"{what} {SKIPPED!r}"))


def rank_skipped(state: Mapping[str, Any], rank: int, done: int, what: str) -> Ranges:
    """Rank ``rank``'s skipped batch ranges of a checked state, none past its ``done`` batches."""
    raw = skipped_by_rank(state, what).get(str(rank))
    if raw is None:
        return ()
    return require_ranges(raw, f"{what} state field {SKIPPED!r} of rank {rank}", limit=done, unit="batch")
