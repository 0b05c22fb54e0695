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
shards. After a layout change a slot reads the shards dealt to it (below); their order is computed
from the old slots' positions, kept in ``"dealt"`` as ``[[old number of slots, [their positions]],
...]`` (one entry per layout change in the epoch), so the state is still a position: a few bytes
per old slot, not a cursor per shard.

Shard identity. When a shard is opened at its start, a reader with ``identity(shard)`` (the
ready-made ones: size plus a digest of the first and last 4 KiB, which holds a Parquet footer) is
asked for a short fingerprint, kept in ``"identities"`` while the shard is partly read, and while a
stage above holds records of it that a restore reads again: a ``shuffle_window``'s open window
(:meth:`ShardedIterable.seek`; for a window read from its source, the state at its start gets the
fingerprints of the shards the window entered, :meth:`Stream.with_identities`), a shuffle buffer's
records (:meth:`Stream.with_held`: the fingerprint noted when the shard was entered, or restored;
a restored one of a finished shard stays in the state until the epoch's end). A restore compares
each with the file as it is now before reading the shard again (in order or by key) and refuses a
changed shard (truncated, rewritten, replaced by same-size content) with a ResumeError naming it,
unless ``allow_changed_shards=True``.

Order. The shards of epoch ``e`` are read in the order of ``Permutation(num_shards, seed, e)``
(or in list order with ``shuffle=False``). Split over ``S`` (rank, worker) slots, slot ``s`` reads
the ``s``-th, ``s+S``-th, ... shard of that order.

Growth. Shards appended to the list since a checkpoint join as ``growth=`` says (see
``core.growth``): with ``"next_epoch"`` the restored epoch reads only the checkpoint's shards; with
``"append"`` the new shards, shuffled among themselves, follow every shard of the epoch's order, and
are dealt to the slots of the current layout after the shards they still have, so the old shards'
cursors (or, with sizes, the slots' positions) keep their meaning. The order is then a
:class:`~resumable_data.core.permutation.PiecewisePermutation` over the shard counts in
``"epoch_shards"`` (written, with ``"version": 3``, only for an epoch that grew). The checkpoint's
shard list must be a prefix of the new one, by names and sizes: ``"shards_digest"`` and
``"sizes_digest"`` are compared with the digests of the first ``"num_shards"`` shards.

Layout change. :meth:`ShardedIterable.rebalance` pools the unfinished shards of every old slot
with their cursors, sorts them back into the epoch order and deals them round-robin to the new
slots (pending records likewise). Every record of the epoch is still read exactly once, but the
order of the rest of the epoch differs from an uninterrupted run with the old layout. With known
sizes the pooled list is computed from the positions (array operations over the epoch's shards),
never listed.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..core.growth import APPEND, ERROR, check_growth, grown_pieces, require_pieces
from ..core.permutation import PiecewisePermutation
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
    PlainKeys,
    Slot,
    Stream,
    check_same,
    fetch_grouped,
    require_count,
    require_epoch,
)
from .pending import parse_pending
from .positional import Positional

__all__ = ["ShardedIterable"]

Dealt = tuple[tuple[int, tuple[int, ...]], ...]
"""The epoch's layout changes so far: (old number of slots, their positions) each (see DEALT)."""
EpochOrder = tuple[int, tuple[int, ...]]
"""``(epoch, piece ends)``: what an epoch's shard order is built over (see EPOCH_SHARDS)."""

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
_LAYOUTS_CACHED = 8  # slot layouts kept: a restore reads the states of several slots in turn
DEALT = "dealt"  # with sizes, after layout changes: [[old number of slots, [old slots' positions]], ...]
# The shard counts the epoch's order was built over, when a restore grew it (core.growth); written
# only then, with GROWN_STATE_VERSION, so an older release refuses what it would misread.
EPOCH_SHARDS = "epoch_shards"
GROWN_STATE_VERSION = 3
NO_CURSOR = -1  # in an array of cursors by shard index: the slot has no cursor in that shard


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
        growth: what a restore does with a checkpoint taken on fewer shards (shards appended to the
            list since; the checkpoint's list must be its prefix, by names and sizes): ``"error"``
            (default) refuses it; ``"next_epoch"`` finishes the restored epoch over the
            checkpoint's shards and reads the new ones from the next epoch; ``"append"`` deals the
            new shards, shuffled, to the slots after the shards they still have, so they are read
            in the rest of this epoch. Shards removed, renamed or reordered are always refused.

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

    POSITION_KEYS = frozenset({EPOCH, SLOT, REMAINING, POSITION, DEALT, PENDING, IDENTITIES})

    in_order = True  # a slot's appended shards come after every shard it had (see growth)

    def __init__(
        self,
        shards: Iterable[Any],
        *,
        read_shard: Callable[[Any, int], Iterator[Any]],
        shuffle: bool = True,
        seed: int = 0,
        sizes: Sequence[int] | None = None,
        allow_changed_shards: bool = False,
        growth: str = ERROR,
    ) -> None:
        super().__init__()
        self.shards = list(shards)
        if not self.shards:
            raise ResumeError("ShardedIterable needs at least one shard, but got an empty shard list")
        if not callable(read_shard) and not hasattr(read_shard, "read_from"):
            raise TypeError(f"read_shard must be callable, got {type(read_shard).__name__}")
        self.sizes: list[int] | None = None
        self._size_array = np.zeros(0, dtype=np.int64)  # the sizes as an array (with sizes=)
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
            self._size_array = np.asarray(self.sizes, dtype=np.int64)
            self._sizes_digest = hashlib.sha256(self._size_array.tobytes()).hexdigest()[:16]
        self.allow_changed_shards = bool(allow_changed_shards)
        self.growth = check_growth(growth)
        self._pieces: tuple[int, ...] = (len(self.shards),)  # what the current epoch's order is built over
        self._prefix_digests: dict[int, str] = {}  # digests of the first k names / sizes, for a restore
        self._prefix_sizes: dict[int, str] = {}
        self._identity = getattr(read_shard, "identity", None)
        self._identities: dict[int, str] = {}
        self._unverified: set[int] = set()  # restored identities not compared with the shard yet
        # Every identity of this epoch, taken when a shard was entered or restored: what a stage
        # above that still holds a finished shard's records saves with them (with_identities, with_held).
        self._entered: dict[int, str] = {}
        self._position: int | None = None  # with sizes: records this slot has read in its shards' order
        self._dealt: Dealt = ()  # with sizes: the epoch's layout changes so far (see DEALT)
        self._order: tuple[EpochOrder, np.ndarray] | None = None  # the cached shard order of an epoch
        self._layouts: dict[Any, _Layout] = {}  # cached layouts of the slots asked for lately
        self._dealing: tuple[Any, tuple[np.ndarray, np.ndarray]] | None = None  # the cached _sequence
        self.read_shard = read_shard
        self.shuffle = bool(shuffle)
        self.seed = check_int_arg("seed", seed, minimum=-(2**63))
        self._names = [str(s) for s in self.shards]
        self._digest = hashlib.sha256("\n".join(self._names).encode()).hexdigest()[:16]
        self._slot: Slot = (0, 1)
        # [shard index, cursor], the first one being read; with a position only that one (the next
        # ones follow from the position).
        self._remaining: list[list[int]] = []
        self._pending: deque[list[int]] = deque()  # handed out from the left: O(1) each
        self.reset(0, None)

    # -- order and reading ---------------------------------------------------------------------
    def shard_order(self, epoch: int) -> list[int]:
        """Shard indices in the order epoch ``epoch`` reads them (all slots together): for the current
        epoch as a restore may have grown it (see ``growth``), for any other over every shard."""
        return self._order_array(self._epoch_order(epoch)).tolist()

    def _epoch_order(self, epoch: int) -> EpochOrder:
        """What epoch ``epoch``'s shard order is built over: the current epoch's pieces, else all shards."""
        return (epoch, self._pieces if epoch == self._epoch else (len(self.shards),))

    def _order_array(self, order: EpochOrder) -> np.ndarray:
        """The shard order as an array, cached for the last order asked for (a layout change needs it
        again, and computing it costs in proportion to the number of shards)."""
        if self._order is None or self._order[0] != order:
            epoch, pieces = order
            shards = np.arange(pieces[-1], dtype=np.int64)
            if self.shuffle:
                shards = PiecewisePermutation(pieces, self.seed, epoch)(shards)
            shards.flags.writeable = False
            self._order = (order, shards)
        return self._order[1]

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
    def _sequence(self, order: EpochOrder, dealt: Dealt) -> tuple[np.ndarray, np.ndarray]:
        """The shards every slot of the current layout deals from, with the offset each one starts at:
        the epoch order, or after layout changes what was unfinished at the last one (in epoch order).
        Cached: a restore asks for it once per slot state.

        Shards appended to the epoch's order (growth="append") come after every shard it had, so
        they end up at the end of the sequence, after each layout change, dealt to the slots of the
        current layout after the shards those already had: a slot's position keeps its meaning."""
        if self._dealing is None or self._dealing[0] != (order, dealt):
            shards = self._order_array(order)
            offsets = np.zeros(len(shards), dtype=np.int64)
            for num_slots, positions in dealt:
                shards, offsets = self._unfinished(shards, offsets, num_slots, positions)
            self._dealing = ((order, dealt), (shards, offsets))
        return self._dealing[1]

    def _unfinished(
        self, shards: np.ndarray, offsets: np.ndarray, num_slots: int, positions: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """What ``num_slots`` slots dealing from ``(shards, offsets)`` left unread at ``positions``:
        array operations over the shards, whatever their number."""
        lengths = self._size_array[shards] - offsets
        heads = np.zeros(num_slots, dtype=np.int64)  # per old slot: its index of the shard it is in
        cursors = np.zeros(num_slots, dtype=np.int64)  # and the records of that shard it has read
        for s, position in enumerate(positions):
            starts = np.zeros(len(lengths[s::num_slots]) + 1, dtype=np.int64)
            np.cumsum(lengths[s::num_slots], out=starts[1:])
            if position > starts[-1]:
                raise ResumeError(
                    f"{_WHAT} state field {DEALT!r}: old slot {s} of {num_slots} is at position {position}, but its "
                    f"shards hold {int(starts[-1])} records; pass a state_dict() of this pipeline unchanged"
                )
            heads[s] = int(np.searchsorted(starts, position, side="right")) - 1
            cursors[s] = position - starts[heads[s]]
        keep = np.zeros(len(shards), dtype=bool)
        offsets = offsets.copy()
        for s in range(num_slots):
            first = s + num_slots * int(heads[s])  # the old slot's shard being read, then the rest of its
            keep[first::num_slots] = True
            if first < len(shards):
                offsets[first] += cursors[s]
        return shards[keep], offsets[keep]

    def _slot_layout(self, order: EpochOrder, slot: Slot, dealt: Dealt) -> _Layout:
        """The slot's shards in reading order, where each one starts and the offset it is read from
        (cached: each batch asks for it)."""
        layout = self._layouts.get((order, slot, dealt))
        if layout is None:
            shards, offsets = self._sequence(order, dealt)
            mine, firsts = shards[slot[0] :: slot[1]], offsets[slot[0] :: slot[1]]
            starts = np.zeros(len(mine) + 1, dtype=np.int64)
            np.cumsum(self._size_array[mine] - firsts, out=starts[1:])
            if len(self._layouts) >= _LAYOUTS_CACHED:
                self._layouts.clear()
            layout = self._layouts[order, slot, dealt] = _Layout(mine, starts, firsts)
        return layout

    def slot_length(self) -> int | None:
        """Records this slot reads from its shards in the current epoch, when the sizes are known and
        no pending records come first (right after a layout change); else None."""
        if self._position is None or self._pending:
            return None
        return int(self._slot_layout(self._current(), self._slot, self._dealt).starts[-1])

    @property
    def pending_count(self) -> int:
        """Records this slot reads before its shards: those a shuffle held at a layout change."""
        return len(self._pending)

    @property
    def position(self) -> int | None:
        """Records this slot has read in the current epoch (see :meth:`slot_length`), or None."""
        return self._position

    def keys_at(self, positions: np.ndarray, state: Mapping[str, Any] | None = None) -> list[Key]:
        """The keys of the records at these positions of this slot's epoch, without reading them.

        Needs :meth:`slot_length` to be known; positions must lie below it. With ``state`` (a
        checked state with a position), for that state's epoch and slot instead.
        """
        order, slot, dealt = self._current(), self._slot, self._dealt
        if state is not None:
            parsed = self._parse_all(state)
            order, slot, dealt = (parsed[0], parsed[7]), parsed[1], parsed[6]
        epoch = order[0]
        layout = self._slot_layout(order, slot, dealt)
        which = np.searchsorted(layout.starts, positions, side="right") - 1
        shards = layout.shards[which]
        offsets = positions - layout.starts[which] + layout.firsts[which]
        # zip builds the tuples in C: a shuffle buffer's fill asks for a buffer's worth of keys.
        return list(zip(itertools.repeat(epoch, len(shards)), shards.tolist(), offsets.tolist(), strict=True))

    def seek(self, position: int) -> None:
        """Continue this slot's epoch at ``position`` (records it has read), without reading anything.

        The records between the current position and ``position`` are held by the caller (a
        window that fetches them by key): the identities of their shards are kept, taken now for a
        shard entered at its start, so that a restore refuses a shard changed under them (a
        restored one is compared when the shard is next read).
        """
        layout = self._slot_layout(self._current(), self._slot, self._dealt)
        start = self._position or 0
        first = int(np.searchsorted(layout.starts, start, side="right")) - 1
        last = int(np.searchsorted(layout.starts, position - 1, side="right")) - 1 if position > start else first - 1
        identities = {}
        for index in layout.shards[first : last + 1].tolist():
            identity = self._identities.get(index)
            if identity is None:
                identity = self._take_identity(index)
            if identity is not None:
                identities[index] = identity
        self._remaining = self._remaining_at(self._current(), self._slot, position, self._dealt)
        self._position = position
        self._identities = identities
        self._unverified &= identities.keys()

    def _take_identity(self, index: int) -> str | None:
        """The identity of shard ``index`` as it is now, noted as entered in this epoch."""
        identity = self.identity(index)
        if identity is not None:
            self._entered[index] = identity
        return identity

    def with_identities(self, state: dict[str, Any]) -> dict[str, Any]:
        if not self._entered:
            return state
        _, cursors, pending = self._reads(state)
        held = {index for index, _ in pending}
        saved = state.get(IDENTITIES, {})
        identities = {
            str(index): identity
            for index, identity in self._entered.items()
            if cursors[index] != NO_CURSOR or index in held
        }
        return {**state, IDENTITIES: {**identities, **saved}}

    def with_held(self, state: dict[str, Any], shards: Iterable[Key]) -> dict[str, Any]:
        # A held record's shard is (epoch, shard index); a shard still being read has its identity
        # in the state already, a finished one gets the identity noted when it was entered.
        saved = state[IDENTITIES]
        added = {}
        for shard in shards:
            index = shard[1]
            identity = self._entered.get(index)
            if identity is not None and str(index) not in saved:
                added[str(index)] = identity
        return {**state, IDENTITIES: {**saved, **added}} if added else state

    def take_keys(self, count: int) -> list[Key] | None:
        """The keys of this slot's next ``count`` records (fewer at its end), the slot moved past them
        without reading them: a shuffle buffer then fills with keys and reads each record when it
        is drawn, as a restore does with the keys it re-reads.

        None, and nothing moved, unless the keys follow from the position (known sizes, no pending
        records) and the reader reads records by offset (``read_records``: reading them by key
        costs about what reading them in order does). The shards' identities end up as reading
        the records would leave them: taken for a shard entered at its start, compared with the
        checkpoint's for a restored one (a ResumeError before anything moves).
        """
        if self._position is None or self._pending or getattr(self.read_shard, "read_records", None) is None:
            return None
        layout = self._slot_layout(self._current(), self._slot, self._dealt)
        position = self._position
        stop = min(position + count, int(layout.starts[-1]))
        if stop <= position:
            return []
        first = int(np.searchsorted(layout.starts, position, side="right")) - 1
        last = int(np.searchsorted(layout.starts, stop - 1, side="right")) - 1  # the shard of the last record
        identities, unverified = dict(self._identities), set(self._unverified)
        for k in range(first, last + 1):  # what iter_keyed does as it enters each shard, and leaves it
            index = int(layout.shards[k])
            entry = position - int(layout.starts[k]) + int(layout.firsts[k]) if k == first else int(layout.firsts[k])
            done = k < last or stop == int(layout.starts[k + 1])
            if index in unverified:
                self._check_identity(index, f"cursor at offset {entry}", identities[index])
                unverified.discard(index)
            elif entry == 0 and self._identity is not None:
                # Taken for a shard the keys finish too: the buffer holds its records (with_held).
                identity = self._take_identity(index)
                if identity is not None and not done:
                    identities[index] = identity
            if done:
                identities.pop(index, None)
        keys = self.keys_at(np.arange(position, stop, dtype=np.int64))
        self._remaining = self._remaining_at(self._current(), self._slot, stop, self._dealt)
        self._position, self._identities, self._unverified = stop, identities, unverified
        return keys

    def _current(self) -> EpochOrder:
        return (self._epoch, self._pieces)

    def _remaining_at(self, order: EpochOrder, slot: Slot, position: int, dealt: Dealt) -> list[list[int]]:
        """``[[shard, cursor]]`` of the shard that ``position`` lies in (``[]`` at the slot's end)."""
        layout = self._slot_layout(order, slot, dealt)
        first = int(np.searchsorted(layout.starts, position, side="right")) - 1
        if first >= len(layout.shards):
            return []
        return [[int(layout.shards[first]), int(layout.firsts[first] + position - layout.starts[first])]]

    def _cursors(
        self, order: EpochOrder, slot: Slot, remaining: list[list[int]], position: int | None, dealt: Dealt
    ) -> np.ndarray:
        """The cursor of each shard this slot has yet to finish, by shard index (``NO_CURSOR`` for the
        others): an array over the shards, filled from the layout's arrays with a position. Each
        check of a state builds it (a layout change parses every slot's state several times), so
        it is never a dict of the slot's shards: at 10^5 shards that costs milliseconds."""
        cursor_of = np.full(len(self.shards), NO_CURSOR, dtype=np.int64)
        if position is None:
            if remaining:
                indices, cursors = zip(*remaining, strict=True)
                cursor_of[list(indices)] = cursors
            return cursor_of
        layout = self._slot_layout(order, slot, dealt)
        first = int(np.searchsorted(layout.starts, position, side="right")) - 1
        cursor_of[layout.shards[first:]] = layout.firsts[first:]
        if first < len(layout.shards):
            cursor_of[layout.shards[first]] += position - int(layout.starts[first])
        return cursor_of

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
        """The records of shard ``index`` at ``offsets`` (ascending); a missing one is a ResumeError,
        and so is a shard whose restored identity differs (checked before its first read)."""
        if index in self._unverified:
            self._check_identity(index, f"read again by key from offset {offsets[0]}", self._identities[index])
            self._unverified.discard(index)
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
                index, offset = self._pending.popleft()
                yield (epoch, index, offset), record
        while True:
            if not self._remaining and self._position is not None:  # the next shard, from the position
                self._remaining = self._remaining_at(self._current(), self._slot, self._position, self._dealt)
            if not self._remaining:
                return
            entry = self._remaining[0]
            if entry[0] in self._unverified:  # before the shard's first record is read
                self._check_identity(entry[0], f"cursor at offset {entry[1]}", self._identities[entry[0]])
                self._unverified.discard(entry[0])
            elif entry[1] == 0 and self._identity is not None:
                identity = self._take_identity(entry[0])
                if identity is not None:
                    self._identities[entry[0]] = identity
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
        self._pending, self._identities, self._unverified, self._dealt = deque(), {}, set(), ()
        self._entered = {}
        self._pieces = (len(self.shards),)  # a new epoch's order covers every shard
        if self.sizes is None:
            self._remaining = [[index, 0] for index in self.shard_order(epoch)[s::num_slots]]
        else:
            self._remaining, self._position = self._remaining_at(self._current(), self._slot, 0, ()), 0

    def _state(
        self,
        order: EpochOrder,
        slot: Slot,
        remaining: Sequence[Sequence[int]],
        pending: Sequence[Sequence[int]],
        identities: Mapping[int, str],
        position: int | None = None,
        dealt: Dealt = (),
    ) -> dict[str, Any]:
        epoch, pieces = order
        grown = pieces != (len(self.shards),)
        state: dict[str, Any] = {
            VERSION: GROWN_STATE_VERSION if grown else STREAM_STATE_VERSION,
            EPOCH: epoch,
            SEED: self.seed,
            SHUFFLE: self.shuffle,
            NUM_SHARDS: len(self.shards),
            SHARDS_DIGEST: self._digest,
            SLOT: slot[0],
            NUM_SLOTS: slot[1],
        }
        if grown:
            state[EPOCH_SHARDS] = list(pieces)
        if self._sizes_digest is not None:
            state[SIZES_DIGEST] = self._sizes_digest
        if position is not None:
            state[POSITION] = position
            if dealt:
                state[DEALT] = [[num_slots, list(positions)] for num_slots, positions in dealt]
        else:
            state[REMAINING] = [[i, self._names[i], c] for i, c in remaining]
        state[PENDING] = [[i, o] for i, o in pending]
        state[IDENTITIES] = {str(i): identity for i, identity in identities.items()}
        return state

    def state_dict(self) -> dict[str, Any]:
        # A shard just finished keeps its identity while a window above holds its records (seek).
        return self._state(
            self._current(), self._slot, self._remaining, self._pending, self._identities, self._position, self._dealt
        )

    def _parse(self, state: Any) -> tuple[int, Slot, list[list[int]], list[list[int]]]:
        """Validate a state against this shard list: (epoch, slot, remaining, pending)."""
        return self._parse_all(state)[:4]

    def _parse_all(
        self, state: Any
    ) -> tuple[int, Slot, list[list[int]], list[list[int]], int | None, dict[int, str], Dealt, tuple[int, ...]]:
        """Validate a state: (epoch, slot, remaining, pending, position or None, identities, dealt, and
        the pieces the epoch's shard order is built over), with shards appended since the checkpoint
        taken in as ``growth`` says."""
        state = require_mapping(state, _WHAT)
        version = require_int(state, VERSION, _WHAT)
        if version != GROWN_STATE_VERSION:
            check_version(state, STREAM_STATE_VERSION, _WHAT)
        epoch = require_epoch(state, _WHAT)
        check_same(_WHAT, SEED, state.get(SEED), self.seed, "build the pipeline with the checkpoint's seed")
        check_same(
            _WHAT, SHUFFLE, require_bool(state, SHUFFLE, _WHAT), self.shuffle, "build it with the checkpoint's shuffle"
        )
        n = len(self.shards)
        saved_n = self._check_shard_list(state)
        pieces = (
            require_pieces(state, EPOCH_SHARDS, _WHAT, at_most=saved_n)
            if version == GROWN_STATE_VERSION
            else (saved_n,)
        )
        appended_from = None  # where the piece appended by this restore starts in the epoch's order
        if saved_n < n:
            grown = grown_pieces(self.growth, pieces, n, exhausted=False)
            appended_from, pieces = (pieces[-1] if grown != pieces else None), grown
        order = (epoch, pieces)
        num_slots = require_count(state, NUM_SLOTS, _WHAT)
        slot = require_count(state, SLOT, _WHAT)
        if slot >= num_slots:
            raise ResumeError(f"{_WHAT} state has slot {slot} but only {num_slots} slots")
        position: int | None = None
        dealt: Dealt = ()
        remaining: list[list[int]] = []
        remaining_raw: Any = []
        if POSITION in state:
            if self.sizes is None:
                raise ResumeError(
                    f"{_WHAT} state holds a {POSITION!r}, which needs the shards' sizes; pass the checkpoint's sizes="
                )
            position = require_count(state, POSITION, _WHAT)
            dealt = _require_dealt(state.get(DEALT, []))
            total = int(self._slot_layout(order, (slot, num_slots), dealt).starts[-1])
            if position > total:
                raise ResumeError(
                    f"{_WHAT} state is at position {position} of slot {slot}, but that slot's shards hold {total} "
                    "records; pass a state_dict() of this pipeline unchanged"
                )
            remaining = self._remaining_at(order, (slot, num_slots), position, dealt)  # computed: nothing to check
        else:
            remaining_raw = state.get(REMAINING)
        pending_raw = state.get(PENDING)
        if not isinstance(remaining_raw, list) or not isinstance(pending_raw, list):
            raise ResumeError(f"{_WHAT} state fields {REMAINING!r} and {PENDING!r} must be lists")
        for entry in remaining_raw:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and is_int(entry[0]) and is_int(entry[2])):
                raise ResumeError(f"{_WHAT} state: a remaining shard must be [index, name, cursor], got {brief(entry)}")
            index, name, cursor = entry
            if not 0 <= index < saved_n or not isinstance(name, str) or self._names[index] != name:
                current = repr(self._names[index]) if 0 <= index < saved_n else "no such shard"
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
            raise ResumeError(f"{_WHAT} state lists a shard twice in {REMAINING!r}: {brief(remaining_raw)}")
        if position is None and appended_from is not None:
            # This slot's share of the appended piece, dealt as the epoch's order deals its shards.
            new = self._order_array(order)[appended_from:]
            remaining += [[index, 0] for index in new[(slot - appended_from) % num_slots :: num_slots].tolist()]
        cursors = self._cursors(order, (slot, num_slots), remaining, position, dealt)
        pending = parse_pending(pending_raw, saved_n, cursors, NO_CURSOR)  # None: refused or unusual, see below
        if pending is None:
            pending = []
            for entry in pending_raw:
                if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and all(is_int(v) for v in entry)):
                    raise ResumeError(
                        f"{_WHAT} state: a pending record must be [shard index, offset], got {brief(entry)}"
                    )
                _check_record(entry[0], entry[1], saved_n, cursors, lambda: "pending record")
                pending.append([entry[0], entry[1]])
            if len({(i, o) for i, o in pending}) != len(pending):
                raise ResumeError(f"{_WHAT} state lists a record twice in {PENDING!r}: {brief(pending_raw)}")
        identities_raw = state.get(IDENTITIES, {})
        if not isinstance(identities_raw, Mapping):
            raise ResumeError(f"{_WHAT} state field {IDENTITIES!r} must be a dict, got {brief(identities_raw)}")
        identities: dict[int, str] = {}
        for key, identity in identities_raw.items():
            index = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 20 else -1
            # Shards being read, and shards whose records a stage above holds (finished ones too).
            if not 0 <= index < saved_n or not isinstance(identity, str):
                raise ResumeError(
                    f"{_WHAT} state: {IDENTITIES!r} has {brief(key)}: {brief(identity)}, but an identity is a string "
                    f"by shard index (0..{saved_n - 1}); pass a state_dict() of this pipeline unchanged"
                )
            identities[index] = identity
        return epoch, (slot, num_slots), remaining, pending, position, identities, dealt, pieces

    def _check_shard_list(self, state: Mapping[str, Any]) -> int:
        """Refuse a state whose shard list is not this one, or (with ``growth``) a prefix of it, by
        names and sizes; return the checkpoint's number of shards."""
        n = len(self.shards)
        saved_n = require_int(state, NUM_SHARDS, _WHAT, minimum=1)
        if saved_n > n or (saved_n < n and self.growth == ERROR):
            remedy = (
                "shards may be appended since a checkpoint (growth=), but not removed"
                if saved_n > n
                else "to read the appended shards, build the ShardedIterable with growth='next_epoch' (they join "
                "at the next epoch) or growth='append' (they join the rest of this epoch)"
            )
            raise ResumeError(
                f"{_WHAT} number of shards changed: checkpoint has {saved_n}, pipeline has {n}; pass the "
                f"checkpoint's shard list, in its order; {remedy}"
            )
        check_same(
            _WHAT,
            "shard list (digest of the names)",
            state.get(SHARDS_DIGEST),
            self._prefix_digest(saved_n),
            "pass the checkpoint's shard list, in its order"
            + (f" (its {saved_n} shards first, then the appended ones)" if saved_n < n else ""),
        )
        check_same(
            _WHAT,
            "shard sizes (digest)",
            state.get(SIZES_DIGEST),
            self._prefix_sizes_digest(saved_n),
            "pass the checkpoint's sizes= (the same record count for every shard)",
        )
        return saved_n

    def _prefix_digest(self, count: int) -> str:
        """The digest of the first ``count`` shard names (what a checkpoint with that many shards holds)."""
        if count == len(self._names):  # the usual case, computed once at construction
            return self._digest
        if count not in self._prefix_digests:
            self._prefix_digests[count] = hashlib.sha256("\n".join(self._names[:count]).encode()).hexdigest()[:16]
        return self._prefix_digests[count]

    def _prefix_sizes_digest(self, count: int) -> str | None:
        """The digest of the first ``count`` shard sizes (None without sizes=)."""
        if self.sizes is None:
            return None
        if count == len(self.sizes):
            return self._sizes_digest
        if count not in self._prefix_sizes:
            self._prefix_sizes[count] = hashlib.sha256(self._size_array[:count].tobytes()).hexdigest()[:16]
        return self._prefix_sizes[count]

    def _check_identity(self, index: int, where: str, saved: str) -> None:
        """Refuse a shard read again (``where``: from its cursor, or by key) that is not the file the
        checkpoint read."""
        now = self.identity(index)
        if now is not None and now != saved:
            raise ResumeError(
                f"shard {index} {self._names[index]!r} ({where}) changed since the checkpoint: it was {saved} "
                f"(size:digest of its edges), it is {now} now; resuming would skip or repeat records. "
                "Restore the shard the checkpoint read, or pass allow_changed_shards=True to ShardedIterable "
                "to read it as it is"
            )

    def _reads(self, state: Mapping[str, Any] | None) -> tuple[int | None, np.ndarray, set[tuple[int, int]]]:
        """What a checked ``state`` has read: its epoch, the cursors of its partly read shards (see
        ``_cursors``) and its pending records (None, no cursors, nothing without a state)."""
        if state is None:
            return None, np.full(len(self.shards), NO_CURSOR, dtype=np.int64), set()
        epoch, slot, remaining, pending, position, _, dealt, pieces = self._parse_all(state)
        cursors = self._cursors((epoch, pieces), slot, remaining, position, dealt)
        return epoch, cursors, {(i, o) for i, o in pending}

    def key_checker(self, state: Mapping[str, Any] | None) -> Callable[[Key], None]:
        return self._key_check(*self._reads(state))

    def _key_check(
        self, epoch: int | None, cursors: np.ndarray, pending: set[tuple[int, int]]
    ) -> Callable[[Key], None]:
        n = len(self.shards)

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

    def keys_checker(self, state: Mapping[str, Any] | None) -> Callable[[Sequence[Key]], None]:
        epoch, cursors, pending = self._reads(state)  # the state parsed once for both checks
        check = self._key_check(epoch, cursors, pending)
        n = len(self.shards)
        cursor_of = np.where(cursors == NO_CURSOR, np.iinfo(np.int64).max, cursors)  # no cursor: any offset

        def check_all(keys: Sequence[Key]) -> None:
            # The keys as one array, checked with a few vector comparisons; anything unusual (a
            # key of another shape or type, an int beyond int64, a refusal) goes key by key
            # through ``check``, which decides and names the first bad key.
            array = _as_array(keys)
            if array is None or not _plausible(array, epoch, n, cursor_of, pending):
                for key in keys:
                    check(key)

        return check_all

    def saved_slots(self, state: Mapping[str, Any]) -> list[Slot]:
        return [self._parse(state)[1]]

    def appends(self, state: Mapping[str, Any]) -> bool:
        # The restored epoch's order takes the shards appended since as a new piece (_parse_all).
        return self.growth == APPEND and require_int(state, NUM_SHARDS, _WHAT, minimum=1) < len(self.shards)

    def check(self, state: Any) -> Callable[[], None]:
        epoch, slot, remaining, pending, position, identities, dealt, pieces = self._parse_all(state)

        def apply() -> None:
            self._epoch, self._slot, self._remaining, self._pending = epoch, slot, remaining, deque(pending)
            self._position, self._identities, self._dealt = position, dict(identities), dealt
            self._entered = dict(identities)
            self._pieces = pieces
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
        order = (epoch, parsed[0][7])
        if any(p[7] != order[1] for p in parsed):
            raise ResumeError(
                f"{_WHAT}: the slots' states have epoch orders over different shard counts "
                f"{sorted({p[7] for p in parsed})[:5]} ({EPOCH_SHARDS!r}); were they saved at different times?"
            )
        records = [entry for p in parsed for entry in p[3]]
        for key in pending:
            if key[0] != epoch or len(key) != 3:
                raise ResumeError(f"{_WHAT}: pending record {brief(list(key))} is not a record of epoch {epoch}")
            records.append([key[1], key[2]])
        old = [(p[1], p[4], p[6]) for p in parsed]  # slot, position, dealt
        dealt = old[0][2]
        if all(position is not None and d == dealt for _, position, d in old) and [s for s, _, _ in old] == [
            (s, len(old)) for s in range(len(old))
        ]:
            return self._deal_positions(
                order, dealt, [position or 0 for _, position, _ in old], num_slots, records, identities
            )
        remaining = [entry for p in parsed for entry in self._listed(order, p[1], p[2], p[4], p[6])]
        if len({i for i, _ in remaining}) != len(remaining):
            raise ResumeError(
                f"{_WHAT}: a shard is unfinished in two slots' states; were they saved at different times?"
            )
        rank = {index: position for position, index in enumerate(self._order_array(order).tolist())}
        remaining.sort(key=lambda entry: rank[entry[0]])
        return [
            self._state(
                order,
                (s, num_slots),
                remaining[s::num_slots],
                records[s::num_slots],
                _held_identities(identities, remaining[s::num_slots] + records[s::num_slots]),
            )
            for s in range(num_slots)
        ]

    def _listed(
        self, order: EpochOrder, slot: Slot, remaining: list[list[int]], position: int | None, dealt: Dealt
    ) -> list[list[int]]:
        """Every shard this slot has yet to finish with its cursor, listed (for a listed rebalance)."""
        if position is None:
            return remaining
        layout = self._slot_layout(order, slot, dealt)
        first = int(np.searchsorted(layout.starts, position, side="right")) - 1
        listed = [[int(i), int(o)] for i, o in zip(layout.shards[first:], layout.firsts[first:], strict=True)]
        if listed:
            listed[0][1] += position - int(layout.starts[first])
        return listed

    def _deal_positions(
        self,
        order: EpochOrder,
        dealt: Dealt,
        positions: list[int],
        num_slots: int,
        records: list[list[int]],
        identities: Mapping[int, str],
    ) -> list[dict[str, Any]]:
        """States for ``num_slots`` new slots dealing what old slots at ``positions`` left unread: a
        position each (0) plus the layout change, computed, not listed."""
        dealt = (*dealt, (len(positions), tuple(positions)))
        shards = self._sequence(order, dealt)[0]
        held = np.fromiter(identities, dtype=np.int64, count=len(identities))
        states = []
        for s in range(num_slots):
            mine = {i: identities[i] for i in held[np.isin(held, shards[s::num_slots])].tolist()}
            mine.update(_held_identities(identities, records[s::num_slots]))  # pending records' shards
            states.append(self._state(order, (s, num_slots), [], records[s::num_slots], mine, 0, dealt))
        return states

    # -- the positional capability (streams.positional.Positional): the shuffles' fast paths ---------
    def positional(self) -> Positional | None:
        """This source itself when its sizes are known (see :meth:`slot_length` for when a position
        can be used); None without ``sizes=``."""
        return self if self.sizes is not None else None

    def take_pending(self, count: int) -> list[Key]:
        """The keys of the next ``count`` pending records, moved past unread (a window fetches them)."""
        taken = [self._pending.popleft() for _ in range(min(count, len(self._pending)))]
        return [(self._epoch, index, offset) for index, offset in taken]

    def saved_position(self, state: Mapping[str, Any]) -> int | None:
        """The position of a checked ``state``; None when it lists cursors."""
        position = state.get(POSITION)
        return None if position is None else int(position)

    def split_pending(self, state: Mapping[str, Any], count: int) -> tuple[list[Key], dict[str, Any]] | None:
        """The keys of a checked ``state``'s first ``count`` pending records and the state without them."""
        pending = state[PENDING]
        if len(pending) < count:
            return None
        return [(state[EPOCH], index, offset) for index, offset in pending[:count]], {**state, PENDING: pending[count:]}


class _Layout(NamedTuple):
    """A slot's shards in reading order, with known sizes (see ``ShardedIterable._slot_layout``)."""

    shards: np.ndarray  # shard indices in reading order
    starts: np.ndarray  # the position where each one starts, plus the slot's total
    firsts: np.ndarray  # the offset each one is read from (its cursor at a layout change, else 0)


def _held_identities(identities: Mapping[int, str], entries: Iterable[Sequence[int]]) -> dict[int, str]:
    """The identities of the shards of ``entries`` (``[shard index, cursor or offset]`` each)."""
    return {entry[0]: identities[entry[0]] for entry in entries if entry[0] in identities}


def _require_dealt(raw: Any) -> Dealt:
    """Read the ``"dealt"`` field: ``[[old number of slots, [a position per old slot]], ...]``."""
    if not isinstance(raw, list):
        raise ResumeError(f"{_WHAT} state field {DEALT!r} must be a list, got {brief(raw)}")
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
                f"{_WHAT} state field {DEALT!r}: each layout change must be [number of slots, [a position per slot]], "
                f"got {brief(entry)}; pass a state_dict() of this pipeline unchanged"
            )
        dealt.append((int(entry[0]), tuple(int(p) for p in entry[1])))
    return tuple(dealt)


def _as_array(keys: Sequence[Key]) -> np.ndarray | None:
    """``keys`` as an ``(n, 3)`` int64 array, or None unless every key is three plain ints that fit."""
    flat: Iterable[int]
    if isinstance(keys, PlainKeys) and keys.width == 3:  # the types checked by the stage that parsed them
        flat = itertools.chain.from_iterable(keys)
    else:
        if set(map(len, keys)) != {3}:
            return None
        flat = list(itertools.chain.from_iterable(keys))
        if set(map(type, flat)) != {int}:
            return None
    try:
        return np.fromiter(flat, dtype=np.int64, count=3 * len(keys)).reshape(-1, 3)
    except OverflowError:
        return None


def _plausible(
    keys: np.ndarray, epoch: int | None, n: int, cursor_of: np.ndarray, pending: set[tuple[int, int]]
) -> bool:
    """Whether every ``[epoch, shard, offset]`` row of ``keys`` passes the checks of ``key_checker``."""
    if not len(keys):
        return True
    epochs, index, offset = keys[:, 0], keys[:, 1], keys[:, 2]
    if epoch is not None and not (epochs == epoch).all():
        return False
    if not ((index >= 0) & (index < n) & (offset >= 0)).all():
        return False
    if not (offset < cursor_of[index]).all():
        return False
    return not pending or pending.isdisjoint(zip(index.tolist(), offset.tolist(), strict=True))


def _check_record(index: int, offset: int, n: int, cursors: np.ndarray, what: Callable[[], str]) -> None:
    """Refuse a record (already read: buffered or pending) that cannot exist or was not read yet;
    ``cursors`` is ``_cursors``'s array (a cursor by shard index).

    A record of a shard that is still being read lies before that shard's cursor; whether a
    finished shard has it only a read can tell (the reader then raises a ResumeError). ``what``
    names the record for the message; it is called only on a refusal, because a restore checks a
    whole shuffle buffer of keys and formatting each one would cost more than the check.
    """
    if not 0 <= index < n:
        raise ResumeError(f"{_WHAT} state: {what()} names shard {brief(index)}, but there are {n} shards (0..{n - 1})")
    if not 0 <= offset <= MAX_COUNT:
        raise ResumeError(f"{_WHAT} state: {what()} has an offset {brief(offset)} outside [0, 2**63) in shard {index}")
    whole = int(index)  # a key may hold any number equal to a shard index (1.0, True), as a dict lookup took it
    cursor = int(cursors[whole]) if whole == index else NO_CURSOR
    if cursor != NO_CURSOR and offset >= cursor:
        raise ResumeError(
            f"{_WHAT} state: {what()} is at offset {brief(offset)} of shard {index}, which is read only up to its "
            f"cursor {cursor}: that record was not read yet; pass a state_dict() of this pipeline unchanged"
        )
