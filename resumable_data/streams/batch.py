"""Batch: group consecutive records. Holds nothing between batches, so its state is its source's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import default_collate

from ..core.state import check_int_arg
from .base import Key, Stream
from .wrapper import Wrapper

__all__ = ["Batch"]


class Batch(Wrapper):
    """Batches of ``batch_size`` records, collated with ``collate_fn`` (default ``default_collate``).

    A batch is pulled whole before it is yielded, so a checkpoint between batches never splits one.
    Batches have no record identity: put ``map(seed=...)`` and ``shuffle_buffer`` before ``batch``.

    Example::

        for inputs in stream.batch(32, drop_last=True):
            train_step(inputs)
    """

    def __init__(
        self,
        source: Stream,
        batch_size: int,
        *,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        super().__init__(source)
        self.keyed = self.fetchable = False
        self.batch_size = check_int_arg("batch_size", batch_size, minimum=1)
        self.drop_last = drop_last
        self.collate_fn = default_collate if collate_fn is None else collate_fn

    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        records: list[Any] = []
        for _, value in self.source.iter_keyed():
            records.append(value)
            if len(records) == self.batch_size:
                yield None, self.collate_fn(records)
                records = []
        if records and not self.drop_last:
            yield None, self.collate_fn(records)
