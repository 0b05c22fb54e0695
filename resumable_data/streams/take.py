"""Take: at most ``n`` records per epoch."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..core.state import check_int_arg
from ..errors import ResumeError
from .base import EPOCH, Key, Stream, check_same, require_count
from .wrapper import Wrapper

__all__ = ["Take"]

LIMIT = "limit"
TAKEN = "taken"


class Take(Wrapper):
    """The first ``n`` records of each epoch. The source is not read past the ``n``-th record.

    The count belongs to one stream, so a pipeline with ``take`` resumes only with the same worker
    and rank layout.

    Example::

        for record in stream.take(1000):  # a quick validation pass
            ...
    """

    POSITION_KEYS = frozenset({EPOCH, TAKEN})

    in_order = True

    def __init__(self, source: Stream, n: int) -> None:
        super().__init__(source)
        self.limit = check_int_arg("n", n, minimum=0)
        self._taken = 0

    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        records = self.source.iter_keyed()
        while self._taken < self.limit:
            item = next(records, None)
            if item is None:
                return
            self._taken += 1
            yield item

    def _reset_own(self) -> None:
        self._taken = 0

    def _own_state(self) -> dict[str, Any]:
        return {LIMIT: self.limit, TAKEN: self._taken}

    def _check_own(self, state: Mapping[str, Any]) -> Callable[[], None]:
        check_same("take", "n", state.get(LIMIT), self.limit, "build it with the checkpoint's n")
        taken = require_count(state, TAKEN, "take")
        if taken > self.limit:
            raise ResumeError(f"take state has taken {taken} records but n is {self.limit}")

        def apply() -> None:
            self._taken = taken

        return apply

    rebalance = Stream.rebalance
