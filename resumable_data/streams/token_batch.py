"""BatchByTokens: batches of consecutive records whose tokens fit a budget, not a record count.

Variable-length records (token sequences) make a fixed batch size waste memory on short records
and run out of it on long ones. ``batch_by_tokens(max_tokens)`` adds records to a batch while its
cost stays within ``max_tokens``: the sum of the records' lengths, or with ``padded=True`` what a
batch padded to its longest record costs, ``len(batch) * longest``.

State: deciding that a record does not fit means reading it, so between two batches one record
may have been read for the next batch. The state is its key (``[epoch, shard, offset]``), never
the record:

>>> from resumable_data import ShardedIterable
>>> documents = {"a": [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]}
>>> source = ShardedIterable(["a"], read_shard=lambda shard, start: iter(documents[shard][start:]), shuffle=False)
>>> stream = source.batch_by_tokens(4)
>>> next(iter(stream))
[[1, 2, 3], [4]]
>>> {key: value for key, value in stream.state_dict().items() if key != "source"}  # and the source's state
{'version': 2, 'epoch': 0, 'max_tokens': 4, 'padded': False, 'oversized': 'error', 'carry': [[0, 0, 2]]}

A restore re-reads that one record by key and starts the next batch with it. On a layout change
(another number of workers or ranks) it goes back to the sources as a pending record, so every
record is still batched exactly once.

A record longer than the budget. By default it is an error (``oversized="error"``): a token
budget is usually a memory limit, and a batch over it would fail later and further from its
cause; filter or truncate such records with ``filter``/``map`` first. ``oversized="alone"`` puts
it in a batch of its own instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from ..core.hash import hash_ints
from ..core.permutation import Permutation
from ..core.state import SEED, brief, check_int_arg, require_bool
from ..errors import ResumeError
from .base import EPOCH, SOURCE, Key, Stream, check_same, record_key, require_count
from .pack import CARRY, carried_keys
from .window import COUNT, TAKEN, WINDOW, take_records
from .wrapper import Wrapper, check_reread_growth

__all__ = ["BatchByTokens", "BucketedBatchByTokens"]

_WHAT = "batch_by_tokens"
MAX_TOKENS = "max_tokens"
PADDED = "padded"
OVERSIZED = "oversized"
BUCKET = "bucket"
RECORDS = "records"  # records of the open bucket window, re-read on restore (absent in older states)
_OVERSIZED = ("error", "alone")


class _Unread:
    """The value of a restored carried record that is not re-read yet."""


class BatchByTokens(Wrapper):
    """Batches of consecutive records costing at most ``max_tokens``; see the module docstring.

    Args:
        source: a stream of records whose records can be re-read by key.
        max_tokens: the budget of one batch.
        length: the tokens a record counts for (default ``len``: a list's, a 1-D tensor's or array's).
        padded: count a batch as padded to its longest record (``len(batch) * longest``) rather
            than as the sum of its records' lengths.
        oversized: what a record longer than ``max_tokens`` gets: ``"error"`` (a ValueError
            naming it) or ``"alone"`` (a batch of its own).
        collate_fn: how a list of records becomes a batch (None: the list itself, since the
            records differ in length).

    Example:
        >>> from resumable_data import ShardedIterable
        >>> documents = {"a": [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]}
        >>> def pipeline():
        ...     source = ShardedIterable(["a"], read_shard=lambda shard, start: iter(documents[shard][start:]))
        ...     return source.batch_by_tokens(5)
        >>> stream = pipeline()
        >>> next(iter(stream))  # [5, 6] would make 6 tokens: it waits for the next batch
        [[1, 2, 3], [4]]
        >>> stream.state_dict()["carry"]  # its key, re-read on restore
        [[0, 0, 2]]
        >>> resumed = pipeline()
        >>> resumed.load_state_dict(stream.state_dict())
        >>> list(resumed)
        [[[5, 6]], [[7, 8, 9, 10]]]
    """

    POSITION_KEYS = frozenset({EPOCH, CARRY})

    def __init__(
        self,
        source: Stream,
        max_tokens: int,
        *,
        length: Callable[[Any], int] = len,
        padded: bool = False,
        oversized: Literal["error", "alone"] = "error",
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        super().__init__(source)
        if not source.keyed or not source.fetchable:
            raise TypeError(
                "batch_by_tokens needs records that can be re-read from their key (ShardedIterable, map, filter, "
                f"shuffle_buffer, shuffle_window, mix; before batch()), so that its state holds a key; got "
                f"{type(source).__name__}"
            )
        if oversized not in _OVERSIZED:
            raise ValueError(f"oversized should be one of {_OVERSIZED}, but got oversized={oversized!r}")
        self.keyed = self.fetchable = False
        self.max_tokens = check_int_arg("max_tokens", max_tokens, minimum=1)
        self.length = length
        self.padded = bool(padded)
        self.oversized = oversized
        self.collate_fn = collate_fn
        source.expect_rereads()  # a restore re-reads the carried record (with bucket, the open window)
        self._carry: tuple[Key, Any] | None = None  # read for the next batch; _Unread after a restore

    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        records = self.source.iter_keyed()
        batch: list[Any] = []
        total = longest = 0
        while True:
            item = self._next(records)
            if item is None:
                if batch:
                    yield None, self._collate(batch)
                return
            key, value, n = item
            if batch and not self._fits(len(batch), total, longest, n):
                self._carry = key, value  # the next batch's first record: the state before the yield
                yield None, self._collate(batch)
                batch, total, longest = [], 0, 0
                continue
            batch.append(value)
            total, longest = total + n, max(longest, n)

    def _fits(self, count: int, total: int, longest: int, n: int) -> bool:
        """Whether a record of ``n`` tokens fits a batch of ``count`` records (``total`` tokens, the
        longest ``longest``)."""
        cost = (count + 1) * max(longest, n) if self.padded else total + n
        return cost <= self.max_tokens

    def _checked_length(self, key: Key, value: Any) -> int:
        n = self.length(value)
        if n > self.max_tokens and self.oversized == "error":
            raise ValueError(
                f"{_WHAT}: record {list(key)} has {n} tokens, more than max_tokens={self.max_tokens}; "
                "truncate or filter such records first (map, filter), or pass oversized='alone'"
            )
        return n

    def _next(self, records: Iterator[tuple[Key | None, Any]]) -> tuple[Key, Any, int] | None:
        """The carried record (re-read after a restore), else the source's next; with its length."""
        if self._carry is not None:
            key, value = self._carry
            if value is _Unread:
                value = self.source.fetch_many([key])[0]
            self._carry = None
        else:
            item = next(records, None)
            if item is None:
                return None
            key, value = record_key(item[0], _WHAT), item[1]
        return key, value, self._checked_length(key, value)

    def _collate(self, batch: list[Any]) -> Any:
        return batch if self.collate_fn is None else self.collate_fn(batch)

    # -- state ---------------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        return {MAX_TOKENS: self.max_tokens, PADDED: self.padded, OVERSIZED: self.oversized}

    def _own_state(self) -> dict[str, Any]:
        return {**self._config(), CARRY: [] if self._carry is None else [list(self._carry[0])]}

    def _own_state_fresh(self) -> dict[str, Any]:
        return {**self._config(), CARRY: []}

    def _reset_own(self) -> None:
        self._carry = None

    def _check_own(self, state: Mapping[str, Any]) -> Callable[[], None]:
        remedy = "build batch_by_tokens with the checkpoint's arguments"
        require_bool(state, PADDED, _WHAT)
        for field, current in self._config().items():
            check_same(_WHAT, field, state.get(field), current, remedy)
        carried = carried_keys(state, CARRY, _WHAT)
        if len(carried) > 1:
            raise ResumeError(f"{_WHAT} state field {CARRY!r} holds at most one record key, but got {len(carried)}")
        check_key = self.source.key_checker(state[SOURCE])
        for key in carried:
            check_key(key)

        def apply() -> None:
            self._carry = (carried[0], _Unread) if carried else None

        return apply

    def rebalance(
        self, states: Sequence[Mapping[str, Any]], num_slots: int, pending: list[Key]
    ) -> list[dict[str, Any]]:
        # A carried record was read but is in no batch yet: the sources read it again, once.
        held = [key for state in states for key in carried_keys(state, CARRY, _WHAT)]
        return super().rebalance(states, num_slots, pending + held)


class BucketedBatchByTokens(BatchByTokens):
    """``batch_by_tokens(max_tokens, bucket=n)``: batches of records of similar lengths.

    The stream is cut into windows of ``bucket`` records; each window's records are sorted by
    length (ties in stream order) and cut into batches within the budget as above, and the
    window's batches are yielded in the order of ``Permutation(number of batches, hash(seed,
    window), epoch)`` (so lengths do not rise through each window). Sorting packs a padded batch
    with little padding.

    State: the fields above plus ``"bucket"``, ``"seed"``, ``"window"``: windows begun this epoch,
    ``"count"``: batches of the open window (0: none open), ``"taken"``: those handed out,
    ``"records"``: the open window's records, and under ``"source"`` the source's state at the open
    window's start::

        >>> from resumable_data.streams import ShardedIterable
        >>> documents = {"a": [[1, 2, 3], [4, 5], [6], [7, 8]]}
        >>> source = ShardedIterable(["a"], read_shard=lambda shard, start: iter(documents[shard][start:]))
        >>> stream = source.batch_by_tokens(4, bucket=3, seed=0)
        >>> next(iter(stream))  # the window's 3 records sorted by length, in 2 batches
        [[6], [4, 5]]
        >>> {key: value for key, value in stream.state_dict().items() if key != "source"}
        {'version': 2, 'epoch': 0, 'max_tokens': 4, 'padded': False, 'oversized': 'error', 'bucket': 3,
         'seed': 0, 'window': 1, 'count': 2, 'taken': 1, 'records': 3}

    A restore re-reads that one window
    (its ``records``, at most ``bucket``: the epoch's last window is shorter, and a source grown
    since with ``growth="append"`` has more records after it) and plans it again. A layout change
    is refused while a window is open (the state must be taken between windows), as for
    ``shuffle_window`` over sources of unknown size.
    """

    POSITION_KEYS = BatchByTokens.POSITION_KEYS | {WINDOW, COUNT, TAKEN, RECORDS}

    def __init__(self, source: Stream, max_tokens: int, *, bucket: int, seed: int = 0, **options: Any) -> None:
        super().__init__(source, max_tokens, **options)
        self.bucket = check_int_arg("bucket", bucket, minimum=1)
        self.seed = check_int_arg("seed", seed, minimum=-(2**63))
        self._reset_own()

    def _reset_own(self) -> None:
        self._window = self._count = self._taken = self._records = 0
        self._start: dict[str, Any] | None = None  # the source's state at the open window's start
        self._batches: list[list[Any]] | None = None  # the open window's batches (None: re-read them)

    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        records = self.source.iter_keyed()
        while True:
            if self._taken >= self._count:  # open the next window
                start = self.source.state_dict()
                window = _keyed(take_records(records, self.bucket))
                batches = self._plan(self._window, window)
                if not batches:
                    return
                self._window, self._count, self._taken = self._window + 1, len(batches), 0
                # The start with the identities of the shards the window entered (read whole here):
                # a restore re-reads the window from there and checks them.
                start = self.source.with_identities(start)
                self._records, self._start, self._batches = len(window), start, batches
            elif self._batches is None:  # restored: the source stands at the window's start
                window = _keyed(take_records(records, self._records))
                batches = self._plan(self._window - 1, window)
                if len(window) != self._records or len(batches) != self._count:
                    raise ResumeError(
                        f"{_WHAT}: the restored window held {self._records} records in {self._count} batches, but "
                        f"its source now yields {len(window)} records in {len(batches)} from the window's start; "
                        "the data changed since the checkpoint"
                    )
                self._batches = batches
            while self._taken < self._count:
                self._taken += 1
                yield None, self._collate(self._batches[self._taken - 1])

    def _plan(self, window: int, records: list[tuple[Key, Any]]) -> list[list[Any]]:
        """Window number ``window``'s batches, in the order they are yielded."""
        lengths = [self._checked_length(key, value) for key, value in records]
        batches: list[list[Any]] = []
        total = longest = 0
        for i in sorted(range(len(records)), key=lengths.__getitem__):
            n = lengths[i]
            if not batches or not self._fits(len(batches[-1]), total, longest, n):
                batches.append([])
                total = longest = 0
            batches[-1].append(records[i][1])
            total, longest = total + n, max(longest, n)
        if not batches:
            return []
        order = Permutation(len(batches), hash_ints(self.seed, window) >> 1, self._epoch)
        return [batches[i] for i in order(np.arange(len(batches), dtype=np.int64)).tolist()]

    # -- state ---------------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        return {**super()._config(), BUCKET: self.bucket, SEED: self.seed}

    def _own_state(self) -> dict[str, Any]:
        count, taken, held = (self._count, self._taken, self._records) if self._taken < self._count else (0, 0, 0)
        return {**self._config(), WINDOW: self._window, COUNT: count, TAKEN: taken, RECORDS: held}

    def _own_state_fresh(self) -> dict[str, Any]:
        return {**self._config(), WINDOW: 0, COUNT: 0, TAKEN: 0, RECORDS: 0}

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._taken < self._count and self._start is not None:
            state[SOURCE] = self._start  # an open window restores from its start and re-reads it
        return state

    # Whole states (Stream's default, not Wrapper's change to the source's state): the source's
    # state is the window's start, not a change to the previous one.
    state_update = Stream.state_update
    apply_update = Stream.apply_update

    def _check_own(self, state: Mapping[str, Any]) -> Callable[[], None]:
        require_bool(state, PADDED, _WHAT)
        for field, current in self._config().items():
            check_same(_WHAT, field, state.get(field), current, "build batch_by_tokens with the checkpoint's arguments")
        window, count, taken = (require_count(state, field, _WHAT) for field in (WINDOW, COUNT, TAKEN))
        # A state of an earlier release does not say how many records its open window held: a full
        # bucket, unless the window was the epoch's last, which a grown source no longer ends.
        held = require_count(state, RECORDS, _WHAT) if RECORDS in state else self.bucket
        if count > self.bucket or taken > count or (count and not window) or not count <= held <= self.bucket:
            raise ResumeError(
                f"{_WHAT} state has {brief(taken)} of {brief(count)} batches taken from window {brief(window)} of "
                f"{brief(held)} records (at most {self.bucket}); pass a state_dict() of this pipeline unchanged"
            )
        if count and RECORDS not in state and self.source.appends(state[SOURCE]):
            raise ResumeError(
                f"{_WHAT} state (written by an earlier release) has a window open but no {RECORDS!r}: over shards "
                "appended since, its re-read cannot tell where the window ended; build the ShardedIterable with "
                "growth='next_epoch' (the new shards join at the next epoch), or save the state between windows"
            )
        start = dict(state[SOURCE]) if count else None
        if start is not None:
            check_reread_growth(_WHAT, self.source, start)

        def apply() -> None:
            self._window, self._count, self._taken, self._records = window, count, taken, held
            self._start, self._batches = start, None

        return apply

    def rebalance(
        self, states: Sequence[Mapping[str, Any]], num_slots: int, pending: list[Key]
    ) -> list[dict[str, Any]]:
        if any(state[COUNT] for state in states):
            raise ResumeError(
                f"{_WHAT}(bucket=...) state field {COUNT!r}: a window's batches cannot be split over another number "
                "of workers or ranks; resume with the checkpoint's num_workers and world_size, or save the state "
                "between windows"
            )
        return Wrapper.rebalance(self, states, num_slots, pending)


def _keyed(records: list[tuple[Key | None, Any]]) -> list[tuple[Key, Any]]:
    return [(record_key(key, _WHAT), value) for key, value in records]
