"""IterableSource: the fallback for a foreign iterable that cannot seek: a counted skip on restore.

Its state is how many records of the epoch were handed out. A restore has no way to jump there,
so it re-iterates the iterable and discards that many records, and says so with a
:class:`ReplayWarning` every time: the cost is never hidden behind an O(1) claim.
"""

from __future__ import annotations

import itertools
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..core.state import VERSION, brief, check_version, require_mapping
from ..errors import ResumeError
from .base import EPOCH, STREAM_STATE_VERSION, Key, Slot, Stream, require_count, require_epoch

__all__ = ["IterableSource", "ReplayWarning"]

CONSUMED = "consumed"


class ReplayWarning(UserWarning):
    """A restore replays records instead of seeking to them."""


class IterableSource(Stream):
    """A stream over any re-iterable object (a list, an object whose ``__iter__`` reopens a file).

    Each ``iter(iterable)`` must yield the same records in the same order. Records get keys
    ``(epoch, 0, index)``, so ``map(seed=...)`` works; ``shuffle_buffer`` does not (a record cannot be
    re-read by key), and the source cannot be split over workers or ranks.

    Args:
        iterable: the records.
        name: how warnings and errors call it.

    Example::

        stream = IterableSource(my_generator_factory_object, name="legacy corpus")
        stream.load_state_dict(saved)  # warns: replays N records
    """

    POSITION_KEYS = frozenset({EPOCH, CONSUMED})

    fetchable = False

    def __init__(self, iterable: Iterable[Any], *, name: str | None = None) -> None:
        super().__init__()
        self.iterable = iterable
        self.name = name or type(iterable).__name__
        self._consumed = 0

    def iter_keyed(self) -> Iterator[tuple[Key, Any]]:
        records = iter(self.iterable)
        if self._consumed:
            warnings.warn(
                f"{self.name} cannot seek: resuming replays {self._consumed} records to reach the "
                "checkpoint's position. To restore in O(1), serve the data through ShardedIterable "
                "with a reader that starts at an offset (TokenShardReader, TextLineReader, or your own)",
                ReplayWarning,
                stacklevel=2,
            )
            skipped = sum(1 for _ in itertools.islice(records, self._consumed))
            if skipped < self._consumed:
                raise ResumeError(
                    f"{self.name} ended after {skipped} records but the checkpoint had consumed "
                    f"{self._consumed}: the iterable changed"
                )
        for record in records:
            key = (self._epoch, 0, self._consumed)
            self._consumed += 1
            yield key, record

    def reset(self, epoch: int, slot: Slot | None) -> None:
        if slot is not None and slot[1] > 1:
            raise ResumeError(
                f"{self.name} cannot be split over {slot[1]} workers/ranks (every copy would read all "
                "of it); use num_workers=0 and world_size=1, or ShardedIterable"
            )
        self._epoch, self._consumed = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {VERSION: STREAM_STATE_VERSION, EPOCH: self._epoch, CONSUMED: self._consumed}

    def check(self, state: Any) -> Callable[[], None]:
        state = require_mapping(state, self.name)
        check_version(state, STREAM_STATE_VERSION, self.name)
        epoch = require_epoch(state, self.name)
        consumed = require_count(state, CONSUMED, self.name)
        if consumed > sys.maxsize:  # more records than any iterable can yield (and than islice takes)
            raise ResumeError(
                f"{self.name} state field {CONSUMED!r} is {brief(consumed)}, more than {sys.maxsize} records"
            )

        def apply() -> None:
            self._epoch, self._consumed = epoch, consumed

        return apply
