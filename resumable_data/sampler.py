"""ResumableSampler: an epoch's order as a pure function of ``(seed, epoch, length)``, resumable in O(1).

Positions are counted globally. Epoch ``e`` has one global order of the dataset (shuffled by a
keyed :class:`~resumable_data.permutation.Permutation`, or ``0..N-1``); ranks interleave it from the
position ``p`` where this stretch of the epoch starts: rank ``r`` takes global positions
``p + r, p + r + W, p + r + 2W, ...``. Because every rank advances in lockstep (as under DDP), the
saved state — ``epoch`` and ``position`` (global samples consumed in the epoch) — is the same on all
ranks, and any rank's state can be loaded into any rank of a world of a different size: the new
ranks interleave the *rest* of the same global order.

The uneven tail is handled as ``torch.utils.data.DistributedSampler`` does: padded by wrapping to the
start of the epoch's order, or trimmed with ``drop_last=True``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

import numpy as np
import torch.utils.data

from . import _state as keys
from ._state import ResumeError, check_int_arg, check_version, require_bool, require_int, require_mapping
from .permutation import Permutation
from .rng import SampleKey

__all__ = ["ResumableSampler"]

SAMPLER_STATE_VERSION = 1
_WHAT = "sampler"
# Indices are computed in chunks that start small (a restore needs only the first batch) and grow
# so that steady-state iteration amortizes numpy's per-call overhead.
_FIRST_CHUNK = 256
_MAX_CHUNK = 65536


class ResumableSampler(torch.utils.data.Sampler[int]):
    """Yields this rank's dataset indices; ``state_dict()`` / ``load_state_dict()`` resume in O(1).

    Args:
        data_source: a ``Sized`` dataset or its length as an int (>= 1).
        shuffle: shuffle each epoch with a keyed permutation of ``(seed, epoch)``.
        seed: the shuffle seed; the order never depends on the global RNG.
        rank: this process's rank in ``[0, world_size)``.
        world_size: number of data-parallel processes.
        drop_last: trim the uneven tail so every rank gets the same number of samples, instead of
            padding it with the start of the epoch's order.

    Epochs: ``set_epoch(e)`` selects epoch ``e`` (from position 0, unless ``e`` is the epoch the
    sampler is already in, e.g. just restored: then the position is kept, so loops that call
    ``set_epoch(epoch)`` at the top of every epoch resume mid-epoch). Without ``set_epoch``, an
    ``iter()`` after an exhausted epoch starts the next epoch by itself.

    Used on its own (e.g. as ``sampler=`` of a plain ``DataLoader`` or of torchdata's
    ``StatefulDataLoader``), the position advances as indices are *drawn*. A plain ``DataLoader``
    with workers draws ahead of what it has yielded; ``StatefulDataLoader`` accounts for that, and
    :class:`~resumable_data.ResumableDataLoader` counts only the batches it handed out.

    Example:
        >>> sampler = ResumableSampler(dataset, seed=0, rank=rank, world_size=world)
        >>> loader = torchdata.stateful_dataloader.StatefulDataLoader(dataset, sampler=sampler)
        >>> ...  # save loader.state_dict(); later loader.load_state_dict(state): O(1)
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        length = data_source if isinstance(data_source, int) else len(data_source)
        self._length = check_int_arg("dataset length", length, minimum=1)
        self._world_size = check_int_arg("world_size", world_size, minimum=1)
        check_int_arg("rank", rank, minimum=0)
        if rank >= world_size:
            raise ResumeError(f"rank should be in [0, world_size), but got rank={rank}, world_size={world_size}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ResumeError(f"seed should be an int, but got seed={seed!r}")
        self._rank = rank
        self._shuffle = bool(shuffle)
        self._seed = seed
        self._drop_last = bool(drop_last)
        self._epoch = 0
        self._position = 0
        self._pinned = False  # set_epoch() was called: the next iter() must not auto-advance
        self._permutation: Permutation | None = None
        # When a ResumableDataLoader drives this sampler, it fixes the stretch to iterate and
        # tracks the position itself (only batches handed out count).
        self._driven = False
        self._segment = (0, 0)
        self._yield_keys = False

    # -- read-only views ---------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    @property
    def position(self) -> int:
        """Global samples consumed in the current epoch (all ranks together)."""
        return self._position

    @property
    def dataset_length(self) -> int:
        return self._length

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    # -- epochs --------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch``; keeps the position if it is already the current (e.g. restored) epoch."""
        check_int_arg("epoch", epoch, minimum=0)
        if epoch != self._epoch:
            self._epoch = epoch
            self._position = 0
        self._pinned = True

    def __len__(self) -> int:
        """This rank's samples in a full epoch."""
        return self._length // self._world_size if self._drop_last else -(-self._length // self._world_size)

    # -- the arithmetic of a stretch of an epoch -----------------------------------------------
    def rank_samples(self, start: int) -> int:
        """Samples each rank takes when the epoch continues from global position ``start``."""
        remaining = max(0, self._length - start)
        return remaining // self._world_size if self._drop_last else -(-remaining // self._world_size)

    def end_position(self, start: int) -> int:
        """The position that marks the epoch done when it continues from ``start`` (>= length)."""
        return max(self._length, start + self._world_size * self.rank_samples(start))

    def position_after(self, start: int, taken: int) -> int:
        """Global position once every rank has taken ``taken`` samples from ``start``."""
        if taken >= self.rank_samples(start):
            return self.end_position(start)
        return start + self._world_size * taken

    def _next_segment(self) -> tuple[int, int]:
        """(epoch, start) the next ``iter()`` covers, without changing anything."""
        if not self._pinned and self._position >= self._length:
            return self._epoch + 1, 0
        return self._epoch, self._position

    def _begin(self) -> tuple[int, int]:
        """Enter the stretch the next ``iter()`` covers (advancing an exhausted epoch)."""
        self._epoch, self._position = self._next_segment()
        self._pinned = False
        self._segment = (self._epoch, self._position)
        return self._segment

    def index_chunks(self, epoch: int, start: int, count: int | None = None) -> Iterator[np.ndarray]:
        """This rank's indices for epoch ``epoch`` from global ``start``, as int64 chunks.

        Pure: reads only the configuration. ``count`` limits how many indices are produced.
        """
        total = self.rank_samples(start) if count is None else min(count, self.rank_samples(start))
        permutation = self._permutation_for(epoch)
        done, size = 0, _FIRST_CHUNK
        while done < total:
            n = min(size, total - done)
            positions = start + self._rank + self._world_size * np.arange(done, done + n, dtype=np.int64)
            positions %= self._length  # the padded tail wraps to the start of the epoch's order
            yield permutation(positions) if permutation is not None else positions
            done += n
            size = min(2 * size, _MAX_CHUNK)

    def _permutation_for(self, epoch: int) -> Permutation | None:
        if not self._shuffle:
            return None
        cached = self._permutation
        if cached is None or cached.epoch != epoch:
            cached = self._permutation = Permutation(self._length, self._seed, epoch)
        return cached

    def __iter__(self) -> Iterator[int]:
        if self._driven:
            epoch, start = self._segment
            for chunk in self.index_chunks(epoch, start):
                if self._yield_keys:
                    yield from (SampleKey(i, epoch, self._seed) for i in chunk.tolist())
                else:
                    yield from chunk.tolist()
            return
        # Standalone: the position advances as indices are drawn. It is computed lazily (on the
        # first next()) so that a load_state_dict() between iter() and next() is honoured.
        epoch, start = self._begin()
        total = self.rank_samples(start)
        taken = 0
        for chunk in self.index_chunks(epoch, start):
            for index in chunk.tolist():
                taken += 1
                self._position = self.end_position(start) if taken == total else start + self._world_size * taken
                yield index
        self._position = self.end_position(start)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A small plain dict: ``version``, ``epoch``, ``position`` and what fixes the order."""
        return {
            keys.VERSION: SAMPLER_STATE_VERSION,
            keys.EPOCH: self._epoch,
            keys.POSITION: self._position,
            keys.DATASET_LENGTH: self._length,
            keys.SEED: self._seed,
            keys.SHUFFLE: self._shuffle,
            keys.WORLD_SIZE: self._world_size,
            keys.DROP_LAST: self._drop_last,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Continue from ``state_dict`` (a sampler's or a ResumableDataLoader's state).

        Args:
            state_dict: the state to resume from.
            strict: refuse a state whose dataset length, seed or shuffle differ from this
                sampler's. With ``strict=False`` the position is kept but applied to this
                sampler's order, so the rest of that epoch is not the uninterrupted run's.

        Raises:
            ResumeError: the state is malformed or does not match; nothing was changed.
        """
        self._restore(state_dict, strict=strict, what=_WHAT)

    def _restore(self, state: Mapping[str, Any], *, strict: bool, what: str) -> None:
        """Validate ``state`` (errors name ``what``), then apply it."""
        epoch, position = self._validated(state, strict=strict, what=what)
        self._epoch, self._position, self._pinned = epoch, position, False

    def _validated(self, state: Mapping[str, Any], *, strict: bool, what: str) -> tuple[int, int]:
        """Check a state against this configuration; return its (epoch, position)."""
        state = require_mapping(state, what)
        check_version(state, SAMPLER_STATE_VERSION, what)
        epoch = require_int(state, keys.EPOCH, what, minimum=0)
        position = require_int(state, keys.POSITION, what, minimum=0)
        length = require_int(state, keys.DATASET_LENGTH, what, minimum=1)
        seed = require_int(state, keys.SEED, what)
        shuffle = require_bool(state, keys.SHUFFLE, what)
        saved_world = require_int(state, keys.WORLD_SIZE, what, minimum=1)
        require_bool(state, keys.DROP_LAST, what)
        if keys.BATCH_SIZE in state:
            require_int(state, keys.BATCH_SIZE, what, minimum=1)
        if strict:
            for field, saved, mine in (
                (keys.DATASET_LENGTH, length, self._length),
                (keys.SEED, seed, self._seed),
                (keys.SHUFFLE, shuffle, self._shuffle),
            ):
                if saved != mine:
                    raise ResumeError(
                        f"{field.replace('_', ' ')} changed: checkpoint has {saved!r}, {what} has {mine!r}; "
                        f"build the {what} with {field}={saved!r} to resume exactly, or pass "
                        f"strict=False to keep the position in the new order"
                    )
        # The largest position a run can reach is the padded end: length + world_size - 1.
        limit = length + saved_world - 1
        if position > limit:
            raise ResumeError(
                f"{what} state field 'position' is {position}, past the end of an epoch of "
                f"{length} samples over {saved_world} ranks (at most {limit})"
            )
        return epoch, position

