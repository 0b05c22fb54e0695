"""The ShardedIterable class: the seekable source of a stream pipeline (see the package docstring).

The class keeps the live position of its slot and reads; the state value, the layout arithmetic,
the key checks and the layout change live in the sibling modules.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ...core.growth import APPEND, ERROR, check_growth
from ...core.state import check_int_arg, require_int
from ...errors import ResumeError
from ...storage.files import expand_shards, is_url
from ..base import EPOCH, Key, Slot, Stream, fetch_grouped
from ..epoch_positions import EpochPositions
from ..pending import NO_RECORDS, record_keys
from ..positional import Positional
from ..shard_index import ShardIndex
from .checks import Reads, key_check, keys_check
from .identities import ShardIdentities
from .keys import DEALT, IDENTITIES, NUM_SHARDS, NUM_SLOTS, PENDING, POSITION, REMAINING, SLOT, WHAT
from .layout import NO_CURSOR, Dealt, Layout
from .plans import Plans
from .reading import at_once, read_at, reads_concurrently, records_from, resolve_sizes, waits_on_network
from .rebalance import rebalance
from .shards import Shards
from .state import ShardState

__all__ = ["ShardedIterable"]


class ShardedIterable(Stream):
    """Records of many shards, shard order shuffled per epoch, restorable in O(1) per shard.

    Args:
        shards: paths, URLs (``s3://bucket/prefix/x.bin``; see :mod:`resumable_data.storage`) or
            any keys, one per shard; ``str(shard)`` names it in the state and in errors. One string
            with a glob character (``"s3://bucket/tokens/*.bin"``, ``"data/*.jsonl"``) stands for
            the files it matches, in sorted order. The list (and its order) must be the same when
            resuming, so if the data may move to another mount point, pass paths relative to a
            root that ``read_shard`` joins.
        read_shard: ``read_shard(shard, start)`` returns an iterator over the shard's records from
            record offset ``start``. A reader with a ``read_from(shard, start)`` method yielding
            ``(next offset, record)`` pairs keeps its own offsets instead (byte offsets for
            :class:`TextLineReader`). A reader may also offer ``read_records(shard, offsets)``,
            the records at those ascending offsets: a shuffle buffer's restore then opens each
            shard once (both ready-made readers do).
        shuffle: shuffle the shard order each epoch.
        seed: seed of the shard order; only ``(seed, epoch)`` decide it.
        sizes: the record count of each shard. By default (None) a reader that counts cheaply
            (:class:`RecordCounter`: :class:`TokenShardReader` from the file size,
            :class:`ParquetReader` from the footer) is asked, once, here; the state is then a
            position, not a list of cursors, and :meth:`Stream.shuffle_window` re-reads nothing
            but the records it hands out (and restores into another ``num_workers``). Since every
            shard is counted here, a missing shard fails here, and a restore refuses a shard whose
            count changed since the checkpoint (the positions would mean other records). Any other
            reader reads by per-shard cursors. ``"count"`` requires counting (a ResumeError for a
            reader that cannot); a list gives the counts (an index file); ``"unknown"`` reads by
            per-shard cursors even with a counting reader: for shards that may change between a
            checkpoint and its resume (a cursor keeps its meaning when a later shard grows), or
            that are too many or too remote to count at start. A state saved by cursors loads
            with counted sizes (and reads on from its cursors); a state saved with sizes (a
            position) needs them. Sizes need a reader whose offsets are record numbers (not
            :class:`TextLineReader`'s bytes).
        allow_changed_shards: resume even when a partly read shard's identity (size and content
            digest) differs from the checkpoint's; records may then be skipped or repeated. With
            counted sizes this reads on over a shard rewritten with as many records; a shard
            whose count changed is still refused (its position would mean other records): only a
            state saved by cursors (``sizes="unknown"``) reads on over that too.
        growth: what a restore does with a checkpoint taken on fewer shards (shards appended to the
            list since; the checkpoint's list must be its prefix, by names and sizes): ``"error"``
            (default) refuses it; ``"next_epoch"`` finishes the restored epoch over the
            checkpoint's shards and reads the new ones from the next epoch; ``"append"`` deals the
            new shards, shuffled, to the slots after the shards they still have, so they are read
            in the rest of this epoch. Shards removed, renamed or reordered are always refused.
        storage_options: fsspec's options for listing a URL pattern in ``shards`` (credentials, an
            endpoint); by default the reader's ``storage_options`` (the ready-made readers take
            them for reading).

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
        shards: Iterable[Any] | str,
        *,
        read_shard: Callable[[Any, int], Iterator[Any]],
        shuffle: bool = True,
        seed: int = 0,
        sizes: Sequence[int] | str | None = None,
        allow_changed_shards: bool = False,
        growth: str = ERROR,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if storage_options is None:
            storage_options = getattr(read_shard, "storage_options", None)
        self.shards = expand_shards(shards, storage_options)
        if not self.shards:
            raise ResumeError("ShardedIterable needs at least one shard, but got an empty shard list")
        if not callable(read_shard) and not hasattr(read_shard, "read_from"):
            raise TypeError(f"read_shard must be callable, got {type(read_shard).__name__}")
        self.sizes, counted = resolve_sizes(sizes, read_shard, self.shards)
        self.allow_changed_shards = bool(allow_changed_shards)
        self.growth = check_growth(growth)
        self.read_shard = read_shard
        self.shuffle = bool(shuffle)
        self.seed = check_int_arg("seed", seed, minimum=-(2**63))
        self._shards = Shards(
            self.shards,
            seed=self.seed,
            shuffle=self.shuffle,
            sizes=self.sizes,
            growth=self.growth,
            counted=counted,
            identity=getattr(read_shard, "identity", None),
        )
        # The shards' identities: in the state, checked after a restore, deferred by a window's opening.
        self._ids = ShardIdentities(
            self.shards,
            self._shards.names,
            getattr(read_shard, "identity", None),
            getattr(read_shard, "known_identity", None),
        )
        self._position: int | None = None  # with sizes: records this slot has read in its shards' order
        self._dealt: Dealt = ()  # with sizes: the epoch's layout changes so far (see DEALT)
        self._pieces: tuple[int, ...] = (len(self.shards),)  # what the current epoch's order is built over
        self._slot: Slot = (0, 1)
        # [shard index, cursor], the first one being read; with a position only that one (the next
        # ones follow from the position).
        self._remaining: list[list[int]] = []
        # [shard index, offset] rows (streams.pending), read-only: handed out from the top as slices.
        self._pending: np.ndarray = NO_RECORDS
        self._plans = Plans()  # the slot's next shards, told to a reader that caches them
        self._last_read = -1  # the shard fetch_many read last
        self.reset(0, None)

    @classmethod
    def from_index(
        cls,
        index: str | os.PathLike[str] | ShardIndex,
        *,
        read_shard: Any,
        storage_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> ShardedIterable:
        """The shards an index file lists (as :func:`~resumable_data.streams.write_token_shards` writes
        it), with their sizes from its token counts: no shard is opened here, and the state is a
        position, as with counted sizes (see ``sizes``).

        Args:
            index: the index file, its folder, a URL (through fsspec), or a loaded :class:`ShardIndex`.
            read_shard: a :class:`TokenShardReader` (its window and stride turn token counts into
                record counts; for ``.bin`` shards its dtype must be the index's).
            storage_options: passed to fsspec to read an index at a URL.
            **kwargs: the other arguments of ShardedIterable (``seed``, ``shuffle``, ``growth``, ...).

        Raises:
            ResumeError: the index is missing or malformed, or does not fit the reader.

        Example::

            stream = ShardedIterable.from_index("tokens/", read_shard=TokenShardReader(1025), seed=0)
        """
        loaded = ShardIndex.load(index, storage_options=storage_options)
        return cls(loaded.locations, read_shard=read_shard, sizes=loaded.records(read_shard), **kwargs)

    # -- order and reading ---------------------------------------------------------------------
    def shard_order(self, epoch: int) -> list[int]:
        """Shard indices in the order epoch ``epoch`` reads them (all slots together): for the current
        epoch as a restore may have grown it (see ``growth``), for any other over every shard."""
        return self._shards.order((epoch, self._pieces if epoch == self._epoch else (len(self.shards),))).tolist()

    def identity(self, index: int) -> str | None:
        """The reader's fingerprint of shard ``index`` as it is now (None: the reader gives none)."""
        return self._ids.ask(index)

    def _plan(self, reading: set[int] | frozenset[int] = frozenset()) -> None:
        """Tell a reader that caches the shards this slot reads from now on (see :mod:`.plans`)."""
        where = ((self._epoch, self._pieces), self._slot, self._dealt, self._position, self._remaining)
        self._plans.send(self.read_shard, self._shards, where, reading)

    # -- known sizes: a slot's position <-> (shard, cursor) -------------------------------------------
    def _here(self) -> ShardState:
        """Where this slot stands, as a state value (sharing the live lists: read it at once)."""
        return ShardState(
            self._epoch,
            self._slot,
            self._pieces,
            self._remaining,
            self._pending,
            self._ids.current,
            self._position,
            self._dealt,
        )

    def _layout(self) -> Layout:
        return self._shards.layout((self._epoch, self._pieces), self._slot, self._dealt)

    # -- the positional capability (streams.positional.Positional): the shuffles' fast paths ---------
    def positional(self) -> Positional | None:
        """This source as its own positional view when its shard sizes are known, else None (see
        :meth:`slot_length` for when a position can be used: not while pending records come first)."""
        return self if self.sizes is not None else None

    def take_pending(self, count: int) -> list[Key]:
        """The keys of the next ``count`` pending records, moved past unread (a window fetches them)."""
        taken, self._pending = self._pending[:count], self._pending[count:]
        return record_keys(self._epoch, taken)

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

    def slot_length(self) -> int | None:
        """Records this slot reads from its shards in the current epoch, when the sizes are known and
        no pending records come first (right after a layout change); else None."""
        if self._position is None or len(self._pending):
            return None
        return self._layout().total

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
        where = self._here() if state is None else ShardState.parse(state, self._shards)
        return where.layout(self._shards).keys(where.epoch, positions)

    def seek(self, position: int) -> None:
        """Continue this slot's epoch at ``position`` (records it has read), without reading anything.

        The records between the current position and ``position`` are held by the caller (a
        window that fetches them by key): the identities of their shards are kept, taken now for a
        shard entered at its start, so that a restore refuses a shard changed under them (a
        restored one is compared when the shard is next read).
        """
        self._ids.settle()
        layout = self._layout()
        start = self._position or 0
        first = layout.locate(start)
        last = layout.locate(position - 1) if position > start else first - 1
        identities, untaken = {}, []
        defer = self._ids.given and reads_concurrently(self.read_shard)
        for index in layout.shards[first : last + 1].tolist():
            identity = self._ids.current.get(index)
            remote = defer and is_url(self._shards.items[index])
            if identity is None and remote and index not in self._ids.early and self._ids.known(index) is None:
                untaken.append(index)  # asked with the window's first re-read
                continue
            if identity is None:
                identity = self._ids.take(index)
            if identity is not None:
                identities[index] = identity
        self._remaining = layout.remaining_at(position)
        self._position = position
        self._ids.current, self._ids.untaken = identities, untaken
        self._ids.unverified &= identities.keys()

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
        if self._position is None or len(self._pending) or getattr(self.read_shard, "read_records", None) is None:
            return None
        self._ids.settle()
        layout = self._layout()
        position = self._position
        stop = min(position + count, layout.total)
        if stop <= position:
            return []
        first, last = layout.locate(position), layout.locate(stop - 1)  # the shards of the first and last record
        identities = dict(self._ids.current)
        for k in range(first, last + 1):  # what iter_keyed does as it enters each shard, and leaves it
            index = int(layout.shards[k])
            entry = position - int(layout.starts[k]) + int(layout.firsts[k]) if k == first else int(layout.firsts[k])
            done = k < last or stop == int(layout.starts[k + 1])
            if index in self._ids.unverified:
                self._ids.verify(index, f"cursor at offset {entry}")
            elif entry == 0 and self._ids.given:
                # Taken for a shard the keys finish too: the buffer holds its records (with_held).
                identity = self._ids.take(index)
                if identity is not None and not done:
                    identities[index] = identity
            if done:
                identities.pop(index, None)
        keys = layout.keys(self._epoch, np.arange(position, stop, dtype=np.int64))
        self._remaining = layout.remaining_at(stop)
        self._position, self._ids.current = stop, identities
        return keys

    def upcoming_keys(self, count: int) -> list[Key] | None:
        return self._here().upcoming_keys(self._shards, count)  # computed: nothing read or moved

    def epoch_positions(self) -> EpochPositions | None:
        """The slot's epoch by position: with known sizes, an epoch whose layout did not change."""
        if self._position is None or len(self._pending) or self._dealt:
            return None  # cursors, or positions that were other slots' before a layout change
        layout = self._layout()
        return EpochPositions(layout.total, self._position, functools.partial(layout.keys, self._epoch), self._start_at)

    def _start_at(self, position: int) -> None:
        """Stand at ``position`` as reading there leaves the slot: the identity of a shard partly read."""
        self._ids.reset()
        self._remaining = self._layout().remaining_at(position)
        self._position = position
        if self._remaining and self._remaining[0][1] > 0:
            identity = self._ids.take(self._remaining[0][0])
            if identity is not None:
                self._ids.current[self._remaining[0][0]] = identity

    # -- reading -----------------------------------------------------------------------------------
    def fetch(self, key: Key) -> Any:
        return self.fetch_many([key])[0]

    def fetch_many(self, keys: Sequence[Key]) -> list[Any]:
        """Re-read ``keys`` shard by shard: each shard opened once, its offsets read in ascending order.

        A reader with ``read_records(shard, offsets)`` gets all of a shard's offsets in one call (the
        ready-made readers open the file once and slice or seek); any other reader is read in runs,
        one ``read_shard`` call per run of consecutive records. A reader that ``reads_concurrently``
        reads the shards that wait on the network at once, asking the identities still to check or
        to take alongside, and the others (local, or cached) meanwhile in this thread.
        """
        self._plan({key[1] for key in keys if key[0] == self._epoch})
        indices = {key[1] for key in keys}
        checks, untaken = sorted(indices & self._ids.unverified), self._ids.untaken
        waiting: set[int] = set()  # shards whose reads wait on the network
        together = False  # whether requests (reads, identities) are more than one: then all at once
        if reads_concurrently(self.read_shard):
            items = self._shards.items
            waiting = {index for index in indices if waits_on_network(self.read_shard, items[index])}
            together = len(waiting) + sum(is_url(items[index]) for index in (*checks, *untaken)) > 1
        if not together:
            self._ids.settle()
        last = self._last_read

        def where(index: int) -> str:
            return f"read again by key from offset {min(key[2] for key in keys if key[1] == index)}"

        def read(index: int, positions: list[int]) -> list[Any]:
            if not together:
                self._ids.verify(index, where(index))
            return read_at(self._shards, self.read_shard, index, [keys[p][2] for p in positions])

        def run(groups: Sequence[int], calls: Sequence[Callable[[], list[Any]]]) -> list[list[Any]]:
            pooled = [p for p, group in enumerate(groups) if together and group in waiting]
            # The shard read last goes first: a reader holding one shard open moves to another once, not twice.
            here = sorted(set(range(len(groups))) - set(pooled), key=lambda p: (groups[p] != last, p))
            if here:
                self._last_read = groups[here[-1]]
            if not together:
                done = {p: calls[p]() for p in here}
                return [done[p] for p in range(len(calls))]
            # Reading by position, a shard not entered yet is one the slot enters next (a window read ahead).
            ahead = self._ids.ahead(indices) if self._position is not None and not len(self._pending) else []
            asked = [functools.partial(self.identity, index) for index in [*checks, *untaken, *ahead]]
            outcomes = at_once([*asked, *(calls[p] for p in pooled)], [calls[p] for p in here])
            self._ids.answered(checks, outcomes[: len(asked)], where, ahead)
            by_position = dict(zip([*pooled, *here], outcomes[len(asked) :], strict=True))
            results = [by_position[p] for p in range(len(calls))]
            for outcome in results:
                if isinstance(outcome, BaseException):
                    raise outcome
            return results

        return fetch_grouped(keys, 1, read, run)

    def iter_keyed(self) -> Iterator[tuple[Key, Any]]:
        self._ids.settle()
        epoch = self._epoch
        if len(self._pending):
            # Records a shuffle buffer held before a layout change: re-read them together.
            keys = record_keys(epoch, self._pending)
            records = self.fetch_many(keys)
            for key, record in zip(keys, records, strict=True):
                self._pending = self._pending[1:]
                yield key, record
        while True:
            self._ids.settle()  # a seek between two records (a window above reading by position)
            if not self._remaining and self._position is not None:  # the next shard, from the position
                self._remaining = self._layout().remaining_at(self._position)
            if not self._remaining:
                return
            self._plan()
            entry = self._remaining[0]
            if entry[0] in self._ids.unverified:  # before the shard's first record is read
                self._ids.verify(entry[0], f"cursor at offset {entry[1]}")
            elif entry[1] == 0 and self._ids.given:
                identity = self._ids.take(entry[0])
                if identity is not None:
                    self._ids.current[entry[0]] = identity
            for next_offset, record in records_from(self._shards, self.read_shard, entry[0], entry[1]):
                key = (epoch, entry[0], entry[1])
                entry[1] = next_offset
                if self._position is not None:
                    self._position += 1
                yield key, record
            del self._remaining[0]
            self._ids.current.pop(entry[0], None)

    # -- epochs and state ------------------------------------------------------------------------
    def reset(self, epoch: int, slot: Slot | None) -> None:
        if slot is not None:
            self._slot = slot
        self._epoch = epoch
        s, num_slots = self._slot
        self._pending, self._dealt = NO_RECORDS, ()
        self._ids.reset()
        self._pieces = (len(self.shards),)  # a new epoch's order covers every shard
        if self.sizes is None:
            self._remaining = [[index, 0] for index in self.shard_order(epoch)[s::num_slots]]
        else:
            self._position = 0
            self._remaining = self._layout().remaining_at(0)

    def state_dict(self) -> dict[str, Any]:
        # A shard just finished keeps its identity while a window above holds its records (seek).
        self._ids.settle()
        return self._here().to_dict(self._shards)

    def check(self, state: Any) -> Callable[[], None]:
        parsed = ShardState.parse(state, self._shards)

        def apply() -> None:
            self._epoch, self._slot, self._pieces = parsed.epoch, parsed.slot, parsed.pieces
            self._remaining = [list(entry) for entry in parsed.remaining]
            self._pending = parsed.pending  # read-only: taking records slices it
            self._position, self._dealt = parsed.position, parsed.dealt
            # Compared when the shard is next read: a restore opens no shard it does not read.
            self._ids.restore(parsed.identities, check=not self.allow_changed_shards)

        return apply

    def _reads(self, state: Mapping[str, Any] | None) -> Reads:
        """What a checked ``state`` has read (nothing without a state)."""
        if state is None:
            return Reads(None, np.full(len(self.shards), NO_CURSOR, dtype=np.int64), set())
        return ShardState.parse(state, self._shards).reads(self._shards)

    def key_checker(self, state: Mapping[str, Any] | None) -> Callable[[Key], None]:
        return key_check(self._reads(state))

    def keys_checker(self, state: Mapping[str, Any] | None) -> Callable[[Sequence[Key]], None]:
        return keys_check(self._reads(state))  # the state parsed once for both checks

    def with_identities(self, state: dict[str, Any]) -> dict[str, Any]:
        self._ids.settle()
        if not self._ids.entered:
            return state
        # ``state`` is this source's own: its pending records (thousands after a layout change) need
        # no check again, only their shards.
        _, cursors, _ = self._reads({**state, PENDING: []})
        held = {entry[0] for entry in state[PENDING]}
        return self._ids.added_to(state, lambda index: cursors[index] != NO_CURSOR or index in held)

    def with_held(self, state: dict[str, Any], shards: Iterable[Key]) -> dict[str, Any]:
        self._ids.settle()
        # A held record's shard is (epoch, shard index); a shard still being read has its identity
        # in the state already, a finished one gets the identity noted when it was entered.
        held = {shard[1] for shard in shards}
        return self._ids.added_to(state, held.__contains__)

    def saved_slots(self, state: Mapping[str, Any]) -> list[Slot]:
        # A checked state (check() parsed it whole): its slot fields are ints already; parsing it
        # again would check thousands of pending records after a layout change once more.
        return [(int(state[SLOT]), int(state[NUM_SLOTS]))]

    def appends(self, state: Mapping[str, Any]) -> bool:
        # The restored epoch's order takes the shards appended since as a new piece (ShardState.parse).
        return self.growth == APPEND and require_int(state, NUM_SHARDS, WHAT, minimum=1) < len(self.shards)

    def rebalance(
        self, states: Sequence[Mapping[str, Any]], num_slots: int, pending: list[Key]
    ) -> list[dict[str, Any]]:
        parsed = [ShardState.parse(s, self._shards) for s in states]
        return [state.to_dict(self._shards) for state in rebalance(self._shards, parsed, num_slots, pending)]
