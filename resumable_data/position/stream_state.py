"""A StreamLoader state read against its pipeline: what ``where`` and ``skip`` compute with for streams.

:class:`LoaderState` checks a state's fields as a restore with the state's own layout checks them and
loads a slot's state into the pipeline; :class:`RankEpoch` is one rank's epoch as batches, from its
slots' :meth:`Stream.epoch_positions <resumable_data.streams.Stream.epoch_positions>` and the
loader's round-robin (:mod:`.dealing`); :func:`refusal` says why a pipeline cannot be answered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.ranges import Ranges
from ..core.state import EPOCH, WORLD_SIZE, check_int_arg, is_int, require_bool, require_mapping
from ..errors import ResumeError
from ..streams.base import Key, Stream, require_count
from ..streams.batch import Batch
from ..streams.epoch_positions import EpochPositions
from ..streams.ledger import batch_counts, slot_states
from ..streams.loader_state import BATCHES, EPOCH_DONE, NEXT_WORKER, NUM_WORKERS, SLOTS
from ..streams.skipped import check_loader_version, rank_skipped
from .dealing import Dealing, slot_batch_count

__all__ = ["LoaderState", "RankEpoch", "batched_pipeline", "refusal", "shard_names"]

_WHAT = "StreamLoader"
POSITIONAL_PIPELINES = (
    "a stream's batches follow from its state only when its order follows from positions: a ShardedIterable with "
    "known sizes (sizes=, ShardedIterable.from_index, or a reader that counts), behind map and shuffle_window"
)


def batched_pipeline(pipeline: Stream, batch_size: int | None, drop_last: bool) -> Batch:
    """The pipeline batched as the loader batches it: its own ``.batch(n)``, or ``batch_size`` records."""
    if isinstance(pipeline, Batch):
        if batch_size is not None and batch_size != pipeline.batch_size:
            raise ResumeError(f"batch_size is {batch_size}, but the pipeline batches by {pipeline.batch_size}")
        return pipeline
    if not isinstance(pipeline, Stream) or not pipeline.keyed:
        raise ResumeError(
            f"pipeline: expected the Stream of records the StreamLoader was built over (or one ending in .batch(n)), "
            f"got {type(pipeline).__name__}"
        )
    if batch_size is None:
        raise ResumeError("batch_size: the state does not hold the loader's batch size: pass it (--batch-size)")
    return Batch(pipeline, check_int_arg("batch_size", batch_size, minimum=1), drop_last=drop_last)


@dataclass(frozen=True)
class LoaderState:
    """A StreamLoader state's fields, checked as a restore with the state's own layout checks them."""

    state: Mapping[str, Any]
    epoch: int
    epoch_done: bool
    world: int
    workers: int
    slots: dict[int, Any]

    @property
    def local(self) -> int:
        return max(1, self.workers)

    @property
    def num_slots(self) -> int:
        return self.world * self.local

    @classmethod
    def parse(cls, state: Mapping[str, Any]) -> LoaderState:
        check_loader_version(state, _WHAT)
        world = require_count(state, WORLD_SIZE, _WHAT)
        if world < 1:
            raise ResumeError(f"{_WHAT} state field {WORLD_SIZE!r} must be >= 1, but got {world}")
        workers = require_count(state, NUM_WORKERS, _WHAT)
        slots = slot_states(state, SLOTS, world * max(1, workers), _WHAT)
        return cls(
            state, require_count(state, EPOCH, _WHAT), require_bool(state, EPOCH_DONE, _WHAT), world, workers, slots
        )

    def ranks(self, rank: int | None) -> list[int]:
        """The ranks asked for whose slots the state holds (a rank's own state holds only its own)."""
        held = [r for r in range(self.world) if all(g in self.slots for g in self.mine(r))]
        if rank is None:
            if not held:
                raise ResumeError(f"{_WHAT} state holds no rank's slots whole (it has slots {sorted(self.slots)[:20]})")
            return held
        if isinstance(rank, bool) or not isinstance(rank, int) or rank not in held:
            raise ResumeError(
                f"rank should be one whose slots the state holds ({held}; merge every rank's state with "
                f"StreamLoader.merge_states for all), but got rank={rank!r}"
            )
        return [rank]

    def mine(self, rank: int) -> range:
        return range(rank * self.local, (rank + 1) * self.local)

    def next_worker(self, rank: int) -> int:
        value = require_mapping(self.state.get(NEXT_WORKER), f"{_WHAT} {NEXT_WORKER!r}").get(str(rank))
        if not is_int(value) or not 0 <= value < self.local:
            raise ResumeError(
                f"{_WHAT} state field {NEXT_WORKER!r} has {value!r} for rank {rank}, expected an int in [0, {self.local})"
            )
        return int(value)

    def yielded(self, rank: int) -> list[int]:
        """Batches each of the rank's slots has yielded in the epoch."""
        return batch_counts(self.state, BATCHES, self.mine(rank), _WHAT)

    def skipped(self, rank: int) -> Ranges:
        """The rank's batches of the epoch a ``skip`` moved past."""
        return rank_skipped(self.state, rank, sum(self.yielded(rank)), _WHAT)

    def restore(self, batched: Batch, g: int) -> None:
        """Load slot ``g``'s state into the pipeline, as the loader's restore checks it."""
        apply = batched.check(self.slots[g])
        saved = [s for s in batched.saved_slots(self.slots[g]) if s != (g, self.num_slots)]
        if saved:
            raise ResumeError(f"{_WHAT} state: slot {g} holds a pipeline state saved for slot {saved[0][0]}")
        apply()


class RankEpoch:
    """One rank's batches of one epoch, from its slots' epoch positions (see the module docstring).

    Args:
        layout: The state.
        batched: The pipeline, batched as the loader batches.
        rank: The rank.
        epoch: The epoch: the state's (its slots' states loaded) or another (its slots started).
        command: Who asks (``where``, ``skip``), for a refusal's message.
    """

    def __init__(self, layout: LoaderState, batched: Batch, rank: int, epoch: int, *, command: str = "where") -> None:
        self.rank, self.epoch, self.slots = rank, epoch, layout.mine(rank)
        self._command = command
        self.batched = batched
        self._layout = layout
        self.positions = [self._positions(g) for g in self.slots]
        size = batched.batch_size
        self.dealing = Dealing([slot_batch_count(p.length, size, batched.drop_last) for p in self.positions])
        self.done = self.dealing.total
        if epoch == layout.epoch:
            self.done = self._check_state(layout.yielded(rank), layout.next_worker(rank))

    def prepare(self, local: int) -> None:
        """Put the pipeline at slot ``local``'s position: its state's, or its epoch's start."""
        g = self.slots[local]
        if self.epoch == self._layout.epoch:
            self._layout.restore(self.batched, g)
        else:
            self.batched.reset(self.epoch, (g, self._layout.num_slots))

    def _positions(self, g: int) -> EpochPositions:
        self.prepare(g - self.slots[0])
        positions = self.batched.source.epoch_positions()
        if positions is None:
            raise ResumeError(refusal(self.batched.source, whole_epoch=True, command=self._command))
        return positions

    def _check_state(self, yielded: list[int], next_worker: int) -> int:
        """The batches the state's slots have yielded, refused unless they are this dealing's."""
        done = sum(yielded)
        size = self.batched.batch_size
        expected = [min(n * size, p.length) for n, p in zip(yielded, self.positions, strict=True)]
        at = [p.position for p in self.positions]
        if done > self.dealing.total or self.dealing.taken(done) != yielded or at != expected:
            raise ResumeError(
                f"{_WHAT} state: rank {self.rank}'s slots have yielded {yielded} batches and stand at records {at}, "
                f"which is not where one uninterrupted round-robin over this pipeline puts them ({expected}); "
                "build the pipeline (and batch size, drop_last) as the training script does"
            )
        if self.dealing.next_worker(done) != next_worker and done < self.dealing.total:
            raise ResumeError(
                f"{_WHAT} state: rank {self.rank} names slot {next_worker} next, but after {done} batches the "
                f"round-robin is at slot {self.dealing.next_worker(done)}; pass a state_dict() unchanged"
            )
        return done

    def batch(self, j: int) -> tuple[int, list[Key]]:
        """The global slot and the record keys of the rank's ``j``-th batch of the epoch."""
        local, k = self.dealing.slot_of(j)
        size, length = self.batched.batch_size, self.positions[local].length
        return self.slots[local], self.positions[local].keys(np.arange(k * size, min((k + 1) * size, length)))


def _stages(stream: Stream) -> list[Stream]:
    """The pipeline's chain of stages, from the top down to its source."""
    chain = [stream]
    while isinstance(below := getattr(chain[-1], "source", None), Stream):
        chain.append(below)
    return chain


def shard_names(stream: Stream) -> Callable[[int], str]:
    """Shard index -> its name in the source's shard list (the index itself for a source without one)."""
    shards = getattr(_stages(stream)[-1], "shards", None)
    if shards is None:
        return str
    return lambda index: str(shards[index])


def refusal(stream: Stream, *, whole_epoch: bool = False, command: str = "where") -> str:
    """Why the (loaded) pipeline cannot name its records: the lowest stage that cannot.

    ``whole_epoch``: its whole epoch as positions (:meth:`Stream.epoch_positions`) rather than its
    next records (:meth:`Stream.upcoming_keys`).
    """
    stages = list(reversed(_stages(stream)))
    if whole_epoch:
        stage = next(s for s in stages if s.epoch_positions() is None)
    else:
        stage = next(s for s in stages if s.upcoming_keys(1) is None)
    name = type(stage).__name__
    if command == "skip":
        instead = (
            "To leave out a bad stretch, resume from this checkpoint and drop those records with .filter(...) on "
            "the stream, or skip from a checkpoint of the next epoch"
        )
    else:
        instead = "To see the records anyway, restore the loader from the checkpoint and read its batches (a replay)"
    if whole_epoch and getattr(stage, "sizes", None) is not None:
        instead = (
            "`where --next` still answers, and a checkpoint of the next epoch answers all"
            if command == "where"
            else instead
        )
        return (
            f"{command}: the state's epoch changed layout at a resume (another num_workers or world size), so the "
            f"positions of {name}'s slots before the change were other slots' and its batches cannot be computed "
            f"from the state; {instead}"
        )
    if hasattr(stage, "shards"):
        why = "reads by per-shard cursors (its shard sizes are unknown, or the state was saved so)"
    else:
        why = "decides its next records by the records it reads (a buffer's draws, a predicate, a mix)"
    return f"{command}: {name} {why}, so its records follow from the data, not from the state; {POSITIONAL_PIPELINES}. {instead}"
