"""Wrapper: the base of a stage with one source, whose state nests the source's under ``"source"``.

It forwards every method of the stage protocol (:mod:`resumable_data.streams.base`) to its source
and nests the state; a stage (``map``, ``shuffle_buffer``, ``pack``, ...) then overrides only what
it changes. Also here: the checks of a stage that reads a window again from its start over a
source that grew since (``growth="append"``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..core.state import VERSION, brief, check_version, keys_of, require_mapping
from ..errors import ResumeError
from .base import EPOCH, SOURCE, STREAM_STATE_VERSION, Key, Slot, Stream, require_epoch

__all__ = ["Wrapper", "check_reread_growth", "growth_reorders"]


class Wrapper(Stream):
    """A stage with one source whose state is its own fields plus the source's under ``"source"``.

    Subclasses list their own state fields through :meth:`_own_state` / :meth:`_check_own`.
    """

    def __init__(self, source: Stream) -> None:
        super().__init__()
        if not isinstance(source, Stream):
            raise TypeError(f"{type(self).__name__} wraps a Stream, got {type(source).__name__}")
        self.source = source
        self.depth = source.depth + 1
        self._epoch = source.epoch
        self.keyed = source.keyed
        self.fetchable = source.fetchable

    def _what(self) -> str:
        return type(self).__name__

    def _own_state(self) -> dict[str, Any]:
        return {}

    def _check_own(self, state: Mapping[str, Any]) -> Callable[[], None]:
        """Validate this stage's own fields; return the thunk that applies them."""
        return lambda: None

    def _reset_own(self) -> None:
        """Clear this stage's per-epoch fields."""

    def reset(self, epoch: int, slot: Slot | None) -> None:
        self._epoch = epoch
        self._reset_own()
        self.source.reset(epoch, slot)

    def state_dict(self) -> dict[str, Any]:
        return {
            VERSION: STREAM_STATE_VERSION,
            EPOCH: self._epoch,
            **self._own_state(),
            SOURCE: self.source.state_dict(),
        }

    def _own_update(self) -> dict[str, Any]:
        """This stage's own fields for :meth:`state_update` (by default its whole own state)."""
        return self._own_state()

    def state_update(self) -> dict[str, Any]:
        return {
            VERSION: STREAM_STATE_VERSION,
            EPOCH: self._epoch,
            **self._own_update(),
            SOURCE: self.source.state_update(),
        }

    def apply_update(self, previous: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
        state = dict(update)
        state[SOURCE] = self.source.apply_update(previous[SOURCE], update[SOURCE])
        return state

    def check(self, state: Any) -> Callable[[], None]:
        state = require_mapping(state, self._what())
        check_version(state, STREAM_STATE_VERSION, self._what())
        epoch = require_epoch(state, self._what())
        if SOURCE not in state:
            raise ResumeError(f"{self._what()} state is missing the key {SOURCE!r}; got keys {keys_of(state)}")
        # The source first: the own fields (a shuffle buffer's keys) are checked against its state.
        apply_source = self.source.check(state[SOURCE])
        apply_own = self._check_own(state)
        source_epoch = state[SOURCE].get(EPOCH) if isinstance(state[SOURCE], Mapping) else None
        expected = self.expected_source_epoch(epoch, state)
        if isinstance(source_epoch, int) and source_epoch != expected:
            raise ResumeError(
                f"{self._what()} state is in epoch {epoch} but its source's state is in epoch {brief(source_epoch)} "
                f"(expected {expected}); pass a state_dict() of this pipeline unchanged"
            )

        def apply() -> None:
            self._epoch = epoch
            apply_own()
            apply_source()

        return apply

    def fetch(self, key: Key) -> Any:
        return self.source.fetch(key)

    def fetch_many(self, keys: Sequence[Key]) -> list[Any]:
        return self.source.fetch_many(keys)

    def expect_rereads(self, branch: tuple[int, ...] = ()) -> None:
        self.source.expect_rereads(branch)

    def with_identities(self, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, SOURCE: self.source.with_identities(state[SOURCE])}

    def with_held(self, state: dict[str, Any], shards: Iterable[Key]) -> dict[str, Any]:
        return {**state, SOURCE: self.source.with_held(state[SOURCE], shards)}

    def key_checker(self, state: Mapping[str, Any] | None) -> Callable[[Key], None]:
        return self.source.key_checker(None if state is None else state[SOURCE])

    def keys_checker(self, state: Mapping[str, Any] | None) -> Callable[[Sequence[Key]], None]:
        # A stage whose keys are its source's (map, filter) hands the bulk check on; one with a
        # key_checker of its own (shuffle_buffer, mix, repeat, ...) checks key by key through it.
        if type(self).key_checker is Wrapper.key_checker:
            return self.source.keys_checker(None if state is None else state[SOURCE])
        return super().keys_checker(state)

    def saved_slots(self, state: Mapping[str, Any]) -> list[Slot]:
        return self.source.saved_slots(state[SOURCE])

    def appends(self, state: Mapping[str, Any]) -> bool:
        return self.source.appends(state[SOURCE])

    def expected_source_epoch(self, epoch: int, state: Mapping[str, Any]) -> int:
        """The epoch the source's state must be in when this stage's (checked) state is in ``epoch``.

        Part of the stage protocol: a stage that runs several source epochs per epoch of its own
        (``repeat``) overrides it.
        """
        return epoch

    def rebalance(
        self, states: Sequence[Mapping[str, Any]], num_slots: int, pending: list[Key]
    ) -> list[dict[str, Any]]:
        sources = self.source.rebalance([s[SOURCE] for s in states], num_slots, pending)
        return [
            {VERSION: STREAM_STATE_VERSION, EPOCH: states[0][EPOCH], **self._own_state_fresh(), SOURCE: s}
            for s in sources
        ]

    def _own_state_fresh(self) -> dict[str, Any]:
        """This stage's own fields at the start of an epoch (used after a rebalance)."""
        return {}


def growth_reorders(stream: Stream, state: Mapping[str, Any]) -> bool:
    """Whether loading the (checked) ``state`` over records appended since (``growth="append"``)
    changes what ``stream`` yields from it before the old data's end: a stage between the grown
    source and ``stream`` reacts to where the source ended (a mix's draws, a shuffle buffer's
    draining, a window's last short window), so a window re-read from ``state`` would read other
    records than it held."""
    while stream.appends(state):
        if not stream.in_order:
            return True
        if not isinstance(stream, Wrapper):
            return False
        stream, state = stream.source, state[SOURCE]
    return False


def check_reread_growth(what: str, source: Stream, start: Mapping[str, Any]) -> None:
    """Refuse to re-read an open window from its ``start`` (its source's checked state) where the
    source grew since in a way that changes what it yields from there (:func:`growth_reorders`)."""
    if growth_reorders(source, start):
        raise ResumeError(
            f"{what} state has a window open, which a restore re-reads from its start; over shards appended "
            "since (growth='append'), the stages before it (mix, shuffle_buffer, shuffle_window) yield other "
            "records from there, so some would be read twice and others never. Build the ShardedIterable "
            "with growth='next_epoch' (the new shards join at the next epoch), or save the state between windows"
        )
