"""BatchByTokens: batches of consecutive records whose tokens fit a budget, not a record count.

Variable-length records (token sequences) make a fixed batch size waste memory on short records
and run out of it on long ones. ``batch_by_tokens(max_tokens)`` adds records to a batch while its
cost stays within ``max_tokens``: the sum of the records' lengths, or with ``padded=True`` what a
batch padded to its longest record costs, ``len(batch) * longest``.

State: deciding that a record does not fit means reading it, so between two batches one record
may have been read for the next batch. The state is its key, never the record::

    {"max_tokens": 4096, "padded": False, "oversized": "error", "carry": [[epoch, shard, offset]], "source": {...}}

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
from typing import Any

from ..core.state import check_int_arg, require_bool
from ..errors import ResumeError
from .base import SOURCE, Key, Stream, Wrapper, check_same, record_key
from .pack import CARRY, carried_keys

__all__ = ["BatchByTokens"]

_WHAT = "batch_by_tokens"
MAX_TOKENS = "max_tokens"
PADDED = "padded"
OVERSIZED = "oversized"
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

    def __init__(
        self,
        source: Stream,
        max_tokens: int,
        *,
        length: Callable[[Any], int] = len,
        padded: bool = False,
        oversized: str = "error",
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
            longest_with = max(longest, n)
            cost = (len(batch) + 1) * longest_with if self.padded else total + n
            if batch and cost > self.max_tokens:
                self._carry = key, value  # the next batch's first record: the state before the yield
                yield None, self._collate(batch)
                batch, total, longest = [], 0, 0
                continue
            batch.append(value)
            total, longest = total + n, longest_with

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
        n = self.length(value)
        if n > self.max_tokens and self.oversized == "error":
            raise ValueError(
                f"{_WHAT}: record {list(key)} has {n} tokens, more than max_tokens={self.max_tokens}; "
                "truncate or filter such records first (map, filter), or pass oversized='alone'"
            )
        return key, value, n

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
