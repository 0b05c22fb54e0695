"""Layout change: the unfinished shards of every old slot, dealt to the new slots.

The unfinished shards with their cursors (and the pending records) of every old slot are pooled,
sorted back into the epoch order and dealt round-robin to the new slots. With known sizes and
every old slot at a position, nothing is listed: the new slots' states are a position each (0) and
the layout change (``"dealt"``), and the shards they read follow from the old positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ...core.state import brief
from ...errors import ResumeError
from ..base import Key
from ..pending import as_records, held_by, keys_as_records
from .keys import EPOCH_SHARDS, WHAT
from .shards import Shards
from .state import ShardState, held_identities

__all__ = ["rebalance"]


def rebalance(shards: Shards, parsed: Sequence[ShardState], num_slots: int, pending: list[Key]) -> list[ShardState]:
    """The states of ``num_slots`` new slots reading what the old slots' states ``parsed`` (every one
    of them, checked) left unread, and the records ``pending`` (keys a stage above held).

    Raises:
        ResumeError: the states are from different epochs or epoch orders, or overlap.
    """
    identities = {i: identity for p in parsed for i, identity in p.identities.items()}
    epoch = parsed[0].epoch
    if any(p.epoch != epoch for p in parsed):
        raise ResumeError(f"{WHAT}: the slots' states are from different epochs {sorted({p.epoch for p in parsed})}")
    pieces = parsed[0].pieces
    if any(p.pieces != pieces for p in parsed):
        raise ResumeError(
            f"{WHAT}: the slots' states have epoch orders over different shard counts "
            f"{sorted({p.pieces for p in parsed})[:5]} ({EPOCH_SHARDS!r}); were they saved at different times?"
        )
    held = keys_as_records(pending, epoch)  # thousands, from a shuffle window: as one array
    if held is None:
        for key in pending:
            if key[0] != epoch or len(key) != 3:
                raise ResumeError(f"{WHAT}: pending record {brief(list(key))} is not a record of epoch {epoch}")
        held = as_records(np.array([[key[1], key[2]] for key in pending], dtype=np.int64))
    records = as_records(np.concatenate([*(p.pending for p in parsed), held]))
    dealt = parsed[0].dealt
    if all(p.position is not None and p.dealt == dealt for p in parsed) and [p.slot for p in parsed] == [
        (s, len(parsed)) for s in range(len(parsed))
    ]:
        positions = [p.position or 0 for p in parsed]
        return _deal_positions(shards, parsed[0], positions, num_slots, records, identities)
    remaining = [entry for p in parsed for entry in p.listed(shards)]
    if len({i for i, _ in remaining}) != len(remaining):
        raise ResumeError(f"{WHAT}: a shard is unfinished in two slots' states; were they saved at different times?")
    rank = {index: position for position, index in enumerate(shards.order((epoch, pieces)).tolist())}
    remaining.sort(key=lambda entry: rank[entry[0]])
    return [
        ShardState(
            epoch,
            (s, num_slots),
            pieces,
            remaining[s::num_slots],
            records[s::num_slots],
            {**held_identities(identities, remaining[s::num_slots]), **held_by(identities, records[s::num_slots])},
        )
        for s in range(num_slots)
    ]


def _deal_positions(
    shards: Shards,
    first: ShardState,
    positions: list[int],
    num_slots: int,
    records: np.ndarray,
    identities: Mapping[int, str],
) -> list[ShardState]:
    """States for ``num_slots`` new slots dealing what old slots at ``positions`` left unread: a
    position each (0) plus the layout change, computed, not listed."""
    dealt = (*first.dealt, (len(positions), tuple(positions)))
    dealing = shards.dealing(first.order, dealt)[0]
    held = np.fromiter(identities, dtype=np.int64, count=len(identities))
    states = []
    for s in range(num_slots):
        mine = {i: identities[i] for i in held[np.isin(held, dealing[s::num_slots])].tolist()}
        mine.update(held_by(identities, records[s::num_slots]))  # pending records' shards
        states.append(ShardState(first.epoch, (s, num_slots), first.pieces, [], records[s::num_slots], mine, 0, dealt))
    return states
