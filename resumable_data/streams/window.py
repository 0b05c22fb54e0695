"""ShuffleWindow: a shuffle whose state is a position: windows of records, each in a keyed permutation.

A shuffle buffer's contents depend on every draw made, so its state must list them and a restore
must re-read them. ``shuffle_window(size, seed=...)`` cuts the stream into consecutive windows of
``size`` records instead (the last one shorter) and yields window ``w`` of epoch ``e`` in the order
of ``Permutation(len(window), hash_ints(seed, w), e)``. What it holds is then a few integers: the
window's number, its length and how many of its records were handed out.

Two ways to read a window, chosen per window:

* **By position** when the source is a :class:`ShardedIterable` with known ``sizes`` (and is
  reading its own shards in order, i.e. not right after a layout change): a record's key follows
  from its position in the slot's shards, so the window is never read as a whole. Each record is
  fetched by key when the permutation reaches it (a batch's worth per grouped read); the source
  state is its position after the window. A restore reads only the records it hands out.
* **By reading** otherwise (text shards, ``map``/``filter``/``mix`` sources): the window's records are
  read from the source into memory; the state holds the source's state at the window's start,
  and a restore re-reads that one window.

State: ``{"seed", "size", "window": windows begun this epoch, "count": records in the open
window (0: none open), "taken": records of it handed out, "positional": how it is read, "source":
{...}}``. A layout change (another ``num_workers`` or world size) is exact for windows read by
position: the open window's records not handed out yet go back to the sources as pending records,
which each new slot reads first, as windows of their own (by reading), and then its dealt shards
by position again. Such a window of pending records is split the same way at a later change (its
records are the first pending ones of the state at its start), so changes chain (2 -> 1 -> 2
ranks). Any other window read by reading cannot be split; the state then must be taken between
windows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..core.hash import hash_ints
from ..core.permutation import Permutation
from ..core.state import SEED, brief, check_int_arg, is_int, require_bool
from ..errors import ResumeError
from .base import EPOCH, SOURCE, Key, Stream, Wrapper, check_reread_growth, check_same, record_key, require_count
from .sharded import PENDING, POSITION, ShardedIterable

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
        self._start: dict[str, Any] | None = None  # read windows: the source state at the window's start
        self._records: list[tuple[Key, Any]] | None = None  # read windows: its records (None: re-read them)
        self._permutation: tuple[tuple[int, int, int, int], Permutation] | None = None  # the open window's order

    def _positional_source(self) -> ShardedIterable | None:
        source = self.source
        if isinstance(source, ShardedIterable) and source.slot_length() is not None:
            return source
        return None

    def _read_size(self) -> int:
        """Records of the next window read by reading: a sharded source with sizes that has pending
        records (held at a layout change) reads them as windows of their own, then by position."""
        source = self.source
        if isinstance(source, ShardedIterable) and source.position is not None and source.pending_count:
            return min(self.size, source.pending_count)
        return self.size

    def _order(self, start: int, stop: int) -> np.ndarray:
        """Positions inside the open window of its ``start``-th to ``stop``-th records handed out."""
        which = (self._count, self.seed, self._window, self._epoch)
        if self._permutation is None or self._permutation[0] != which:
            # One per window, not per chunk: a window of up to 2**14 records is an exact keyed
            # shuffle whose table is built on first use, O(window) each time it is built.
            self._permutation = (
                which,
                Permutation(self._count, hash_ints(self.seed, self._window - 1) >> 1, self._epoch),
            )
        return self._permutation[1](np.arange(start, stop, dtype=np.int64))

    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        records: Iterator[tuple[Key | None, Any]] | None = None  # the source's, for read windows
        while True:
            if self._taken >= self._count:  # open the next window
                positional = self._positional_source()
                if positional is not None:
                    position, length = positional.position or 0, positional.slot_length() or 0
                    count = min(self.size, length - position)
                    if count <= 0:
                        return
                    positional.seek(position + count)
                    self._start, self._records = None, None
                else:
                    start = self.source.state_dict()
                    records = self.source.iter_keyed() if records is None else records
                    window = [(record_key(k, _WHAT), v) for k, v in take_records(records, self._read_size())]
                    if not window:
                        return
                    # Saved with the identities of the shards the window entered: a restore re-reads it
                    # from there and checks them (computed once: the window is read whole here).
                    count, self._start, self._records = len(window), self.source.with_identities(start), window
                self._window, self._count, self._taken, self._positional = (
                    self._window + 1,
                    count,
                    0,
                    positional is not None,
                )
            if self._positional:
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
        """The open positional window's records from ``taken`` on, fetched a chunk at a time."""
        source = self.source
        if not isinstance(source, ShardedIterable) or source.position is None:
            raise ResumeError(f"{_WHAT}: a window read by position needs a ShardedIterable with sizes=")
        first = source.position - self._count
        while self._taken < self._count:
            stop = min(self._count, self._taken + FETCH_AHEAD)
            keys = source.keys_at(self._order(self._taken, stop) + first)
            for key, record in zip(keys, source.fetch_many(keys), strict=True):
                self._taken += 1
                yield key, record

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
        state = super().state_dict()
        if self._open() and not self._positional and self._start is not None:
            state[SOURCE] = self._start  # a read window restores from its start and re-reads it
        return state

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
        source_position = state[SOURCE].get(POSITION)
        if count and positional and not (isinstance(self.source, ShardedIterable) and is_int(source_position)):
            raise ResumeError(
                f"{_WHAT} state reads its window by position, but its source is not a ShardedIterable with sizes=; "
                "build the pipeline as the checkpoint's"
            )
        if count and positional and source_position < count:
            raise ResumeError(
                f"{_WHAT} state has a window of {count} records ending at position {source_position}; "
                "pass a state_dict() of this pipeline unchanged"
            )
        start = dict(state[SOURCE]) if count and not positional else None
        if start is not None:
            check_reread_growth(_WHAT, self.source, start)

        def apply() -> None:
            self._window, self._count, self._taken, self._positional = window, count, taken, positional
            self._start, self._records = start, None

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
        sharded = self.source if isinstance(self.source, ShardedIterable) else None
        for state in states:
            count, taken, source = state[COUNT], state[TAKEN], state[SOURCE]
            if count:
                permutation = Permutation(count, hash_ints(self.seed, state[WINDOW] - 1) >> 1, state[EPOCH])
                order = permutation(np.arange(taken, count, dtype=np.int64))
                sized = sharded is not None and POSITION in source
                if sharded is not None and sized and state[POSITIONAL]:
                    held.extend(sharded.keys_at(order + (source[POSITION] - count), source))
                elif sized and count <= len(source[PENDING]):
                    # A window read from the records held back at an earlier layout change: the first
                    # ``count`` pending records of the state at its start (see _read_size).
                    pending_records = source[PENDING]
                    held.extend((state[EPOCH], *pending_records[p]) for p in order.tolist())
                    state = {**state, SOURCE: {**source, PENDING: pending_records[count:]}}
                else:
                    raise ResumeError(
                        f"{_WHAT}: a window read from its source cannot be split over another number of workers or "
                        "ranks; only shuffle_window directly over a ShardedIterable with sizes= can (its windows are "
                        "read by position). Resume with the checkpoint's num_workers and world_size, or build the "
                        "pipeline so (map after the shuffle)"
                    )
            split.append(state)
        return super().rebalance(split, num_slots, pending + held)


def take_records(records: Iterator[tuple[Key | None, Any]], n: int) -> list[tuple[Key | None, Any]]:
    """The next ``n`` records (fewer at the end), without reading one more than needed."""
    window = []
    for item in records:
        window.append(item)
        if len(window) == n:
            break
    return window
