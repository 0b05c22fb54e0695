"""The per-batch path of a StreamLoader slot: what each worker iterates (or this process, with 0 workers).

A slot's pipeline is loaded from the slot's state and pulled batch by batch, each batch under its
own global-RNG key and sent with the change to the state it makes (:meth:`Stream.state_update`).
With 0 workers (and no ``pin_memory``) no DataLoader iterates the pipeline: in this process it would
only add its per-batch machinery (a profiler range, a fetcher) to every batch (its cost:
benchmarks/README.md). A DataLoader is still built for each pass, so that the keywords given are
checked as they always are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..core.hash import hash_more
from ..rng.global_rngs import GLOBAL_RNGS
from .base import Stream

__all__ = ["Seeding", "SlotDataset", "slot_batches", "slot_loader"]

_END = object()


def unchanged(item: Any) -> Any:
    """The DataLoader's collate_fn: workers already batched, and the state must pass untouched."""
    return item


class Seeding(NamedTuple):
    """Global-RNG seeding before each batch: slot ``g``'s ``n``-th batch of the epoch is pulled
    through the pipeline under ``hash_more(prefix, g, n)``."""

    prefix: int  # hash_ints(epoch, number of slots, salt)
    first_slot: int  # this rank's first global slot


class SlotDataset(IterableDataset):
    """What each worker iterates: its slot's pipeline from the slot's state, batch by batch.

    ``holds`` is the slot whose state the loader's own pipeline already holds (see
    ``SlotLedger.holds``); iterating in the loader's process (0 workers), that pipeline goes on
    from there instead of validating and applying the same state again. A worker always loads its
    slot's state into its copy of the pipeline.
    """

    def __init__(
        self,
        stream: Stream,
        states: list[dict[str, Any]],
        yielded: list[int],
        seeding: Seeding | None,
        next_worker: int,
        holds: int | None,
    ) -> None:
        self.stream = stream
        self.states = states
        self.yielded = yielded
        self.seeding = seeding
        self.next_worker = next_worker
        self.holds = holds

    def __iter__(self) -> Iterator[tuple[int, int, dict[str, Any], Any]]:
        info = get_worker_info()
        # Rotate slots over workers so that the DataLoader's round-robin, which always starts at
        # worker 0, starts at the slot that was next when the state was saved.
        local = 0 if info is None else (info.id + self.next_worker) % len(self.states)
        load = info is not None or local != self.holds
        yield from slot_batches(self.stream, local, self.states[local], self.yielded[local], self.seeding, load=load)


def slot_batches(
    stream: Stream, local: int, state: dict[str, Any], yielded: int, seeding: Seeding | None, *, load: bool
) -> Iterator[tuple[int, int, dict[str, Any], Any]]:
    """The per-batch path: slot ``local``'s batches from ``state`` (loaded when ``load``), each with
    the count of batches the slot has yielded and the change to the state it makes; whichever
    process runs it (a worker, or this one)."""
    if load:
        stream.load_state_dict(state)
    items = iter(stream)
    # In the main process the global RNGs are the training loop's too: they are put back after each batch.
    restore = get_worker_info() is None
    while True:
        if seeding is None:
            item = next(items, _END)
        else:
            # Pulling the batch runs the pipeline (map's fn included) for it, under its own key.
            with GLOBAL_RNGS.seeded(hash_more(seeding.prefix, seeding.first_slot + local, yielded), restore=restore):
                item = next(items, _END)
        if item is _END:
            return
        yielded += 1
        # The change since the last batch's state: as large as a batch, not as the state.
        yield local, yielded, stream.state_update(), item


def slot_loader(
    dataset: SlotDataset, num_workers: int, seed: int, dataloader_kwargs: dict[str, Any]
) -> Iterable[tuple[int, int, dict[str, Any], Any]]:
    """The pass's batches from ``dataset``'s slots: through a DataLoader's workers, or in this process."""
    # A private generator: torch draws the workers' base seed from it, which would otherwise
    # consume the global RNG (and change model randomness after a resume).
    generator = torch.Generator()
    generator.manual_seed(seed)
    # Built with 0 workers too: it validates the caller's DataLoader keywords as it always does.
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        collate_fn=unchanged,
        generator=generator,
        **dataloader_kwargs,
    )
    if num_workers == 0 and not loader.pin_memory:
        # In this process a DataLoader adds nothing but its own per-batch machinery (a profiler
        # range, the fetcher), so the slot's pipeline is iterated directly.
        return dataset
    return loader
