"""The per-batch path of a StreamLoader slot: what each worker iterates (or this process, with 0 workers).

A slot's pipeline is loaded from the slot's state and pulled batch by batch, each batch under its
own global-RNG key and sent with the change to the state it makes (:meth:`Stream.state_update`).
With 0 workers (and no ``pin_memory``) no DataLoader iterates the pipeline: in this process it would
only add its per-batch machinery (a profiler range, a fetcher) to every batch (its cost:
benchmarks/README.md). A DataLoader is still built for each pass, so that the keywords given are
checked as they always are.

Batches per message. Each message from a worker costs the main process a fixed amount (the
worker queue, and a shared-memory segment per tensor), which for small batches (token ids, a few
KB) is more than the batch's own work. With ``batches_per_message=k`` each worker sends its batches
``k`` to a message, and the main process hands them out in the order a DataLoader hands out single
batches: round-robin over the slots, one batch each (:func:`interleaved`). The stream and every
state are the same as with ``k = 1``.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..core.hash import hash_more
from ..rng.global_rngs import GLOBAL_RNGS
from .base import Stream

__all__ = ["Seeding", "SlotDataset", "interleaved", "slot_batches", "slot_loader"]

_END = object()
Item = tuple[int, int, dict[str, Any], Any]  # (slot, batches it has yielded, state update, batch)


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
    slot's state into its copy of the pipeline, and sends its batches ``per_message`` to a list.
    """

    def __init__(
        self,
        stream: Stream,
        states: list[dict[str, Any]],
        yielded: list[int],
        seeding: Seeding | None,
        next_worker: int,
        holds: int | None,
        per_message: int = 1,
    ) -> None:
        self.stream = stream
        self.states = states
        self.yielded = yielded
        self.seeding = seeding
        self.next_worker = next_worker
        self.holds = holds
        self.per_message = per_message

    def __iter__(self) -> Iterator[Item | list[Item]]:
        info = get_worker_info()
        local = 0 if info is None else self.slot_of(info.id)
        load = info is not None or local != self.holds
        batches = slot_batches(self.stream, local, self.states[local], self.yielded[local], self.seeding, load=load)
        if info is None or self.per_message == 1:
            yield from batches
            return
        while group := list(itertools.islice(batches, self.per_message)):
            yield group

    def slot_of(self, worker: int) -> int:
        """The slot ``worker`` serves. Slots rotate over workers so that the DataLoader's round-robin,
        which always starts at worker 0, starts at the slot that was next when the state was saved."""
        return (worker + self.next_worker) % len(self.states)

    def worker_order(self) -> list[int]:
        """The slots in the order a DataLoader's round-robin asks its workers (worker 0 first)."""
        return [self.slot_of(worker) for worker in range(len(self.states))]


def slot_batches(
    stream: Stream, local: int, state: dict[str, Any], yielded: int, seeding: Seeding | None, *, load: bool
) -> Iterator[Item]:
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


def interleaved(messages: Iterable[list[Item]], order: list[int]) -> Iterator[Item]:
    """The batches of ``messages`` (lists of a slot's batches, all full but its last) in the order a
    DataLoader hands out single batches: round-robin over the slots in ``order``, one batch each,
    a slot dropped for good once it is exhausted.

    The DataLoader hands out messages round-robin too, skipping exhausted workers. So when a slot's
    held batches run out, the next message is that slot's next one, unless the slot is exhausted:
    a message from another slot (or none) says that it is.
    """
    held: dict[int, deque[Item]] = {local: deque() for local in order}
    alive, at = list(order), 0
    messages = iter(messages)
    while alive:
        local = alive[at]
        if not held[local]:
            group = next(messages, None)
            if group is not None:
                held[group[0][0]].extend(group)
            if not held[local]:
                del alive[at]
                at = at % len(alive) if alive else 0
                continue
        yield held[local].popleft()
        at = (at + 1) % len(alive)


def slot_loader(dataset: SlotDataset, num_workers: int, seed: int, dataloader_kwargs: dict[str, Any]) -> Iterable[Item]:
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
        return dataset  # (in this process it yields single batches)
    if num_workers and dataset.per_message > 1:
        return interleaved(loader, dataset.worker_order())
    return loader
