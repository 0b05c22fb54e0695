"""ShuffleWindow: a shuffle whose state is a position: windows of records, each in a keyed permutation.

A shuffle buffer's contents depend on every draw made, so its state must list them and a restore
must re-read them. ``shuffle_window(size, seed=...)`` cuts the stream into consecutive windows of
``size`` records instead (the last one shorter) and yields window ``w`` of epoch ``e`` in the order
of ``Permutation(len(window), hash_ints(seed, w), e)``. What it holds is then a few integers: the
window's number, its length and how many of its records were handed out.

Three ways to read a window, chosen per window:

* **By position** when the source is positional (:mod:`~resumable_data.streams.positional`: a
  :class:`ShardedIterable` with known ``sizes``, possibly behind ``map``) and reads its own shards
  in order: a record's key follows from its position in the slot's shards, so the window is
  never read as a whole. Each record is fetched by key when the permutation reaches it (a batch's
  worth per grouped read); the source state is its position after the window. A restore reads
  only the records it hands out.
* **By pending keys** when such a source has pending records (right after a layout change): a
  window of them, whose keys the source lists; each record is fetched by key as above. The state
  holds the source's state at the window's start (its first pending records are the window's).
* **By reading** otherwise (text shards, ``filter``/``mix`` sources): the window's records are read
  from the source into memory; the state holds the source's state at the window's start, and a
  restore re-reads that one window.

State: ``"window"``: windows begun this epoch, ``"count"``: records in the open window (0: none
open), ``"taken"``: records of it handed out, ``"positional"``: whether it is read by position,
and the source's state under ``"source"``. Two shards of known sizes, a window of 3 records of
which 2 were handed out::

    >>> from resumable_data.streams import ShardedIterable
    >>> records = {"a": [0, 1, 2, 3], "b": [4, 5, 6]}
    >>> def read(shard, start):
    ...     return iter(records[shard][start:])
    >>> stream = ShardedIterable(["a", "b"], read_shard=read, seed=0, sizes=[4, 3]).shuffle_window(3, seed=0)
    >>> reading = iter(stream)
    >>> [next(reading) for _ in range(2)]
    [4, 5]
    >>> {key: value for key, value in stream.state_dict().items() if key != "source"}
    {'version': 2, 'epoch': 0, 'seed': 0, 'size': 3, 'window': 1, 'count': 3, 'taken': 2, 'positional': True}

A layout change (another ``num_workers`` or world size) is exact for
windows read by position: the open window's records not handed out yet go back to the sources as
pending records, which each new slot reads first, as windows of their own (by pending keys), and
then its dealt shards by position again. Such a window of pending records is split the same way at
a later change (its records are the first pending ones of the state at its start), so changes chain
(2 -> 1 -> 2 ranks). A window read by reading cannot be split; the state then must be taken between
windows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..core.hash import hash_ints
from ..core.permutation import Permutation
from ..core.state import SEED, VERSION, brief, check_int_arg, require_bool
from ..errors import ResumeError
from .base import EPOCH, SOURCE, STREAM_STATE_VERSION, Key, Stream, check_same, record_key, require_count
from .epoch_positions import EpochPositions
from .positional import Positional
from .wrapper import Wrapper, check_reread_growth

__all__ = ["ShuffleWindow"]

_WHAT = "shuffle_window"
SIZE = "size"
WINDOW = "window"
COUNT = "count"
TAKEN = "taken"
POSITIONAL = "positional"
FETCH_AHEAD = 64  # records fetched together when a window is read by position


class ShuffleWindow(Wrapper):
    """Shuffle within consecutive windows of ``size`` records; the state is a few integers.

    Use it where a shuffle buffer's state (every buffered key) or its restore (re-reading the
    buffer) costs too much; see the README for how the two mix records.

    Example::

        sizes = [reader.num_records(p) for p in paths]  # or from an index file
        stream = ShardedIterable(paths, read_shard=reader, sizes=sizes).shuffle_window(10_000, seed=0)
        state = stream.state_dict()  # a few ints: no keys, no cursors
        stream.load_state_dict(state)  # reads only the records it hands out next
    """

    POSITION_KEYS = frozenset({EPOCH, WINDOW, COUNT, TAKEN, POSITIONAL})

    def __init__(self, source: Stream, size: int, *, seed: int = 0) -> None:
        super().__init__(source)
        if not source.keyed:
            raise TypeError("shuffle_window shuffles records; apply it before batch()")
        self.size = check_int_arg("size", size, minimum=1)
        self.seed = check_int_arg("seed", seed, minimum=-(2**63))
        source.expect_rereads()  # a restore fetches the open window's records, or reads it again
        self._reset_own()

    def _reset_own(self) -> None:
        self._window = 0  # windows begun in this epoch
        self._count = 0  # records in the open window; 0: none open
        self._taken = 0
        self._positional = False
        self._start: dict[str, Any] | None = None  # read and pending windows: the source state at their start
        self._keys: list[Key] | None = None  # pending windows: their records' keys (None: take them again)
        self._records: list[tuple[Key, Any]] | None = None  # read windows: its records (None: re-read them)
        self._permutation: tuple[tuple[int, int, int, int], Permutation] | None = None  # the open window's order
        self._ahead: tuple[int, list[Key], list[Any]] | None = None  # the next window's first records, read ahead

    def _pending_view(self, count: int) -> Positional | None:
        """The source's positional view when it has at least ``count`` pending records (and at least
        one) to read as a window by key, else None."""
        view = self.source.positional()
        if view is None or view.position is None or not 0 < count <= view.pending_count:
            return None
        return view

    def _order(self, start: int, stop: int) -> np.ndarray:
        """Positions inside the open window of its ``start``-th to ``stop``-th records handed out."""
        return self._window_order(self._count, self._window)(np.arange(start, stop, dtype=np.int64))

    def _window_order(self, count: int, window: int) -> Permutation:
        """The order of window ``window`` of ``count`` records in this epoch, kept for the next chunks."""
        which = (count, self.seed, window, self._epoch)
        if self._permutation is None or self._permutation[0] != which:
            # One per window, not per chunk: a window of up to 2**14 records is an exact keyed
            # shuffle whose table is built on first use, O(window) each time it is built.
            self._permutation = (which, window_permutation(count, self.seed, window, self._epoch))
        return self._permutation[1]

    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        records: Iterator[tuple[Key | None, Any]] | None = None  # the source's, for read windows
        while True:
            if self._taken >= self._count:  # open the next window
                view = self.source.positional()
                length = None if view is None else view.slot_length()
                self._start, self._records, self._keys = None, None, None
                if view is not None and length is not None:
                    position = view.position or 0
                    count = min(self.size, length - position)
                    if count <= 0:
                        return
                    view.seek(position + count)
                else:
                    # Saved with the identities of the shards the window entered: a restore reads it
                    # again from there and checks them (computed once, when the window is opened).
                    start = self.source.state_dict()
                    pending = None if view is None else self._pending_view(min(self.size, view.pending_count))
                    if pending is not None:
                        self._keys = pending.take_pending(min(self.size, pending.pending_count))
                        count = len(self._keys)
                    else:
                        records = self.source.iter_keyed() if records is None else records
                        self._records = [(record_key(k, _WHAT), v) for k, v in take_records(records, self.size)]
                        count = len(self._records)
                        if not count:
                            return
                    self._start = self.source.with_identities(start)
                self._window, self._count, self._taken, self._positional = (
                    self._window + 1,
                    count,
                    0,
                    length is not None,
                )
            if not self._positional and self._records is None and self._keys is None:
                # Restored: the source stands at the window's start; its first pending records are the
                # window's when it has enough (a window of them), else the window is read again.
                pending = self._pending_view(self._count)
                if pending is not None:
                    self._keys = pending.take_pending(self._count)
            if self._positional or self._keys is not None:
                yield from self._fetched()
            else:
                if self._records is None:  # restored: the source stands at the window's start
                    records = self.source.iter_keyed() if records is None else records
                    window = [(record_key(k, _WHAT), v) for k, v in take_records(records, self._count)]
                    if len(window) != self._count:
                        raise ResumeError(
                            f"{_WHAT}: the restored window held {self._count} records but its source now yields "
                            f"{len(window)} from the window's start; the data changed since the checkpoint"
                        )
                    self._records = window
                window_records = self._records
                while self._taken < self._count:
                    stop = min(self._count, self._taken + FETCH_AHEAD)
                    for p in self._order(self._taken, stop).tolist():
                        self._taken += 1
                        yield window_records[p]

    def _fetched(self) -> Iterator[tuple[Key | None, Any]]:
        """The open window's records from ``taken`` on, read by position or by pending keys, fetched a
        chunk at a time."""
        view = self.source.positional()
        if view is None or view.position is None:
            raise ResumeError(
                f"{_WHAT}: a window read by position needs a positional source (ShardedIterable with sizes=)"
            )
        first, held = view.position - self._count, self._keys
        while self._taken < self._count:
            stop = min(self._count, self._taken + FETCH_AHEAD)
            order = self._order(self._taken, stop)
            keys = view.keys_at(order + first) if held is None else [held[p] for p in order.tolist()]
            ahead, self._ahead = self._ahead, None
            if ahead is not None and ahead[0] == self._window and ahead[1] == keys:
                records = ahead[2]
            else:
                next_keys = self._next_window_keys(view) if held is None and stop == self._count else []
                records = view.fetch_many(keys + next_keys)
                if next_keys:
                    self._ahead = (self._window + 1, next_keys, records[len(keys) :])
                    records = records[: len(keys)]
            for key, record in zip(keys, records, strict=True):
                self._taken += 1
                yield key, record

    def _next_window_keys(self, view: Positional) -> list[Key]:
        """The keys of the next window's first chunk (none at the epoch's end), read together with the
        open window's last chunk: a batch that spans two windows then waits for one read, not two
        in turn (a restore over remote shards: one round trip, not two)."""
        length = view.slot_length()
        count = 0 if length is None or view.position is None else min(self.size, length - view.position)
        if count <= 0:
            return []
        order = self._window_order(count, self._window + 1)  # kept: the window uses it once it opens
        return view.keys_at(order(np.arange(min(count, FETCH_AHEAD), dtype=np.int64)) + view.position)

    def upcoming_keys(self, count: int) -> list[Key] | None:
        """The keys of the next ``count`` records, computed: the open window's rest in its order, then
        the windows that the source's next keys make (its pending records first, in windows of their
        own), each in its order; None over a source that is not positional (windows read whole)."""
        view = self.source.positional()
        if view is None or view.position is None:
            return None
        keys: list[Key] = []
        skip, pending = 0, view.pending_count  # skip: source keys that are the open window's
        if self._open():
            permutation = window_permutation(self._count, self.seed, self._window, self._epoch)
            order = permutation(np.arange(self._taken, min(self._count, self._taken + count), dtype=np.int64))
            if self._positional:
                keys = view.keys_at(order + (view.position - self._count))
            elif self._keys is not None:  # a window of pending records, taken from the source
                keys = [self._keys[p] for p in order.tolist()]
            elif self._records is None and pending >= self._count:  # restored: its source stands at its start
                held = self.source.upcoming_keys(self._count)
                if held is None:
                    return None
                keys = [held[p] for p in order.tolist()]
                skip, pending = self._count, pending - self._count
            else:
                return None  # a window read from its source
        need = count - len(keys)
        if need <= 0:
            return keys
        # Whole windows: of the pending records first, then of the records by position.
        if need <= pending:
            ask = min(pending, -(-need // self.size) * self.size)
        else:
            ask = pending + -(-(need - pending) // self.size) * self.size
        ahead = self.source.upcoming_keys(skip + ask)
        if ahead is None:
            return None
        ahead = ahead[skip:]
        split = min(pending, len(ahead))
        window = self._window
        for part in (ahead[:split], ahead[split:]):
            for start in range(0, len(part), self.size):
                if len(keys) >= count:
                    return keys
                chunk = part[start : start + self.size]
                window += 1
                shuffled = window_permutation(len(chunk), self.seed, window, self._epoch)
                keys.extend(chunk[p] for p in shuffled(np.arange(min(len(chunk), count - len(keys)))).tolist())
        return keys

    def epoch_positions(self) -> EpochPositions | None:
        """The slot's epoch by position over a source that has it: window ``w`` (from 0) holds output
        positions ``[w*size, (w+1)*size)``, the source's positions permuted by the window's order."""
        inner = self.source.epoch_positions()
        if inner is None or (self._open() and not self._positional):
            return None  # a window read whole, or of pending records: not positions of one layout
        position = inner.position - self._count + self._taken if self._open() else inner.position
        return EpochPositions(
            inner.length,
            position,
            functools.partial(self._source_keys, inner, self._epoch),
            functools.partial(self._start_at, inner),
        )

    def _source_keys(self, inner: EpochPositions, epoch: int, positions: np.ndarray) -> list[Key]:
        """The keys at output ``positions`` of ``epoch``: each window's order mapped onto the source's."""
        positions = np.asarray(positions, dtype=np.int64)
        windows = positions // self.size
        source = np.empty_like(positions)
        for w in np.unique(windows).tolist():
            mine = windows == w
            start = w * self.size
            order = window_permutation(min(self.size, inner.length - start), self.seed, w + 1, epoch)
            source[mine] = start + order(positions[mine] - start)
        return inner.keys(source)

    def _start_at(self, inner: EpochPositions, position: int) -> None:
        """Stand at ``position`` as reading leaves the stage: the window it lies in (or, at a window's end,
        the one it ends) opened as reading opens it (the source past it, its shards' identities taken),
        with the records before ``position`` handed out."""
        self._reset_own()
        if position == 0:
            inner.start_at(0)
            return
        window = (position - 1) // self.size  # from 0: the window holding the record before the position
        start = window * self.size
        count = min(self.size, inner.length - start)
        inner.start_at(start)
        view = self.source.positional()
        if view is None:
            raise ResumeError(f"{_WHAT}: its source gives epoch positions but no positional view to seek")
        view.seek(start + count)
        taken = position - start
        if taken < count:
            self._window, self._count, self._taken, self._positional = window + 1, count, taken, True
        else:
            self._window = window + 1  # handed out whole: closed, as after its last record

    # -- state ---------------------------------------------------------------------------------
    def _open(self) -> bool:
        return self._taken < self._count

    def _own_state(self) -> dict[str, Any]:
        if not self._open():
            return {SEED: self.seed, SIZE: self.size, WINDOW: self._window, COUNT: 0, TAKEN: 0, POSITIONAL: False}
        return {
            SEED: self.seed,
            SIZE: self.size,
            WINDOW: self._window,
            COUNT: self._count,
            TAKEN: self._taken,
            POSITIONAL: self._positional,
        }

    def state_dict(self) -> dict[str, Any]:
        if self._open() and not self._positional and self._start is not None:
            # A window read in full or by pending keys restores from its start and reads it again; the
            # source's state now is not asked for (after a layout change it lists thousands of
            # pending records, and a loader takes a state after every batch).
            return {VERSION: STREAM_STATE_VERSION, EPOCH: self._epoch, **self._own_state(), SOURCE: self._start}
        return super().state_dict()

    # Whole states (Stream's default, not Wrapper's change to the source's state): a few ints and
    # the source's state, itself small with known sizes, so there is no change to send.
    state_update = Stream.state_update
    apply_update = Stream.apply_update

    def _own_state_fresh(self) -> dict[str, Any]:
        return {SEED: self.seed, SIZE: self.size, WINDOW: 0, COUNT: 0, TAKEN: 0, POSITIONAL: False}

    def _check_own(self, state: Mapping[str, Any]) -> Callable[[], None]:
        check_same(_WHAT, SEED, state.get(SEED), self.seed, "build it with the checkpoint's seed")
        check_same(_WHAT, SIZE, state.get(SIZE), self.size, "build it with the checkpoint's size")
        window = require_count(state, WINDOW, _WHAT)
        count = require_count(state, COUNT, _WHAT)
        taken = require_count(state, TAKEN, _WHAT)
        positional = require_bool(state, POSITIONAL, _WHAT)
        if count > self.size or taken > count or (count and not window):
            raise ResumeError(
                f"{_WHAT} state has {brief(taken)} of {brief(count)} records taken from window {brief(window)} "
                f"with size {self.size}; pass a state_dict() of this pipeline unchanged"
            )
        view = self.source.positional()
        source_position = None if view is None else view.saved_position(state[SOURCE])
        if count and positional:
            if source_position is None:
                raise ResumeError(
                    f"{_WHAT} state reads its window by position, but its source is not positional (a "
                    "ShardedIterable with sizes=, possibly behind map); build the pipeline as the checkpoint's"
                )
            if source_position < count:
                raise ResumeError(
                    f"{_WHAT} state has a window of {count} records ending at position {source_position}; "
                    "pass a state_dict() of this pipeline unchanged"
                )
        start = dict(state[SOURCE]) if count and not positional else None
        if start is not None:
            check_reread_growth(_WHAT, self.source, start)

        def apply() -> None:
            self._window, self._count, self._taken, self._positional = window, count, taken, positional
            self._start, self._records, self._keys, self._ahead = start, None, None, None

        return apply

    def key_checker(self, state: Mapping[str, Any] | None) -> Callable[[Key], None]:
        if state is not None and state.get(COUNT) and not state.get(POSITIONAL):
            return self.source.key_checker(None)  # its source state is the window's start
        return super().key_checker(state)

    def rebalance(
        self, states: Sequence[Mapping[str, Any]], num_slots: int, pending: list[Key]
    ) -> list[dict[str, Any]]:
        # The open window's records not handed out yet go back to the sources as pending records.
        held: list[Key] = []
        split: list[Mapping[str, Any]] = []
        view = self.source.positional()
        for state in states:
            count, taken, source = state[COUNT], state[TAKEN], state[SOURCE]
            if count:
                permutation = window_permutation(count, self.seed, state[WINDOW], state[EPOCH])
                order = permutation(np.arange(taken, count, dtype=np.int64))
                position = None if view is None else view.saved_position(source)
                first_pending = None if view is None or position is None else view.split_pending(source, count)
                if view is not None and position is not None and state[POSITIONAL]:
                    held.extend(view.keys_at(order + (position - count), source))
                elif first_pending is not None:
                    # A window of the records held back at an earlier layout change: the first
                    # ``count`` pending records of the state at its start (read by pending keys).
                    keys, rest = first_pending
                    held.extend(keys[p] for p in order.tolist())
                    state = {**state, SOURCE: rest}
                else:
                    raise ResumeError(
                        f"{_WHAT}: a window read from its source cannot be split over another number of workers or "
                        "ranks; only shuffle_window over a positional source (a ShardedIterable with sizes=, possibly "
                        "behind map) can (its windows are read by position). Resume with the checkpoint's num_workers "
                        "and world_size, or build the pipeline so (filter after the shuffle)"
                    )
            split.append(state)
        return super().rebalance(split, num_slots, pending + held)


def window_permutation(count: int, seed: int, window: int, epoch: int) -> Permutation:
    """The order of window number ``window`` (counted from 1) of ``count`` records in epoch ``epoch``."""
    return Permutation(count, hash_ints(seed, window - 1) >> 1, epoch)


def take_records(records: Iterator[tuple[Key | None, Any]], n: int) -> list[tuple[Key | None, Any]]:
    """The next ``n`` records (fewer at the end), without reading one more than needed."""
    window = []
    for item in records:
        window.append(item)
        if len(window) == n:
            break
    return window
