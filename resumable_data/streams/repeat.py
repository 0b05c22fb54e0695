"""Repeat: iterate the source several times (or forever), each round a new source epoch."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..core.state import brief, check_int_arg
from ..errors import ResumeError
from .base import EPOCH, SOURCE, Key, Slot, Stream, check_same, require_count
from .wrapper import Wrapper

__all__ = ["Repeat"]

TIMES = "times"
ROUND = "round"


class Repeat(Wrapper):
    """Rounds of the source; round ``r`` of epoch ``e`` reads source epoch ``e * times + r``
    (just ``r`` when ``times`` is None: an endless stream has a single epoch).

    Each round reshuffles (a new source epoch), and records of different rounds have different
    keys, so ``map(seed=...)`` augments them differently. Resumes only with the same worker and
    rank layout.

    A round that yields no record ends the repeat: every later round would be empty too (an empty
    shard list for this worker or rank, a filter that rejects everything), so repeating it would
    spin forever without a record. Inside :func:`mix` such a source then drops out like any
    exhausted one.

    Example::

        mixed = mix([web.repeat(), books.repeat()], weights=[0.7, 0.3], seed=0)
    """

    POSITION_KEYS = frozenset({EPOCH, ROUND})

    def __init__(self, source: Stream, times: int | None = None) -> None:
        super().__init__(source)
        self.times = None if times is None else check_int_arg("times", times, minimum=1)
        self._round = 0
        self._epoch = 0
        self.source.reset(self._source_epoch(), None)

    def _source_epoch(self) -> int:
        return self._round if self.times is None else self._epoch * self.times + self._round

    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        started = False  # the current round was started here, not continued (e.g. restored at its end)
        while True:
            empty = True
            for item in self.source.iter_keyed():
                empty = False
                yield item
            if (started and empty) or (self.times is not None and self._round + 1 >= self.times):
                return
            self._round += 1
            self.source.reset(self._source_epoch(), None)
            started = True

    def reset(self, epoch: int, slot: Slot | None) -> None:
        self._epoch, self._round = epoch, 0
        self.source.reset(self._source_epoch(), slot)

    def _own_state(self) -> dict[str, Any]:
        return {TIMES: self.times, ROUND: self._round}

    def _check_own(self, state: Mapping[str, Any]) -> Callable[[], None]:
        check_same("repeat", TIMES, state.get(TIMES), self.times, "build it with the checkpoint's times")
        round_ = require_count(state, ROUND, "repeat")
        if self.times is not None and round_ >= self.times:
            raise ResumeError(f"repeat state is in round {round_} but times is {self.times}")

        def apply() -> None:
            self._round = round_

        return apply

    def expected_source_epoch(self, epoch: int, state: Mapping[str, Any]) -> int:
        round_ = state[ROUND]
        return round_ if self.times is None else epoch * self.times + round_

    def key_checker(self, state: Mapping[str, Any] | None) -> Callable[[Key], None]:
        if state is None:
            return self.source.key_checker(None)
        current = self.expected_source_epoch(state[EPOCH], state)
        first = current - state[ROUND]
        check_current, check_earlier = self.source.key_checker(state[SOURCE]), self.source.key_checker(None)

        def check(key: Key) -> None:
            # Records of earlier rounds (a shuffle buffer keeps some across rounds) have earlier
            # source epochs; only the current round's can be checked against the source's cursors.
            if not first <= key[0] <= current:
                raise ResumeError(
                    f"repeat: record key {brief(list(key))} is from source epoch {brief(key[0])}, but this state has "
                    f"read source epochs {first}..{current} only; pass a state_dict() of this pipeline unchanged"
                )
            (check_current if key[0] == current else check_earlier)(key)

        return check

    rebalance = Stream.rebalance
