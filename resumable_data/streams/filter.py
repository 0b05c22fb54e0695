"""Filter: keep the records a predicate accepts; the position is the source's, not a count kept."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .base import Key, Stream, record_key
from .record_rngs import RECORD, check_record_rng, per_record_salt, seeded_call
from .wrapper import Wrapper

__all__ = ["Filter"]


class Filter(Wrapper):
    """Yield the source's records for which ``predicate(record)`` is true.

    The state is the source's position after the last *accepted* record, so records rejected before
    a checkpoint are not read again on resume, and nothing depends on how many were accepted.

    Below a stage that re-reads records the predicate runs under the global RNGs seeded from the
    record's key (see :class:`~resumable_data.streams.map.Map`): a random subsample is decided
    the same way when a window is read again after a restore. ``global_rng=None`` promises that
    the predicate draws nothing from the global RNGs, and skips that seeding.

    Example::

        short = stream.filter(lambda doc: len(doc["text"]) < 10_000)
        short.load_state_dict(saved)
    """

    in_order = True

    def __init__(self, source: Stream, predicate: Callable[[Any], bool], *, global_rng: str | None = RECORD) -> None:
        super().__init__(source)
        self.predicate = predicate
        self.global_rng = check_record_rng("filter", global_rng)
        self._salt: int | None = None  # set below a re-reading stage (see Map): per-record global RNGs

    def expect_rereads(self, branch: tuple[int, ...] = ()) -> None:
        # A window read again from its start filters its records again: a predicate drawing from
        # the global RNGs (random subsampling) must decide as it did the first time.
        if self.global_rng is not None:
            self._salt = per_record_salt(self.depth, branch)
        super().expect_rereads(branch)

    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        salt, predicate = self._salt, self.predicate
        if salt is None:
            for key, value in self.source.iter_keyed():
                if predicate(value):
                    yield key, value
            return
        for key, value in self.source.iter_keyed():
            if seeded_call(salt, record_key(key, "filter"), predicate, value):
                yield key, value
