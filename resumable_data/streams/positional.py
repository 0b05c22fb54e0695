"""Positional: the capability of a source whose records are addressed by their position.

A source that knows how many records each of its shards holds (a :class:`ShardedIterable` built
with ``sizes=``) can tell the key of the record at any position of its slot's epoch without
reading it, and move past records without reading them. The stages that shuffle use this for
their fast paths: ``shuffle_window`` fetches only the records it hands out (its state is then a
few integers, its restore reads nothing in advance), and ``shuffle_buffer`` fills its buffer with
keys and reads each record when a draw picks it.

A stage asks its source for the capability with :meth:`Stream.positional
<resumable_data.streams.base.Stream.positional>` (None: the source has none) and never tests the
source's type. A stage that keeps its source's keys and order and has no position of its own
(``map``) passes it through with :class:`PassThrough`, fetching through itself, so that a
``ShardedIterable(...).map(f).shuffle_window(n)`` keeps the fast path. A stage that drops records
(``filter``, ``take``) or changes keys, order or epochs (``mix``, ``repeat``, the shuffles,
``pack``, the batchers) does not: positions would no longer count its records.

A user-written source implements :class:`Positional` (often by returning itself from
``positional()``) and gets the same fast paths; ``tests/streams/test_positional.py`` holds one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .base import SOURCE

if TYPE_CHECKING:
    from .base import Key, Stream

__all__ = ["PassThrough", "Positional"]


class Positional(Protocol):
    """Records addressed by position in a slot's epoch: what the fast paths of the shuffles need.

    A *position* counts the records the current (rank, worker) slot has read in its epoch, in the
    order it reads them. *Pending* records are read before the slot's positions: records that a
    stage above held when the worker/rank layout changed, handed back by ``rebalance``. The
    methods taking a ``state`` read a state of the stage that offered the view, already accepted
    by its :meth:`~resumable_data.streams.base.Stream.check`.
    """

    @property
    def position(self) -> int | None:
        """Records this slot has read in the current epoch (pending ones aside); None when the
        current state is not a position (a list of cursors)."""
        ...

    @property
    def pending_count(self) -> int:
        """Pending records left to read before the slot's positions."""
        ...

    def slot_length(self) -> int | None:
        """Records this slot reads by position in the current epoch; None while pending records come
        first or when :attr:`position` is None (the positions cannot be used now)."""
        ...

    def keys_at(self, positions: np.ndarray, state: Mapping[str, Any] | None = None) -> list[Key]:
        """The keys of the records at ``positions`` (each below :meth:`slot_length`), unread; with
        ``state``, of that state's epoch and slot instead of the current ones."""
        ...

    def seek(self, position: int) -> None:
        """Continue the slot's epoch at ``position``, reading nothing: the caller holds the records
        in between and fetches them by key."""
        ...

    def take_keys(self, count: int) -> list[Key] | None:
        """The keys of the next ``count`` records by position (fewer at the end), moving past them
        unread; None, with nothing moved, where reading them by key would cost more than in order."""
        ...

    def take_pending(self, count: int) -> list[Key]:
        """The keys of the next ``count`` pending records (fewer if there are fewer), moving past them
        unread."""
        ...

    def fetch_many(self, keys: Sequence[Key]) -> list[Any]:
        """The records with ``keys``, in that order, as the stage that offered the view yields them."""
        ...

    def saved_position(self, state: Mapping[str, Any]) -> int | None:
        """The position ``state`` stands at; None when it is a list of cursors."""
        ...

    def split_pending(self, state: Mapping[str, Any], count: int) -> tuple[list[Key], dict[str, Any]] | None:
        """The keys of the first ``count`` pending records of ``state`` and the state without them;
        None when it holds fewer (a layout change hands the rest of a window of them on)."""
        ...


class PassThrough:
    """The positional view of a stage that keeps its source's keys, order and position (``map``):
    the source's view, with records fetched through the stage and states unnested from it."""

    def __init__(self, stage: Stream, inner: Positional) -> None:
        self._stage = stage
        self._inner = inner

    @property
    def position(self) -> int | None:
        return self._inner.position

    @property
    def pending_count(self) -> int:
        return self._inner.pending_count

    def slot_length(self) -> int | None:
        return self._inner.slot_length()

    def keys_at(self, positions: np.ndarray, state: Mapping[str, Any] | None = None) -> list[Key]:
        return self._inner.keys_at(positions, None if state is None else state[SOURCE])

    def seek(self, position: int) -> None:
        self._inner.seek(position)

    def take_keys(self, count: int) -> list[Key] | None:
        return self._inner.take_keys(count)

    def take_pending(self, count: int) -> list[Key]:
        return self._inner.take_pending(count)

    def fetch_many(self, keys: Sequence[Key]) -> list[Any]:
        return self._stage.fetch_many(keys)

    def saved_position(self, state: Mapping[str, Any]) -> int | None:
        return self._inner.saved_position(state[SOURCE])

    def split_pending(self, state: Mapping[str, Any], count: int) -> tuple[list[Key], dict[str, Any]] | None:
        split = self._inner.split_pending(state[SOURCE], count)
        if split is None:
            return None
        keys, source = split
        return keys, {**state, SOURCE: source}
