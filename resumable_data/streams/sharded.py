"""ShardedIterable: the seekable source of a stream pipeline, as a set of per-shard cursors.

The state is which shards of the epoch are unfinished and where each one stands::

    {
        "version": 1,
        "epoch": 3,
        "seed": 0,
        "shuffle": True,
        "num_shards": 100,
        "shards_digest": "9f0c...",
        "slot": 0,
        "num_slots": 1,
        "remaining": [[17, "tok_017.bin", 48213], [4, "tok_004.bin", 0], ...],
        "pending": [],
    }

``remaining`` lists this slot's unfinished shards in the order they will be read, each as
``[shard index, shard name, cursor]``; the cursor is the reader's offset of the next record (a
record index for token windows, a byte offset for text). A restore opens the first shard *at* its
cursor: nothing before it is read. ``pending`` holds ``[shard index, offset]`` of single records to
read before the shards: records that a shuffle buffer held when the worker/rank layout changed.
The state grows with the number of shards, never with the number of records read.

Known sizes. Given the shards' record counts (``sizes=``: from an index file, Parquet footers,
``TokenShardReader.num_records``), a slot's state is one number instead of a list: ``"position"``,
the records this slot has read in its shards' order, from which the current shard and its cursor
are computed (prefix sums of the sizes). The state is then a few hundred bytes at any number of
shards. After a layout change the dealt shards no longer follow that order, so the rest of that
epoch is listed in ``remaining`` as above; the next epoch is a position again.

Shard identity. When a shard is opened at its start, a reader with ``identity(shard)`` (the
ready-made ones: size plus a digest of the first and last 4 KiB, which holds a Parquet footer) is
asked for a short fingerprint, kept in ``"identities"`` while the shard is partly read. A restore
compares it with the file as it is now and refuses a changed shard (truncated, rewritten, replaced
by same-size content) with a ResumeError naming it, unless ``allow_changed_shards=True``.

Order. The shards of epoch ``e`` are read in the order of ``Permutation(num_shards, seed, e)``
(or in list order with ``shuffle=False``). Split over ``S`` (rank, worker) slots, slot ``s`` reads
the ``s``-th, ``s+S``-th, ... shard of that order.

Layout change. :meth:`ShardedIterable.rebalance` pools the unfinished shards of every old slot
with their cursors, sorts them back into the epoch order and deals them round-robin to the new
slots (pending records likewise). Every record of the epoch is still read exactly once, but the
order of the rest of the epoch differs from an uninterrupted run with the old layout.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..core.permutation import Permutation
from ..core.state import (
    SEED,
    SHUFFLE,
    VERSION,
    brief,
    check_int_arg,
    check_version,
    is_int,
    require_bool,
    require_int,
    require_mapping,
)
from ..errors import ResumeError
from .base import (
    EPOCH,
    MAX_COUNT,
    STREAM_STATE_VERSION,
    Key,
    Slot,
    Stream,
    check_same,
    fetch_grouped,
    require_count,
    require_epoch,
)

__all__ = ["ShardedIterable"]

_WHAT = "ShardedIterable"
NUM_SHARDS = "num_shards"
SHARDS_DIGEST = "shards_digest"
SLOT = "slot"
NUM_SLOTS = "num_slots"
REMAINING = "remaining"
PENDING = "pending"
POSITION = "position"  # records read by this slot in its shards' order (with known sizes)
SIZES_DIGEST = "sizes_digest"
IDENTITIES = "identities"  # {shard index: fingerprint} of the shards partly read


class ShardedIterable(Stream):
    """Records of many shards, shard order shuffled per epoch, restorable in O(1) per shard.

    Args:
        shards: paths or any keys, one per shard; ``str(shard)`` names it in the state and in
            errors. The list (and its order) must be the same when resuming, so if the data may
            move to another mount point, pass paths relative to a root that ``read_shard`` joins.
        read_shard: ``read_shard(shard, start)`` returns an iterator over the shard's records from
            record offset ``start``. A reader with a ``read_from(shard, start)`` method yielding
            ``(next offset, record)`` pairs keeps its own offsets instead (byte offsets for
            :class:`TextLineReader`). A reader may also offer ``read_records(shard, offsets)``,
            the records at those ascending offsets: a shuffle buffer's restore then opens each
            shard once (both ready-made readers do).
        shuffle: shuffle the shard order each epoch.
        seed: seed of the shard order; only ``(seed, epoch)`` decide it.
        sizes: the record count of each shard, when known (e.g. ``[reader.num_records(p) for p
            in paths]``, or an index file): the state is then a position, not a list of cursors,
            and :meth:`Stream.shuffle_window` re-reads nothing but the records it hands out. Needs
            a reader whose offsets are record numbers (not :class:`TextLineReader`'s bytes).
        allow_changed_shards: resume even when a partly read shard's identity (size and content
            digest) differs from the checkpoint's; records may then be skipped or repeated.

    Example:
        With files, ``shards`` is e.g. ``sorted(glob("data/*.bin"))`` and ``read_shard`` a
        :class:`TokenShardReader`; here two shards are held in memory:

        >>> records = {"a": [0, 1, 2, 3], "b": [4, 5, 6]}
        >>> def read(shard, start):  # a shard's records from offset ``start`` on
        ...     return iter(records[shard][start:])
        >>> stream = ShardedIterable(["a", "b"], read_shard=read, seed=0)
        >>> records_read = iter(stream)
        >>> [next(records_read) for _ in range(5)]  # this epoch's shard order: b, then a
        [4, 5, 6, 0, 1]
        >>> stream.state_dict()["remaining"]  # [[shard index, name, cursor]]: a few bytes per shard
        [[0, 'a', 2]]
        >>> fresh = ShardedIterable(["a", "b"], read_shard=read, seed=0)
        >>> fresh.load_state_dict(stream.state_dict())  # reads shard "a" directly at its cursor
        >>> list(fresh)
        [2, 3]
    """

    def __init__(
        self,
        shards: Iterable[Any],
        *,
        read_shard: Callable[[Any, int], Iterator[Any]],
        shuffle: bool = True,
        seed: int = 0,
        sizes: Sequence[int] | None = None,
        allow_changed_shards: bool = False,
    ) -> None:
        super().__init__()
        self.shards = list(shards)
        if not self.shards:
            raise ResumeError("ShardedIterable needs at least one shard, but got an empty shard list")
        if not callable(read_shard) and not hasattr(read_shard, "read_from"):
            raise TypeError(f"read_shard must be callable, got {type(read_shard).__name__}")
        self.sizes: list[int] | None = None
        self._sizes_digest: str | None = None
        if sizes is not None:
            self.sizes = [check_int_arg("sizes[i]", size, minimum=0) for size in sizes]
            if len(self.sizes) != len(self.shards):
                raise ResumeError(
                    f"sizes must give one record count per shard: {len(self.shards)} shards but {len(self.sizes)} sizes"
                )
            if hasattr(read_shard, "read_from"):
                raise ResumeError(
                    f"sizes= needs a reader whose offsets are record numbers, but {type(read_shard).__name__} keeps "
                    "its own offsets (bytes); leave sizes=None for it"
                )
            self._sizes_digest = hashlib.sha256(np.asarray(self.sizes, dtype=np.int64).tobytes()).hexdigest()[:16]
        self.allow_changed_shards = bool(allow_changed_shards)
        self._identity = getattr(read_shard, "identity", None)
        self._identities: dict[int, str] = {}
        self._unverified: set[int] = set()  # restored identities not compared with the shard yet
        self._position: int | None = None  # with sizes, and the slot reads its own shards in order
        self._starts: tuple[tuple[int, int, int], list[int], np.ndarray] | None = None  # cached slot layout
        self.read_shard = read_shard
        self.shuffle = bool(shuffle)
        self.seed = check_int_arg("seed", seed, minimum=-(2**63))
        self._names = [str(s) for s in self.shards]
        self._digest = hashlib.sha256("\n".join(self._names).encode()).hexdigest()[:16]
        self._slot: Slot = (0, 1)
        self._remaining: list[list[int]] = []  # [shard index, cursor], the first one being read
        self._pending: list[list[int]] = []
        self.reset(0, None)

    # -- order and reading ---------------------------------------------------------------------
    def shard_order(self, epoch: int) -> list[int]:
        """Shard indices in the order epoch ``epoch`` reads them (all slots together)."""
        n = len(self.shards)
        if not self.shuffle:
            return list(range(n))
        return Permutation(n, self.seed, epoch)(np.arange(n, dtype=np.int64)).tolist()

    def _records(self, index: int, start: int) -> Generator[tuple[int, Any], None, None]:
        """``(next offset, record)`` of shard ``index`` from ``start``; OSError becomes ResumeError."""
        shard = self.shards[index]
        try:
            if hasattr(self.read_shard, "read_from"):
                yield from self.read_shard.read_from(shard, start)
            elif self.sizes is None:
                yield from enumerate(self.read_shard(shard, start), start=start + 1)
            else:
                size = self.sizes[index]
                records = itertools.islice(self.read_shard(shard, start), max(0, size - start))
                offset = start
                for offset, record in enumerate(records, start=start + 1):
                    yield offset, record
                if offset < size:
                    raise ResumeError(
                        f"shard {index} {self._names[index]!r} ended after {offset} records, but sizes gives it "
                        f"{size}: the shard changed, or sizes is wrong"
                    )
        except OSError as exc:
            raise ResumeError(f"cannot read shard {index} {self._names[index]!r} at offset {start}: {exc}") from exc

    def identity(self, index: int) -> str | None:
        """The reader's fingerprint of shard ``index`` as it is now (None: the reader gives none)."""
        if self._identity is None:
            return None
        try:
            return str(self._identity(self.shards[index]))
        except OSError as exc:
            raise ResumeError(f"cannot read shard {index} {self._names[index]!r}: {exc}") from exc

    # -- known sizes: a slot's position <-> (shard, cursor) -------------------------------------------
    def _slot_layout(self, epoch: int, slot: Slot) -> tuple[list[int], np.ndarray]:
        """The slot's shards in reading order and the position where each one starts (plus the total)."""
        if self._starts is None or self._starts[0] != (epoch, *slot):
            order = self.shard_order(epoch)[slot[0] :: slot[1]]
            starts = np.zeros(len(order) + 1, dtype=np.int64)
            np.cumsum(np.asarray(self.sizes or [], dtype=np.int64)[order], out=starts[1:])
            self._starts = ((epoch, *slot), order, starts)
        return self._starts[1], self._starts[2]

    def slot_length(self) -> int | None:
        """Records this slot reads in the current epoch, when the sizes are known and it reads its own
        shards in order (not after a layout change); else None."""
        if self._position is None:
            return None
        return int(self._slot_layout(self._epoch, self._slot)[1][-1])

    @property
    def position(self) -> int | None:
        """Records this slot has read in the current epoch (see :meth:`slot_length`), or None."""
        return self._position

    def keys_at(self, positions: np.ndarray, state: Mapping[str, Any] | None = None) -> list[Key]:
        """The keys of the records at these positions of this slot's epoch, without reading them.

        Needs :meth:`slot_length` to be known; positions must lie below it. With ``state`` (a
        checked state with a position), for that state's epoch and slot instead.
        """
        epoch, slot = self._epoch, self._slot
        if state is not None:
            epoch, slot = self._parse(state)[:2]
        order, starts = self._slot_layout(epoch, slot)
        which = np.searchsorted(starts, positions, side="right") - 1
        shards = np.asarray(order, dtype=np.int64)[which]
        offsets = positions - starts[which]
        return [(epoch, i, o) for i, o in zip(shards.tolist(), offsets.tolist(), strict=True)]

    def seek(self, position: int) -> None:
        """Continue this slot's epoch at ``position`` (records it has read), without reading anything."""
        self._remaining = self._remaining_at(self._epoch, self._slot, position)
        self._position = position
        self._identities, self._unverified = {}, set()

    def _remaining_at(self, epoch: int, slot: Slot, position: int) -> list[list[int]]:
        order, starts = self._slot_layout(epoch, slot)
        first = int(np.searchsorted(starts, position, side="right")) - 1
        remaining = [[index, 0] for index in order[first:]]
        if remaining:
            remaining[0][1] = position - int(starts[first])
        return remaining

    def fetch(self, key: Key) -> Any:
        return self.fetch_many([key])[0]

    def fetch_many(self, keys: Sequence[Key]) -> list[Any]:
        """Re-read ``keys`` shard by shard: each shard opened once, its offsets read in ascending order.

        A reader with ``read_records(shard, offsets)`` gets all of a shard's offsets in one call (the
        ready-made readers open the file once and slice or seek); any other reader is read in runs,
        one ``read_shard`` call per run of consecutive records.
        """

        def read(index: int, positions: list[int]) -> list[Any]:
            return self._read_offsets(index, [keys[p][2] for p in positions])

        return fetch_grouped(keys, 1, read)

    def _read_offsets(self, index: int, offsets: list[int]) -> list[Any]:
        """The records of shard ``index`` at ``offsets`` (ascending); a missing one is a ResumeError."""
        read_records = getattr(self.read_shard, "read_records", None)
        if read_records is not None:
            try:
                records = list(read_records(self.shards[index], offsets))
            except OSError as exc:
                raise ResumeError(
                    f"cannot read shard {index} {self._names[index]!r} at offsets {offsets[:3]}...: {exc}"
                ) from exc
            if len(records) != len(offsets):
                raise ResumeError(
                    f"{type(self.read_shard).__name__}.read_records returned {len(records)} records for "
                    f"{len(offsets)} offsets of shard {index} {self._names[index]!r}"
                )
            return records
        records = []
        while len(records) < len(offsets):
            run = self._records(index, offsets[len(records)])
            for next_offset, record in run:
                records.append(record)
                if len(records) == len(offsets) or offsets[len(records)] != next_offset:
                    break
            else:
                missing = offsets[len(records)]
                raise ResumeError(
                    f"shard {index} {self._names[index]!r} has no record at offset {missing}: it is shorter "
                    "than when the checkpoint was written (truncated or replaced?)"
                )
            run.close()  # releases the reader's file now, not at garbage collection
        return records

    def iter_keyed(self) -> Iterator[tuple[Key, Any]]:
        epoch = self._epoch
        if self._pending:
            # Records a shuffle buffer held before a layout change: re-read them together.
            records = self.fetch_many([(epoch, index, offset) for index, offset in self._pending])
            for record in records:
                index, offset = self._pending[0]
                del self._pending[0]
                yield (epoch, index, offset), record
        while self._remaining:
            entry = self._remaining[0]
            if entry[1] == 0 and self._identity is not None:
                identity = self.identity(entry[0])
                if identity is not None:
                    self._identities[entry[0]] = identity
            elif entry[0] in self._unverified:  # before the shard's first record is read
                self._check_identity(entry[0], entry[1], self._identities[entry[0]])
                self._unverified.discard(entry[0])
            for next_offset, record in self._records(entry[0], entry[1]):
                key = (epoch, entry[0], entry[1])
                entry[1] = next_offset
                if self._position is not None:
                    self._position += 1
                yield key, record
            del self._remaining[0]
            self._identities.pop(entry[0], None)

    # -- epochs and state ------------------------------------------------------------------------
    def reset(self, epoch: int, slot: Slot | None) -> None:
        if slot is not None:
            self._slot = slot
        self._epoch = epoch
        s, num_slots = self._slot
        self._pending, self._identities, self._unverified = [], {}, set()
        if self.sizes is None:
            self._remaining = [[index, 0] for index in self.shard_order(epoch)[s::num_slots]]
        else:
            self._remaining, self._position = self._remaining_at(epoch, self._slot, 0), 0

    def _state(
        self,
        epoch: int,
        slot: Slot,
        remaining: Sequence[Sequence[int]],
        pending: Sequence[Sequence[int]],
        identities: Mapping[int, str],
        position: int | None = None,
    ) -> dict[str, Any]:
        state: dict[str, Any] = {
            VERSION: STREAM_STATE_VERSION,
            EPOCH: epoch,
            SEED: self.seed,
            SHUFFLE: self.shuffle,
            NUM_SHARDS: len(self.shards),
            SHARDS_DIGEST: self._digest,
            SLOT: slot[0],
            NUM_SLOTS: slot[1],
        }
        if self._sizes_digest is not None:
            state[SIZES_DIGEST] = self._sizes_digest
        if position is not None:
            state[POSITION] = position
        else:
            state[REMAINING] = [[i, self._names[i], c] for i, c in remaining]
        state[PENDING] = [[i, o] for i, o in pending]
        state[IDENTITIES] = {str(i): identity for i, identity in identities.items()}
        return state

    def state_dict(self) -> dict[str, Any]:
        identities = self._identities
        if self.sizes is not None and identities and self._remaining:
            # Right after its last record a shard is still the head of the list, but a position
            # already points past it: it is finished, and its identity no longer needed.
            head, cursor = self._remaining[0]
            if head in identities and cursor >= self.sizes[head]:
                identities = {i: v for i, v in identities.items() if i != head}
        return self._state(self._epoch, self._slot, self._remaining, self._pending, identities, self._position)

    def _parse(self, state: Any) -> tuple[int, Slot, list[list[int]], list[list[int]]]:
        """Validate a state against this shard list: (epoch, slot, remaining, pending)."""
        return self._parse_all(state)[:4]

    def _parse_all(self, state: Any) -> tuple[int, Slot, list[list[int]], list[list[int]], int | None, dict[int, str]]:
        """Validate a state: (epoch, slot, remaining, pending, position or None, identities)."""
        state = require_mapping(state, _WHAT)
        check_version(state, STREAM_STATE_VERSION, _WHAT)
        epoch = require_epoch(state, _WHAT)
        check_same(_WHAT, SEED, state.get(SEED), self.seed, "build the pipeline with the checkpoint's seed")
        check_same(
            _WHAT, SHUFFLE, require_bool(state, SHUFFLE, _WHAT), self.shuffle, "build it with the checkpoint's shuffle"
        )
        n = len(self.shards)
        check_same(
            _WHAT,
            "shard sizes (digest)",
            state.get(SIZES_DIGEST),
            self._sizes_digest,
            "pass the checkpoint's sizes= (the same record count for every shard)",
        )
        num_slots = require_count(state, NUM_SLOTS, _WHAT)
        slot = require_count(state, SLOT, _WHAT)
        if slot >= num_slots:
            raise ResumeError(f"{_WHAT} state has slot {slot} but only {num_slots} slots")
        position: int | None = None
        remaining: list[list[int]] = []
        remaining_raw: Any = []
        if POSITION in state:
            if self.sizes is None:
                raise ResumeError(
                    f"{_WHAT} state holds a {POSITION!r}, which needs the shards' sizes; pass the checkpoint's sizes="
                )
            position = require_count(state, POSITION, _WHAT)
            total = int(self._slot_layout(epoch, (slot, num_slots))[1][-1])
            if position > total:
                raise ResumeError(
                    f"{_WHAT} state is at position {position} of slot {slot}, but that slot's shards hold {total} "
                    "records; pass a state_dict() of this pipeline unchanged"
                )
            remaining = self._remaining_at(epoch, (slot, num_slots), position)  # computed: nothing to check
        else:
            remaining_raw = state.get(REMAINING)
        pending_raw = state.get(PENDING)
        if not isinstance(remaining_raw, list) or not isinstance(pending_raw, list):
            raise ResumeError(f"{_WHAT} state fields {REMAINING!r} and {PENDING!r} must be lists")
        for entry in remaining_raw:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and is_int(entry[0]) and is_int(entry[2])):
                raise ResumeError(f"{_WHAT} state: a remaining shard must be [index, name, cursor], got {brief(entry)}")
            index, name, cursor = entry
            if not 0 <= index < n or not isinstance(name, str) or self._names[index] != name:
                current = repr(self._names[index]) if 0 <= index < n else "no such shard"
                raise ResumeError(
                    f"shard list differs from the checkpoint's: checkpoint's shard {brief(index)} {brief(name)} (cursor "
                    f"{brief(cursor)}) is {current} in this pipeline; pass the checkpoint's shard list, in its order"
                )
            if not 0 <= cursor <= MAX_COUNT:
                raise ResumeError(
                    f"shard {index} {brief(name)} has a cursor {brief(cursor)} outside [0, 2**63) in the checkpoint"
                )
            remaining.append([index, cursor])
        check_same(
            _WHAT, "number of shards", require_int(state, NUM_SHARDS, _WHAT), n, "pass the checkpoint's shard list"
        )
        check_same(
            _WHAT,
            "shard list (digest of the names)",
            state.get(SHARDS_DIGEST),
            self._digest,
            "pass the checkpoint's shard list, in its order",
        )
        if len({i for i, _ in remaining}) != len(remaining):
            raise ResumeError(f"{_WHAT} state lists a shard twice in {REMAINING!r}: {brief(remaining_raw)}")
        cursors = {index: cursor for index, cursor in remaining}
        pending: list[list[int]] = []
        for entry in pending_raw:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and all(is_int(v) for v in entry)):
                raise ResumeError(f"{_WHAT} state: a pending record must be [shard index, offset], got {brief(entry)}")
            _check_record(entry[0], entry[1], n, cursors, lambda: "pending record")
            pending.append([entry[0], entry[1]])
        if len({(i, o) for i, o in pending}) != len(pending):
            raise ResumeError(f"{_WHAT} state lists a record twice in {PENDING!r}: {brief(pending_raw)}")
        identities_raw = state.get(IDENTITIES, {})
        if not isinstance(identities_raw, Mapping):
            raise ResumeError(f"{_WHAT} state field {IDENTITIES!r} must be a dict, got {brief(identities_raw)}")
        identities: dict[int, str] = {}
        for key, identity in identities_raw.items():
            index = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 20 else -1
            if index not in cursors or not isinstance(identity, str):
                raise ResumeError(
                    f"{_WHAT} state: {IDENTITIES!r} has {brief(key)}: {brief(identity)}, but only shards being read "
                    f"have an identity (a string); pass a state_dict() of this pipeline unchanged"
                )
            identities[index] = identity
        return epoch, (slot, num_slots), remaining, pending, position, identities

    def _check_identity(self, index: int, cursor: int, saved: str) -> None:
        """Refuse a partly read shard that is not the file the checkpoint read."""
        now = self.identity(index)
        if now is not None and now != saved:
            raise ResumeError(
                f"shard {index} {self._names[index]!r} (cursor at offset {cursor}) changed since the checkpoint: it was {saved} "
                f"(size:digest of its edges), it is {now} now; resuming would skip or repeat records. "
                "Restore the shard the checkpoint read, or pass allow_changed_shards=True to ShardedIterable "
                "to read it as it is"
            )

    def key_checker(self, state: Mapping[str, Any] | None) -> Callable[[Key], None]:
        n = len(self.shards)
        epoch: int | None = None
        cursors: dict[int, int] = {}
        pending: set[tuple[int, int]] = set()
        if state is not None:
            epoch, _, remaining, pending_list = self._parse(state)
            cursors = {index: cursor for index, cursor in remaining}
            pending = {(i, o) for i, o in pending_list}

        def check(key: Key) -> None:
            if len(key) != 3:
                raise ResumeError(f"{_WHAT}: a record key is [epoch, shard index, offset], but got {brief(list(key))}")
            key_epoch, index, offset = key
            if epoch is not None and key_epoch != epoch:
                raise ResumeError(
                    f"{_WHAT}: record key {brief(list(key))} is from epoch {brief(key_epoch)}, but the state is in "
                    f"epoch {epoch}; pass a state_dict() of this pipeline unchanged"
                )
            _check_record(index, offset, n, cursors, lambda: f"record key {brief(list(key))}")
            if (index, offset) in pending:
                raise ResumeError(
                    f"{_WHAT}: record key {brief(list(key))} is also a pending record, so it would be read twice"
                )

        return check

    def saved_slots(self, state: Mapping[str, Any]) -> list[Slot]:
        return [self._parse(state)[1]]

    def check(self, state: Any) -> Callable[[], None]:
        epoch, slot, remaining, pending, position, identities = self._parse_all(state)

        def apply() -> None:
            self._epoch, self._slot, self._remaining, self._pending = epoch, slot, remaining, pending
            self._position, self._identities = position, dict(identities)
            # Compared when the shard is next read: a restore opens no shard it does not read.
            self._unverified = set() if self.allow_changed_shards else set(identities)

        return apply

    def rebalance(
        self, states: Sequence[Mapping[str, Any]], num_slots: int, pending: list[Key]
    ) -> list[dict[str, Any]]:
        parsed = [self._parse_all(s) for s in states]
        identities = {i: identity for p in parsed for i, identity in p[5].items()}
        epoch = parsed[0][0]
        if any(p[0] != epoch for p in parsed):
            raise ResumeError(f"{_WHAT}: the slots' states are from different epochs {sorted({p[0] for p in parsed})}")
        remaining = [entry for p in parsed for entry in p[2]]
        if len({i for i, _ in remaining}) != len(remaining):
            raise ResumeError(
                f"{_WHAT}: a shard is unfinished in two slots' states; were they saved at different times?"
            )
        rank = {index: position for position, index in enumerate(self.shard_order(epoch))}
        remaining.sort(key=lambda entry: rank[entry[0]])
        records = [entry for p in parsed for entry in p[3]]
        for key in pending:
            if key[0] != epoch or len(key) != 3:
                raise ResumeError(f"{_WHAT}: pending record {brief(list(key))} is not a record of epoch {epoch}")
            records.append([key[1], key[2]])
        return [
            self._state(
                epoch,
                (s, num_slots),
                remaining[s::num_slots],
                records[s::num_slots],
                {i: identities[i] for i, _ in remaining[s::num_slots] if i in identities},
            )
            for s in range(num_slots)
        ]


def _check_record(index: int, offset: int, n: int, cursors: Mapping[int, int], what: Callable[[], str]) -> None:
    """Refuse a record (already read: buffered or pending) that cannot exist or was not read yet.

    A record of a shard that is still being read lies before that shard's cursor; whether a
    finished shard has it only a read can tell (the reader then raises a ResumeError). ``what``
    names the record for the message; it is called only on a refusal, because a restore checks a
    whole shuffle buffer of keys and formatting each one would cost more than the check.
    """
    if not 0 <= index < n:
        raise ResumeError(f"{_WHAT} state: {what()} names shard {brief(index)}, but there are {n} shards (0..{n - 1})")
    if not 0 <= offset <= MAX_COUNT:
        raise ResumeError(f"{_WHAT} state: {what()} has an offset {brief(offset)} outside [0, 2**63) in shard {index}")
    if index in cursors and offset >= cursors[index]:
        raise ResumeError(
            f"{_WHAT} state: {what()} is at offset {brief(offset)} of shard {index}, which is read only up to its "
            f"cursor {cursors[index]}: that record was not read yet; pass a state_dict() of this pipeline unchanged"
        )
