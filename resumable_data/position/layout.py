"""A map-style data state read once into the samplers that replay it: the arithmetic of its batches.

A ``ResumableSampler`` or ``ResumableDataLoader`` state fixes everything about an epoch's order
(dataset length, seed, shuffle, world size, drop_last, the batch size for a loader) and where the
run stands in it (epoch, position). :class:`MapLayout` loads it into one
:class:`~resumable_data.ResumableSampler` per rank — the loader's own code, so what it answers is
what a restored loader yields — and cuts their orders into batches with the loader's
:class:`~resumable_data.map.batch_sampler.ResumableBatchSampler`. Every answer costs one batch's
indices per rank: nothing is proportional to the dataset.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core import state as keys
from ..core.cursor import Segment
from ..core.permutation import PiecewisePermutation
from ..core.state import require_int, require_mapping
from ..errors import ResumeError
from ..map.batch_sampler import ResumableBatchSampler
from ..map.sampler import ResumableSampler
from ..map.skipped import Ranges

__all__ = ["STREAM_STATES", "MapLayout", "is_map_state"]

STREAM_STATES = (
    "a stream's state (StreamLoader, ShardedIterable, shuffle_buffer, shuffle_window) names records by shard "
    "cursors and slot states whose meaning depends on the pipeline (shard list, sizes, reader, stages), "
    "which the checkpoint does not hold: for a StreamLoader's, give `where` and `skip` the pipeline (--pipeline "
    "MODULE:FUNCTION with --batch-size, or position.where_stream and position.skip_stream_state)"
)

_WHAT = "data"
# What every map-style state holds beside version, epoch and position (a stream's does not).
_MAP_KEYS = (keys.DATASET_LENGTH, keys.SEED, keys.SHUFFLE, keys.WORLD_SIZE, keys.DROP_LAST)


def is_map_state(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` is a ResumableSampler's or ResumableDataLoader's (not a stream's)."""
    return all(key in state for key in _MAP_KEYS)


@dataclass(frozen=True)
class MapLayout:
    """A map-style state, validated, with a sampler per rank that has loaded it.

    Attributes:
        state: The state, as given.
        epoch: Its epoch.
        position: Global samples consumed in the epoch (all ranks; skipped ones included).
        batch_size: Samples per batch per rank (the loader's; given for a sampler's state).
        world_size: Ranks.
        samplers: One :class:`ResumableSampler` per rank, restored to the state.
    """

    state: Mapping[str, Any]
    epoch: int
    position: int
    batch_size: int
    world_size: int
    samplers: tuple[ResumableSampler, ...]

    @classmethod
    def parse(cls, state: Any, *, batch_size: int | None = None) -> MapLayout:
        """Validate ``state`` as a restore would and build its samplers.

        Args:
            state: A ``ResumableSampler`` or ``ResumableDataLoader`` state dict.
            batch_size: Samples per batch per rank; taken from the state when it has one (a loader's),
                required otherwise, and when both are given they must agree.

        Raises:
            ResumeError: not a map-style state, malformed, or no batch size known.
        """
        state = require_mapping(state, _WHAT)
        if not is_map_state(state):
            missing = [key for key in _MAP_KEYS if key not in state]
            raise ResumeError(
                f"not a ResumableSampler or ResumableDataLoader state (it lacks {', '.join(missing)}): without a "
                f"pipeline, `where` and `skip` answer map-style states only; {STREAM_STATES}"
            )
        saved = state.get(keys.BATCH_SIZE)
        if saved is not None:
            saved = require_int(state, keys.BATCH_SIZE, _WHAT, minimum=1)
            if batch_size is not None and batch_size != saved:
                raise ResumeError(f"batch_size is {batch_size}, but the state was saved with batch_size {saved}")
        size = saved if saved is not None else batch_size
        if size is None:
            raise ResumeError(
                "batch_size: the state is a ResumableSampler's, which has no batch size: pass one (--batch-size)"
            )
        if size < 1:
            raise ResumeError(f"batch_size should be an integer >= 1, but got batch_size={size}")
        world = require_int(state, keys.WORLD_SIZE, _WHAT, minimum=1)
        samplers = []
        for rank in range(world):
            sampler = ResumableSampler(
                require_int(state, keys.DATASET_LENGTH, _WHAT, minimum=1),
                shuffle=bool(state[keys.SHUFFLE]),
                seed=require_int(state, keys.SEED, _WHAT, minimum=-(2**63), maximum=2**64 - 1),
                rank=rank,
                world_size=world,
                drop_last=bool(state[keys.DROP_LAST]),
            )
            sampler.check_state(state, strict=True, what=_WHAT)()
            samplers.append(sampler)
        first = samplers[0]
        return cls(state, first.epoch, first.position, size, world, tuple(samplers))

    # -- batches ---------------------------------------------------------------------------------
    def batcher(self, rank: int) -> ResumableBatchSampler:
        """Rank ``rank``'s batches, cut as the loader cuts them."""
        return ResumableBatchSampler(self.samplers[rank], self.batch_size, self.drop_last, global_rng=None)

    @property
    def drop_last(self) -> bool:
        return self.samplers[0].drop_last

    @property
    def skipped(self) -> Ranges:
        """The skipped position ranges of the state's epoch."""
        return self.samplers[0].skipped_ranges(self.epoch)

    def epoch_length(self, epoch: int) -> int:
        return self.samplers[0].epoch_length(epoch)

    def done(self) -> bool:
        """Whether the state's epoch is exhausted (the next batch is the next epoch's first)."""
        return self.samplers[0].is_end(self.epoch, self.position)

    def batches_in_epoch(self, epoch: int) -> int:
        """Batches of epoch ``epoch`` read from its start with this layout."""
        return self.batcher(0).batch_count(epoch, 0)

    def batch_start(self, epoch: int, batch: int) -> int:
        """The global position where batch ``batch`` of epoch ``epoch`` (read from its start) begins."""
        return self.batcher(0).position_after(epoch, 0, batch)

    def batch_of(self, position: int) -> int:
        """The batch of the epoch (read from its start) that holds global ``position``."""
        return position // self.world_size // self.batch_size

    def step_of(self, epoch: int, batch: int) -> int:
        """The run's batch number: the batches of the epochs before (each over the whole dataset, the
        next epoch's length: a grown epoch's own is not theirs) plus ``batch``."""
        return epoch * self.batches_in_epoch(self.epoch + 1) + batch

    def read_limit(self, epoch: int) -> int:
        """The first position of epoch ``epoch`` that no batch reads: its padded end, or with
        ``drop_last`` the end of its last full batch."""
        if self.drop_last:
            return self.world_size * self.batch_size * self.batches_in_epoch(epoch)
        return self.samplers[0].end_position(epoch, 0)

    def sample_at(self, epoch: int, position: int) -> int:
        """The sample at global ``position`` of epoch ``epoch``'s order (the padded tail wraps)."""
        position %= self.epoch_length(epoch)
        return int(self._order(epoch)(np.array([position]))[0]) if self.samplers[0].shuffle else position

    def position_of(self, epoch: int, sample: int) -> int:
        """The position of ``sample`` in epoch ``epoch``'s order (its first, before any padding)."""
        return int(self._order(epoch).inverse(np.array([sample]))[0]) if self.samplers[0].shuffle else sample

    def _order(self, epoch: int) -> PiecewisePermutation:
        sampler = self.samplers[0]
        return PiecewisePermutation(sampler.epoch_lengths(epoch), sampler.seed, epoch)

    def indices(self, epoch: int, start: int, rank: int) -> list[int]:
        """Rank ``rank``'s sample indices of the batch that begins at global ``start`` of epoch ``epoch``."""
        batches = self.batcher(rank).batches(Segment(epoch, start, 0))
        return list(next(batches, []))
