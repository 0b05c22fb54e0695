"""ShuffleBuffer: a shuffle buffer whose state holds the *keys* of its records, never their payloads.

The classic algorithm: fill a buffer of ``size`` records, then for each new record hand out a
buffered one chosen at random and put the new one in its place; drain the buffer at the end.
Choice number ``d`` of epoch ``e`` is ``hash_ints(seed, e, d) % len(buffer)``: a pure function of
the state, so no RNG state needs saving.

State: the draws made and the buffered records' keys (``[epoch, shard, offset]``), in buffer
order, with the source's state under ``"source"``. A buffer of 2 over two shards held in memory,
three records handed out::

    >>> from resumable_data.streams import ShardedIterable
    >>> records = {"a": [0, 1, 2, 3], "b": [4, 5, 6]}
    >>> def read(shard, start):
    ...     return iter(records[shard][start:])
    >>> stream = ShardedIterable(["a", "b"], read_shard=read, seed=0).shuffle_buffer(2, seed=0)
    >>> reading = iter(stream)
    >>> [next(reading) for _ in range(3)]
    [4, 5, 0]
    >>> {key: value for key, value in stream.state_dict().items() if key != "source"}
    {'version': 2, 'epoch': 0, 'seed': 0, 'size': 2, 'draws': 3, 'buffer': [[0, 1, 2], [0, 0, 1]]}

On restore the buffered records (here record 2 of shard "b", record 1 of shard "a") are re-read by
key into the same buffer slots, so the stream continues bitwise identically.

Shard identities. A source keeps a shard's identity in its state while it reads the shard; the
buffer may still hold records of a shard the source has finished. It counts its records by shard
(a key without its offset) as they enter and leave, and hands the source's state the shards it
holds (:meth:`~Stream.with_held`), which adds the identities of the finished ones: the restore
compares them before re-reading those records and refuses a shard changed since. The count is a
dict update per record whose shard differs from the one it replaces, a small cost beside the rest
of the per-record path (benchmarks/README.md); counting per batch from the update logs instead was
no cheaper (making the keys' shard tuples is most of the cost).
Every update carries the identities too (a few shards'), so :meth:`apply_update` adds nothing.

The state after each batch. Listing the buffer costs time in proportion to its size, far more
than a batch's records at a large buffer, so :class:`StreamLoader` (which keeps every batch's
state) asks for :meth:`~Stream.state_update` instead: the keys that entered the buffer since the
last update (``"entered"``) and the draw count then (``"since"``). Since a draw's slot is a pure
function of the draw number, :meth:`ShuffleBuffer.apply_update` replays the entries onto the
previous key list in place: fill while not full, then one draw per entry, then the draws of the
drain. Per batch both sides do work in proportion to the batch, whatever the buffer size; the
whole list is built only when a state is asked for. After a reset (a new epoch, a ``repeat``
round), or when no update was taken for more than ``size`` entries, the next update is the whole
state.

Re-reading ahead of the draws. A restore does not re-read the whole buffer before its first
record: since the choices are a pure function of the draw number, the buffer knows which slots
the next draws pick. When a draw is about to pick a slot not re-read yet, it re-reads the slots
of the next ``64`` draws in one grouped :meth:`~Stream.fetch_many` (each shard opened once per
read), then of the next 64 again, then 256, 1024, ... draws, and once a read's draws are at least
the slots left unread, every slot left (no more records than those draws could pick). So a
restore reads about what its first batches need (not ``size`` records): a first batch that needs
a little more than 64 draws reads about 128 draws' records, not 320; each buffered record is still
read exactly once, and all of them are read within about ``size`` draws; the total is a few
grouped reads instead of one (a few more shard opens). A missing or truncated shard is reported
(a ResumeError naming it) by the read that needs one of its records. A read happens before the draw
and before the source moves, so a failed one leaves the state as it was.

Filling by key. Over a positional source (:mod:`~resumable_data.streams.positional`: a
:class:`ShardedIterable` with known sizes whose reader reads by offset, ``read_records``, possibly
behind ``map``), an empty (or short) buffer fills with the keys of the source's next records,
computed from its position (``take_keys``), and reads each record like a restored one, ahead of
the draws that pick it. An epoch's start, or a restore to it, then reads
the records of its first 64 draws before its first batch instead of ``size``; the keys, the draws
and what is yielded are those of a fill that reads the records in order. Other sources fill by
reading.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from ..core.hash import DRAW_CHUNK, DrawHashes, draw_hash_array
from ..core.state import EPOCH, SEED, brief, check_int_arg
from ..errors import ResumeError
from .base import (
    DRAWS,
    SOURCE,
    Key,
    PlainKeys,
    Stream,
    check_same,
    record_key,
    require_count,
    require_key,
)
from .wrapper import Wrapper

__all__ = ["ShuffleBuffer"]

_first = itemgetter(0)


class _Unread:
    """The value of a buffer slot whose record is not read yet, restored or filled by key (a class,
    so that it stays itself when a pipeline is pickled for a worker process)."""


FIRST_READ_AHEAD = 64  # draws covered by a restore's first re-read: a batch or two of records
READ_AHEAD_GROWTH = 4  # each re-read after the second covers this many times more draws: few reads in all

SIZE = "size"
BUFFER = "buffer"
SINCE = "since"  # an update's base: the draw count of the state it changes
ENTERED = "entered"  # an update's keys that entered the buffer since that state, in order


class ShuffleBuffer(Wrapper):
    """Shuffle records through a buffer of ``size``; restore re-reads at most ``size`` records.

    Needs a source whose records can be re-read from their key (a :class:`ShardedIterable`,
    possibly behind ``map``/``filter``/``mix``).

    Example::

        shuffled = stream.shuffle_buffer(10_000, seed=0)
        state = shuffled.state_dict()  # 10_000 keys, not 10_000 samples
        shuffled.load_state_dict(state)
    """

    POSITION_KEYS = frozenset({EPOCH, DRAWS, BUFFER})

    def __init__(self, source: Stream, size: int, *, seed: int = 0) -> None:
        super().__init__(source)
        if not source.fetchable:
            raise TypeError(
                "shuffle_buffer needs a source that can re-read a record from its key (ShardedIterable, "
                f"map, filter, mix), so that its state holds keys rather than payloads; got {type(source).__name__}"
            )
        self.size = check_int_arg("size", size, minimum=1)
        self.seed = check_int_arg("seed", seed, minimum=-(2**63))
        source.expect_rereads()  # a restore re-reads the buffered records by key
        # (key, record) per slot; a restored slot holds (key, _Unread) until it is re-read.
        self._buffer: list[tuple[Key, Any]] = []
        self._unread = 0  # slots holding _Unread
        self._rereads = 0  # grouped re-reads since the restore: they fix how many draws the next covers
        self._draws = 0
        # Records held per shard (a key without its offset, see "Shard identities"): counted as
        # they enter and leave, so that a state names the shards held without listing the buffer.
        self._held: dict[Key, int] = {}
        # Keys entered since the last state_update (None: that update's state is not the base of
        # the next one, which is then the whole state); and the draw count at that update.
        self._entered: list[Key] | None = None
        self._since = 0
        self._hashes = DrawHashes(self.seed)  # the draws' hashes while iterating
        self._applied_hashes = DrawHashes(self.seed)  # the same for apply_update: with 0 workers one instance does both

    def _choice(self) -> int:
        return self._hashes.at(self._epoch, self._draws) % len(self._buffer)

    def _reread_ahead(self, draining: bool) -> None:
        """Re-read the restored records that the next draws pick (the next one picks one).

        The slots of the coming draws are known: a full buffer keeps its length, and a draining
        one moves its last record into the drawn slot, which is simulated here. Only the source
        ending while the buffer is full makes a prediction wrong, and every unread record is
        drawn eventually, so a record read early is never read in vain.
        """
        n = len(self._buffer)
        # 64 draws, 64 again (a first batch that needs more than the first read usually needs a
        # little more, not 4x more), then 4x more each time.
        window = FIRST_READ_AHEAD * READ_AHEAD_GROWTH ** max(0, self._rereads - 1)
        if window >= self._unread:  # reading every slot left reads no more records than the window could
            slots = [s for s in range(n) if self._buffer[s][1] is _Unread]
        else:
            hashes = draw_hash_array(self.seed, self._epoch, self._draws, self._draws + window).tolist()
            if not draining:
                picked = {h % n for h in hashes}
            else:
                where = list(range(n))  # where[i]: the slot whose record is at position i now
                picked = set()
                for h in hashes:
                    i = h % len(where)
                    picked.add(where[i])
                    where[i] = where[-1]
                    where.pop()
            slots = [s for s in sorted(picked) if self._buffer[s][1] is _Unread]
        keys = [self._buffer[s][0] for s in slots]
        records = self.source.fetch_many(keys)  # grouped by shard; raises before anything changes
        for slot, key, record in zip(slots, keys, records, strict=True):
            self._buffer[slot] = (key, record)
        self._unread -= len(slots)
        self._rereads += 1

    def _fill_by_key(self) -> None:
        """Fill the buffer with the keys of the source's next records where the source can tell them
        (see "Filling by key" above), each record read ahead of the draw that picks it, as a
        restored buffer's are. The keys, the draws and so what is yielded are those of the
        records read in order."""
        view = self.source.positional()
        keys = None if view is None else view.take_keys(self.size - len(self._buffer))
        if not keys:
            return
        self._buffer.extend(zip(keys, itertools.repeat(_Unread)))
        self._unread += len(keys)
        _count(self._held, keys)
        entered = self._entered
        if entered is not None:  # as if each key had entered in turn
            entered.extend(keys)
            if len(entered) > self.size:
                self._entered = None

    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        # The per-record path of every shuffled pipeline: the draws' slots come from a chunk
        # computed in numpy, the loop keeps its lookups local, and a draw costs a list lookup.
        if len(self._buffer) < self.size:
            self._fill_by_key()  # before the source's records are iterated: it moves the source
        source = self.source.iter_keyed()
        buffer, size, held = self._buffer, self.size, self._held
        while len(buffer) < size:  # filling: no draws yet
            item = next(source, None)
            if item is None:
                break
            key = record_key(item[0], "shuffle_buffer")
            self._log_entered(key)
            shard = key[:-1]
            held[shard] = held.get(shard, 0) + 1
            buffer.append((key, item[1]))
        else:
            first, slots = -1, list[int]()
            while True:
                # The choice does not depend on the incoming record: a slot left to re-read is read
                # before the source moves, so a failed read changes nothing.
                d = self._draws - first
                if not 0 <= d < len(slots):
                    first, slots = self._draws, self._full_slots(self._draws)
                    d = 0
                choice = slots[d]
                if self._unread and buffer[choice][1] is _Unread:
                    self._reread_ahead(draining=False)
                item = next(source, None)
                if item is None:
                    break
                key = record_key(item[0], "shuffle_buffer")
                self._log_entered(key)
                self._draws += 1
                out = buffer[choice]
                buffer[choice] = (key, item[1])
                shard, gone = key[:-1], out[0][:-1]
                if shard != gone:  # most draws while the shard read is larger than the buffer
                    held[shard] = held.get(shard, 0) + 1
                    left = held[gone] - 1
                    if left:
                        held[gone] = left
                    else:
                        del held[gone]
                yield out
        while buffer:
            choice = self._choice()
            if self._unread and buffer[choice][1] is _Unread:
                self._reread_ahead(draining=True)
            self._draws += 1
            out = buffer[choice]
            buffer[choice] = buffer[-1]
            buffer.pop()
            gone = out[0][:-1]
            left = held[gone] - 1
            if left:
                held[gone] = left
            else:
                del held[gone]
            yield out

    def _log_entered(self, key: Key) -> None:
        """Note a key that entered the buffer, for the next :meth:`state_update`."""
        entered = self._entered
        if entered is not None:
            entered.append(key)
            if len(entered) > self.size:  # nobody takes updates: stop logging
                self._entered = None

    def _full_slots(self, draw: int) -> list[int]:
        """The slots that draws ``draw, draw + 1, ...`` of a full buffer pick (a chunk of them)."""
        hashes = draw_hash_array(self.seed, self._epoch, draw, draw + DRAW_CHUNK)
        slots: list[int] = (hashes % np.uint64(self.size)).tolist()
        return slots

    def _reset_own(self) -> None:
        self._buffer, self._unread, self._rereads, self._draws = [], 0, 0, 0
        self._held, self._entered = {}, None

    def state_dict(self) -> dict[str, Any]:
        return self._with_held(super().state_dict())

    def state_update(self) -> dict[str, Any]:
        # The identities go with every update (a few shards'): apply_update has nothing to add.
        return self._with_held(super().state_update())

    def _with_held(self, state: dict[str, Any]) -> dict[str, Any]:
        if self._held:
            state[SOURCE] = self.source.with_held(state[SOURCE], self._held)
        return state

    def _own_update(self) -> dict[str, Any]:
        entered, self._entered, since, self._since = self._entered, [], self._since, self._draws
        if entered is None:
            return self._own_state()
        # The buffer's own key tuples, in the list that logged them: nothing is built per key (a
        # 0-worker StreamLoader keeps the updates of hundreds of batches, each a set of objects
        # for the garbage collector to track); apply_update makes the state's lists.
        return {SEED: self.seed, SIZE: self.size, DRAWS: self._draws, SINCE: since, ENTERED: entered}

    def apply_update(self, previous: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
        state = super().apply_update(previous, update)
        if BUFFER in update:
            return state
        buffer: list[list[int]] = previous[BUFFER]
        draw, entered = update[SINCE], update[ENTERED]
        if previous[DRAWS] != draw or previous[EPOCH] != update[EPOCH]:
            raise RuntimeError(  # the protocol was broken: a bug, not bad input
                f"shuffle_buffer update is relative to draw {draw} of epoch {update[EPOCH]}, but the previous "
                f"state is at draw {previous[DRAWS]} of epoch {previous[EPOCH]}"
            )
        fill = max(0, min(len(entered), self.size - len(buffer)))
        buffer.extend(map(list, entered[:fill]))
        hashes = self._applied_hashes.between(update[EPOCH], draw, update[DRAWS])
        for key, h in zip(entered[fill:], hashes, strict=False):
            buffer[h % len(buffer)] = list(key)
        for h in hashes[len(entered) - fill :]:  # draining: the last record moves into the drawn slot
            slot = h % len(buffer)
            buffer[slot] = buffer[-1]
            buffer.pop()
        del state[SINCE], state[ENTERED]
        state[BUFFER] = buffer
        return state

    def _own_state(self) -> dict[str, Any]:
        # Taken after every batch (StreamLoader keeps each batch's state): map() instead of a list
        # comprehension halves the cost of listing a buffer's keys. Unread slots are listed too.
        keys = list(map(list, map(_first, self._buffer)))
        return {SEED: self.seed, SIZE: self.size, DRAWS: self._draws, BUFFER: keys}

    def _own_state_fresh(self) -> dict[str, Any]:
        return {SEED: self.seed, SIZE: self.size, DRAWS: 0, BUFFER: []}

    def _check_own(self, state: Mapping[str, Any]) -> Callable[[], None]:
        what = "shuffle_buffer"
        check_same(what, SEED, state.get(SEED), self.seed, "build it with the checkpoint's seed")
        check_same(what, SIZE, state.get(SIZE), self.size, "build it with the checkpoint's size")
        draws = require_count(state, DRAWS, what)
        keys = self._buffered_keys(state, self.size)
        if len(set(keys)) != len(keys):
            raise ResumeError(f"{what} state holds a record twice in {BUFFER!r}: {brief(state[BUFFER])}")
        # Every key must be a record the source has already read in this state: the source's state
        # was checked first (Wrapper.check), so its checker knows the epoch, shards and cursors.
        self.source.keys_checker(state[SOURCE])(keys)

        def apply() -> None:
            self._buffer = [(key, _Unread) for key in keys]
            self._unread, self._rereads, self._draws = len(keys), 0, draws
            self._held = _count({}, keys)
            self._entered, self._since = [], draws  # updates are relative to this state

        return apply

    def key_checker(self, state: Mapping[str, Any] | None) -> Callable[[Key], None]:
        # A key this stage yielded left its buffer: it cannot also be in it (nested buffers).
        check_source = super().key_checker(state)
        held: set[Key] | None = set() if state is None else None  # the buffered keys, read at the first check

        def check(key: Key) -> None:
            nonlocal held
            if held is None:
                # check() has accepted the state, so its buffer is a list of int keys: no need to
                # parse it again (pack checks one carried key against a whole buffer).
                assert state is not None
                held = set(map(tuple, state[BUFFER]))
            if key in held:
                raise ResumeError(
                    f"shuffle_buffer state: record key {brief(list(key))} is both buffered and handed out"
                )
            check_source(key)

        return check

    @staticmethod
    def _buffered_keys(state: Mapping[str, Any], size: int | None = None) -> list[Key]:
        raw = state.get(BUFFER)
        if not isinstance(raw, list):
            raise ResumeError(f"shuffle_buffer state field {BUFFER!r} must be a list of keys, got {brief(raw)}")
        if size is not None and len(raw) > size:
            raise ResumeError(f"shuffle_buffer state holds {len(raw)} records but the buffer size is {size}")
        # The common case, a saved or JSON-loaded state (lists of plain ints), checked in bulk: a
        # restore reads a whole buffer of keys. Anything else goes key by key, which accepts tuples
        # and int subclasses and names the first bad key.
        if set(map(type, raw)) <= {list}:
            keys = PlainKeys(map(tuple, raw))
            widths = set(map(len, keys))
            if set(map(type, itertools.chain.from_iterable(keys))) <= {int} and min(widths, default=2) >= 2:
                keys.width = widths.pop() if len(widths) == 1 else 0  # the source's bulk check uses it
                return keys
        return [require_key(key, "shuffle_buffer state") for key in raw]

    def rebalance(
        self, states: Sequence[Mapping[str, Any]], num_slots: int, pending: list[Key]
    ) -> list[dict[str, Any]]:
        # Buffered records go back to the sources as pending records, to be read again exactly once.
        held = [key for state in states for key in self._buffered_keys(state)]
        return super().rebalance(states, num_slots, pending + held)


def _count(held: dict[Key, int], keys: Iterable[Key]) -> dict[Key, int]:
    """``held`` with ``keys`` counted by shard (a key without its offset)."""
    for key in keys:
        shard = key[:-1]
        held[shard] = held.get(shard, 0) + 1
    return held
