"""A ShardedIterable slot's state as a typed value: :meth:`ShardState.parse` validates a state dict
against the shard list once, :meth:`ShardState.to_dict` writes one (the schema: the package docstring).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...core.growth import grown_pieces, require_pieces
from ...core.state import (
    SEED,
    SHUFFLE,
    VERSION,
    brief,
    check_version,
    is_int,
    require_bool,
    require_int,
    require_mapping,
)
from ...errors import ResumeError
from ..base import EPOCH, MAX_COUNT, STREAM_STATE_VERSION, Key, Slot, check_same, require_count, require_epoch
from ..pending import NO_RECORDS, listed_records, parse_pending, record_keys
from .checks import Reads, check_record
from .keys import (
    COUNT,
    DEALT,
    EPOCH_SHARDS,
    GROWN_STATE_VERSION,
    IDENTITIES,
    NUM_SHARDS,
    NUM_SLOTS,
    PENDING,
    POSITION,
    REMAINING,
    SHARDS_DIGEST,
    SIZES_DIGEST,
    SLOT,
    UNKNOWN,
    WHAT,
)
from .layout import NO_CURSOR, Dealt, EpochOrder, Layout
from .shards import Shards

__all__ = ["ShardState", "held_identities"]


@dataclass(frozen=True)
class ShardState:
    """Where one slot stands in an epoch, checked against a shard list.

    Attributes:
        epoch: the epoch.
        slot: ``(slot, number of slots)``.
        pieces: the shard counts the epoch's order is built over.
        remaining: ``[shard index, cursor]`` of the unfinished shards in reading order; with a
            position only the shard it lies in (the next ones follow from the position).
        pending: ``[shard index, offset]`` of records to read before the shards, an ``(n, 2)``
            read-only int64 array (:mod:`~resumable_data.streams.pending`).
        identities: the fingerprints of shards partly read, or held by a stage above.
        position: with known sizes, the records the slot has read in its shards' order; else None.
        dealt: with a position, the epoch's layout changes so far.
    """

    epoch: int
    slot: Slot
    pieces: tuple[int, ...]
    remaining: Sequence[Sequence[int]]
    pending: np.ndarray
    identities: Mapping[int, str]
    position: int | None = None
    dealt: Dealt = ()

    @property
    def order(self) -> EpochOrder:
        """What the epoch's shard order is built over."""
        return (self.epoch, self.pieces)

    def layout(self, shards: Shards) -> Layout:
        """This slot's known-size layout (needs a position)."""
        return shards.layout(self.order, self.slot, self.dealt)

    def listed(self, shards: Shards) -> list[list[int]]:
        """Every shard this slot has yet to finish, with its cursor."""
        if self.position is None:
            return [list(entry) for entry in self.remaining]
        return self.layout(shards).listed(self.position)

    def upcoming_keys(self, shards: Shards, count: int) -> list[Key] | None:
        """The keys of the slot's next ``count`` records (fewer at its end): its pending records, then
        those at its next positions; None when it lists cursors (a shard's end is known by reading)."""
        if self.position is None:
            return None
        keys = record_keys(self.epoch, self.pending[:count])
        if len(keys) < count:
            layout = self.layout(shards)
            stop = min(self.position + count - len(keys), layout.total)
            keys += layout.keys(self.epoch, np.arange(self.position, stop, dtype=np.int64))
        return keys

    def reads(self, shards: Shards) -> Reads:
        """What this state has read, for the key checks (an array over the shards: at 10^5 shards a
        dict of the slot's shards would cost milliseconds, and a layout change checks each state
        several times)."""
        pending = set(zip(self.pending[:, 0].tolist(), self.pending[:, 1].tolist(), strict=True))
        return Reads(self.epoch, cursors(shards, self), pending)

    def to_dict(self, shards: Shards) -> dict[str, Any]:
        """The plain state dict (the keys in the order the schema shows them)."""
        grown = self.pieces != (shards.count,)
        state: dict[str, Any] = {
            VERSION: GROWN_STATE_VERSION if grown else STREAM_STATE_VERSION,
            EPOCH: self.epoch,
            SEED: shards.seed,
            SHUFFLE: shards.shuffle,
            NUM_SHARDS: shards.count,
            SHARDS_DIGEST: shards.digest,
            SLOT: self.slot[0],
            NUM_SLOTS: self.slot[1],
        }
        if grown:
            state[EPOCH_SHARDS] = list(self.pieces)
        if self.position is not None:
            # Cursors mean the same whatever the sizes: only a position is bound to them (a state
            # saved by cursors and loaded with counted sizes reads back as it was saved).
            state[SIZES_DIGEST] = shards.sizes_digest
            state[POSITION] = self.position
            if self.dealt:
                state[DEALT] = [[num_slots, list(positions)] for num_slots, positions in self.dealt]
        else:
            state[REMAINING] = [[i, shards.names[i], c] for i, c in self.remaining]
        state[PENDING] = self.pending.tolist()
        state[IDENTITIES] = {str(i): identity for i, identity in self.identities.items()}
        return state

    @classmethod
    def parse(cls, state: Any, shards: Shards) -> ShardState:
        """Validate a state dict against ``shards``, with shards appended since the checkpoint taken
        in as ``shards.growth`` says.

        Raises:
            ResumeError: the state is malformed, or was saved with another shard list, seed,
                shuffle or sizes.
        """
        state = require_mapping(state, WHAT)
        version = require_int(state, VERSION, WHAT)
        if version != GROWN_STATE_VERSION:
            check_version(state, STREAM_STATE_VERSION, WHAT)
        epoch = require_epoch(state, WHAT)
        check_same(WHAT, SEED, state.get(SEED), shards.seed, "build the pipeline with the checkpoint's seed")
        check_same(
            WHAT, SHUFFLE, require_bool(state, SHUFFLE, WHAT), shards.shuffle, "build it with the checkpoint's shuffle"
        )
        saved_n = shards.check_list(state)
        pieces = (
            require_pieces(state, EPOCH_SHARDS, WHAT, at_most=saved_n) if version == GROWN_STATE_VERSION else (saved_n,)
        )
        appended_from = None  # where the piece appended by this restore starts in the epoch's order
        if saved_n < shards.count:
            grown = grown_pieces(shards.growth, pieces, shards.count, exhausted=False)
            appended_from, pieces = (pieces[-1] if grown != pieces else None), grown
        num_slots = require_count(state, NUM_SLOTS, WHAT)
        slot = require_count(state, SLOT, WHAT)
        if slot >= num_slots:
            raise ResumeError(f"{WHAT} state has slot {slot} but only {num_slots} slots")
        where = cls(epoch, (slot, num_slots), pieces, [], NO_RECORDS, {})
        remaining_raw: Any = []
        if POSITION in state:
            where = _positioned(state, shards, where)
        else:
            remaining_raw = state.get(REMAINING)
        if not isinstance(remaining_raw, list) or not isinstance(state.get(PENDING), list):
            raise ResumeError(f"{WHAT} state fields {REMAINING!r} and {PENDING!r} must be lists")
        if POSITION not in state:
            remaining = _remaining(remaining_raw, shards, saved_n)
            if appended_from is not None:
                # This slot's share of the appended piece, dealt as the epoch's order deals its shards.
                new = shards.order(where.order)[appended_from:]
                remaining += [[index, 0] for index in new[(slot - appended_from) % num_slots :: num_slots].tolist()]
            where = cls(epoch, where.slot, pieces, remaining, NO_RECORDS, {})
        pending = _pending(state.get(PENDING), cursors(shards, where), saved_n)
        identities = _identities(state.get(IDENTITIES, {}), saved_n)
        return cls(epoch, where.slot, pieces, where.remaining, pending, identities, where.position, where.dealt)


def cursors(shards: Shards, state: ShardState) -> np.ndarray:
    """The cursor of each shard ``state``'s slot has yet to finish, by shard index (``NO_CURSOR`` for
    the others), filled from the layout's arrays with a position."""
    cursor_of = np.full(shards.count, NO_CURSOR, dtype=np.int64)
    if state.position is not None:
        state.layout(shards).fill_cursors(cursor_of, state.position)
    elif state.remaining:
        indices, offsets = zip(*state.remaining, strict=True)
        cursor_of[list(indices)] = offsets
    return cursor_of


def held_identities(identities: Mapping[int, str], entries: Iterable[Sequence[int]]) -> dict[int, str]:
    """The identities of the shards of ``entries`` (``[shard index, cursor or offset]`` each)."""
    return {entry[0]: identities[entry[0]] for entry in entries if entry[0] in identities}


def _positioned(state: Mapping[str, Any], shards: Shards, where: ShardState) -> ShardState:
    """``where`` with the state's position and layout changes, checked against the slot's shards."""
    if shards.sizes is None:
        raise ResumeError(
            f"{WHAT} state holds a {POSITION!r}, which needs the shards' sizes: build it with sizes=None and a "
            f"reader that counts (RecordCounter), sizes={COUNT!r}, or the checkpoint's sizes=[...], not "
            f"sizes={UNKNOWN!r}"
        )
    position = require_count(state, POSITION, WHAT)
    dealt = _require_dealt(state.get(DEALT, []))
    layout = shards.layout(where.order, where.slot, dealt)
    if position > layout.total:
        raise ResumeError(
            f"{WHAT} state is at position {position} of slot {where.slot[0]}, but that slot's shards hold "
            f"{layout.total} records; pass a state_dict() of this pipeline unchanged"
        )
    remaining = layout.remaining_at(position)  # computed: nothing to check
    return ShardState(where.epoch, where.slot, where.pieces, remaining, NO_RECORDS, {}, position, dealt)


def _remaining(raw: list[Any], shards: Shards, saved_n: int) -> list[list[int]]:
    """Read the ``"remaining"`` field (a list): ``[[shard index, name, cursor], ...]``."""
    remaining = []
    for entry in raw:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and is_int(entry[0]) and is_int(entry[2])):
            raise ResumeError(f"{WHAT} state: a remaining shard must be [index, name, cursor], got {brief(entry)}")
        index, name, cursor = entry
        if not 0 <= index < saved_n or not isinstance(name, str) or shards.names[index] != name:
            current = repr(shards.names[index]) if 0 <= index < saved_n else "no such shard"
            raise ResumeError(
                f"shard list differs from the checkpoint's: checkpoint's shard {brief(index)} {brief(name)} (cursor "
                f"{brief(cursor)}) is {current} in this pipeline; pass the checkpoint's shard list, in its order"
            )
        if not 0 <= cursor <= MAX_COUNT:
            raise ResumeError(
                f"shard {index} {brief(name)} has a cursor {brief(cursor)} outside [0, 2**63) in the checkpoint"
            )
        remaining.append([index, cursor])
    if len({i for i, _ in remaining}) != len(remaining):
        raise ResumeError(f"{WHAT} state lists a shard twice in {REMAINING!r}: {brief(raw)}")
    return remaining


def _pending(raw: list[Any], cursor_of: np.ndarray, saved_n: int) -> np.ndarray:
    """Read the ``"pending"`` field (a list): ``[[shard index, offset], ...]`` of records already read."""
    bulk = parse_pending(raw, saved_n, cursor_of, NO_CURSOR)  # thousands after a layout change
    if bulk is not None:
        return bulk
    pending: list[list[int]] = []  # something to refuse (or only these checks accept): entry by entry
    for entry in raw:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and all(is_int(v) for v in entry)):
            raise ResumeError(f"{WHAT} state: a pending record must be [shard index, offset], got {brief(entry)}")
        check_record(entry[0], entry[1], cursor_of, lambda: "pending record", saved_n)
        pending.append([entry[0], entry[1]])
    if len({(i, o) for i, o in pending}) != len(pending):
        raise ResumeError(f"{WHAT} state lists a record twice in {PENDING!r}: {brief(raw)}")
    return listed_records(pending)


def _identities(raw: Any, saved_n: int) -> dict[int, str]:
    """Read the ``"identities"`` field: ``{"shard index": fingerprint}``."""
    if not isinstance(raw, Mapping):
        raise ResumeError(f"{WHAT} state field {IDENTITIES!r} must be a dict, got {brief(raw)}")
    identities: dict[int, str] = {}
    for key, identity in raw.items():
        index = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 20 else -1
        # Shards being read, and shards whose records a stage above holds (finished ones too).
        if not 0 <= index < saved_n or not isinstance(identity, str):
            raise ResumeError(
                f"{WHAT} state: {IDENTITIES!r} has {brief(key)}: {brief(identity)}, but an identity is a string "
                f"by shard index (0..{saved_n - 1}); pass a state_dict() of this pipeline unchanged"
            )
        identities[index] = identity
    return identities


def _require_dealt(raw: Any) -> Dealt:
    """Read the ``"dealt"`` field: ``[[old number of slots, [a position per old slot]], ...]``."""
    if not isinstance(raw, list):
        raise ResumeError(f"{WHAT} state field {DEALT!r} must be a list, got {brief(raw)}")
    dealt = []
    for entry in raw:
        if not (
            isinstance(entry, (list, tuple))
            and len(entry) == 2
            and is_int(entry[0])
            and isinstance(entry[1], (list, tuple))
            and len(entry[1]) == entry[0] >= 1
            and all(is_int(p) and 0 <= p <= MAX_COUNT for p in entry[1])
        ):
            raise ResumeError(
                f"{WHAT} state field {DEALT!r}: each layout change must be [number of slots, [a position per slot]], "
                f"got {brief(entry)}; pass a state_dict() of this pipeline unchanged"
            )
        dealt.append((int(entry[0]), tuple(int(p) for p in entry[1])))
    return tuple(dealt)
