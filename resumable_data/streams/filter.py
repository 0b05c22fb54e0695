"""Filter: keep the records a predicate accepts; the position is the source's, not a count kept."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .base import Key, Stream, Wrapper

__all__ = ["Filter"]


class Filter(Wrapper):
    """Yield the source's records for which ``predicate(record)`` is true.

    The state is the source's position after the last *accepted* record, so records rejected before
    a checkpoint are not read again on resume, and nothing depends on how many were accepted.

    Example::

        short = stream.filter(lambda doc: len(doc["text"]) < 10_000)
        short.load_state_dict(saved)
    """

    in_order = True

    def __init__(self, source: Stream, predicate: Callable[[Any], bool]) -> None:
        super().__init__(source)
        self.predicate = predicate

    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        for key, value in self.source.iter_keyed():
            if self.predicate(value):
                yield key, value
