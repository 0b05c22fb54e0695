"""ResumableSampler: an epoch's order as a pure function of ``(seed, epoch, length)``, resumable in O(1).

Positions are counted globally. Epoch ``e`` has one global order of the dataset (shuffled by a
keyed :class:`~resumable_data.core.permutation.Permutation`, or ``0..N-1``); ranks interleave it from the
position ``p`` where this stretch of the epoch starts: rank ``r`` takes global positions
``p + r, p + r + W, p + r + 2W, ...``. Because every rank advances in lockstep (as under DDP), the
saved state — ``epoch`` and ``position`` (global samples consumed in the epoch) — is the same on all
ranks, and any rank's state can be loaded into any rank of a world of a different size: the new
ranks interleave the *rest* of the same global order.

The uneven tail is handled as ``torch.utils.data.DistributedSampler`` does: padded by wrapping to the
start of the epoch's order, or trimmed with ``drop_last=True``.

Growing datasets. A checkpoint loads into a sampler over a *longer* dataset as ``growth=`` says
(see ``core.growth``): ``"next_epoch"`` finishes the restored epoch over the checkpoint's length, in
its order; ``"append"`` finishes it with the new samples shuffled after the rest of its order. The
epoch's order is then a :class:`~resumable_data.core.permutation.PiecewisePermutation` over the
lengths it was built over, which the state records as ``"epoch_lengths"`` (with ``"version": 3``;
a state of an epoch that never grew is the version-2 state it always was). The next epoch's order
covers the whole dataset. Positions stay global counts, so any world size still resumes.

Skipped stretches. A state that ``skip`` moved past a bad stretch records the positions it skipped as
``"skipped"`` (``"version": 4``, see ``map.skipped``); the sampler writes them back until its epoch ends.

Which epoch the next ``iter()`` covers, and from where, is an
:class:`~resumable_data.core.cursor.EpochCursor` (the epoch rules live there). ``iter()`` is pure
given it: the selected epoch from its start (or from a pending restore), as ``DistributedSampler``,
so inspecting the sampler (``list(sampler)``) changes nothing a later pass yields. Each iterator
owns its progress and is itself stateful, so a consumer that snapshots iterators (torchdata's
``StatefulDataLoader``) gets the state of the very iterator whose indices it handed out, and an
iterator it creates and throws away on a restore moves nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

import numpy as np
import torch
import torch.utils.data

from ..core import state as keys
from ..core.cursor import EpochCursor, Segment
from ..core.growth import ERROR, check_growth, grown_pieces, require_pieces
from ..core.permutation import EXACT_MAX, PiecewisePermutation
from ..core.state import check_int_arg, check_version, require_bool, require_int, require_mapping
from ..errors import ResumeError, ResumeWarning
from .skipped import SKIPPED, SKIPPED_STATE_VERSION, Ranges, require_skipped

__all__ = ["ResumableSampler"]

SAMPLER_STATE_VERSION = 2
# Version 3: version 2 plus "epoch_lengths", written only for an epoch whose order grew (so an older
# release refuses what it would misread, and reads every other state as before).
GROWN_STATE_VERSION = 3
# Version 1 (resumable_data 0.1.0) differs only in the shuffled order of at most EXACT_MAX samples
# (core.permutation.ORDER_VERSION); its other states describe the same order and still load.
_ORDER_CHANGED_BEFORE = 2
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
        seed: the shuffle seed; the order never depends on the global RNG. ``None`` takes
            ``torch.initial_seed()`` and, on ``load_state_dict``, adopts the checkpoint's seed.
        rank: this process's rank in ``[0, world_size)``.
        world_size: number of data-parallel processes.
        drop_last: trim the uneven tail so every rank gets the same number of samples, instead of
            padding it with the start of the epoch's order.
        adopt_checkpoint_seed: the seed is a default rather than a choice: ``load_state_dict``
            takes the checkpoint's seed (with a :class:`ResumeWarning` saying so) instead of
            refusing a different one. Implied by ``seed=None``.
        growth: what ``load_state_dict`` does with a checkpoint taken on a shorter dataset
            (samples appended since): ``"error"`` (default) refuses it; ``"next_epoch"`` finishes
            the restored epoch over the checkpoint's samples, in its order, and takes the new ones
            from the next epoch; ``"append"`` finishes it with the new samples, shuffled, after the
            rest of its order. A shorter dataset is always refused.

    Epochs, as ``DistributedSampler``: every ``iter()`` yields the selected epoch from its start,
    and ``set_epoch(e)`` selects epoch ``e``. After ``load_state_dict`` the first iterator that
    draws continues from the restored position (``set_epoch`` with the restored epoch keeps it, so
    loops that call ``set_epoch(epoch)`` at the top of every epoch resume mid-epoch). ``epochs(n)``
    yields the epochs still to run.

    ``state_dict()`` reports the newest iterator's progress, advanced as its indices are *drawn*.
    torchdata's ``StatefulDataLoader`` snapshots the iterator when it sends indices to a worker, so
    its state is exact at every point (mid-epoch, after the loop, with workers and prefetching). A
    plain ``DataLoader`` with workers draws ahead of what it has yielded: use
    :class:`~resumable_data.ResumableDataLoader` there, which counts only batches handed out.

    Example:
        >>> from torchdata.stateful_dataloader import StatefulDataLoader
        >>> data = list(range(10))
        >>> loader = StatefulDataLoader(data, sampler=ResumableSampler(data, seed=0), batch_size=4)
        >>> batches = iter(loader)
        >>> first = next(batches).tolist()
        >>> state = loader.state_dict()
        >>> resumed = StatefulDataLoader(data, sampler=ResumableSampler(data, seed=0), batch_size=4)
        >>> resumed.load_state_dict(state)
        >>> [b.tolist() for b in resumed] == [b.tolist() for b in batches]
        True
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        shuffle: bool = True,
        seed: int | None = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        adopt_checkpoint_seed: bool = False,
        growth: str = ERROR,
    ) -> None:
        length = data_source if isinstance(data_source, int) else len(data_source)
        self._length = check_int_arg("dataset length", length, minimum=1)
        self._world_size = check_int_arg("world_size", world_size, minimum=1)
        check_int_arg("rank", rank, minimum=0)
        if rank >= world_size:
            raise ResumeError(f"rank should be in [0, world_size), but got rank={rank}, world_size={world_size}")
        if seed is None:
            seed, adopt_checkpoint_seed = torch.initial_seed(), True
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ResumeError(f"seed should be an int or None, but got seed={seed!r}")
        self._rank = rank
        self._shuffle = bool(shuffle)
        self._seed = seed
        self._adopt_seed = bool(adopt_checkpoint_seed)
        self._drop_last = bool(drop_last)
        self._growth = check_growth(growth)
        # The epoch a restore grew and the piece ends of its order, else None (the order is then
        # over the whole dataset); dropped as soon as the cursor enters another epoch.
        self._grown: tuple[int, tuple[int, ...]] | None = None
        # The epoch a restored state had skipped stretches of (map.skipped) and those ranges, else None.
        self._skipped: tuple[int, Ranges] | None = None
        self._cursor = EpochCursor("sampler", on_new_epoch=self._forget_epoch)
        self._permutation: PiecewisePermutation | None = None

    # -- read-only views ---------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the newest iterator (or of ``set_epoch``, or the restored one)."""
        return self._cursor.epoch

    @property
    def position(self) -> int:
        """Global samples the newest iterator has drawn in its epoch (all ranks together)."""
        return self._cursor.position

    @property
    def cursor(self) -> EpochCursor:
        """Which epoch the next pass covers; a loader that drives this sampler reads and advances it."""
        return self._cursor

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

    @property
    def growth(self) -> str:
        """What a restore does with a checkpoint taken on a shorter dataset (see the class docstring)."""
        return self._growth

    def epoch_lengths(self, epoch: int) -> tuple[int, ...]:
        """The lengths epoch ``epoch``'s order is built over: ``(dataset_length,)`` unless a restore
        grew the current epoch (then the checkpoint's lengths, plus this one's with ``"append"``)."""
        if self._grown is not None and epoch == self._grown[0]:
            return self._grown[1]
        return (self._length,)

    def epoch_length(self, epoch: int) -> int:
        """Samples in epoch ``epoch``'s order (all ranks together, before padding or trimming)."""
        return self.epoch_lengths(epoch)[-1]

    def skipped_ranges(self, epoch: int) -> Ranges:
        """Global position ranges ``(start, end)`` of epoch ``epoch`` that a ``skip`` moved past
        without reading (see ``map.skipped``); empty unless the restored state had some."""
        return self._skipped[1] if self._skipped is not None and self._skipped[0] == epoch else ()

    def _forget_epoch(self) -> None:
        self._grown = None
        self._skipped = None

    # -- epochs --------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The next pass is epoch ``epoch`` from its start; a pending restore of that epoch is kept."""
        self._cursor.set_epoch(epoch)

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """``for epoch in sampler.epochs(n)``: the epochs still to run, each already ``set_epoch``-ed."""
        return self._cursor.pass_epochs(num_epochs)

    def __len__(self) -> int:
        """This rank's samples in a full pass of the current epoch (a restored epoch that grew with
        ``growth="next_epoch"`` keeps the checkpoint's length)."""
        return self.rank_samples(self._cursor.epoch, 0)

    # -- the arithmetic of a stretch of an epoch -----------------------------------------------
    def rank_samples(self, epoch: int, start: int) -> int:
        """Samples each rank takes when epoch ``epoch`` continues from global position ``start``."""
        remaining = max(0, self.epoch_length(epoch) - start)
        return remaining // self._world_size if self._drop_last else -(-remaining // self._world_size)

    def end_position(self, epoch: int, start: int) -> int:
        """The position that marks the epoch done when it continues from ``start`` (>= its length)."""
        return max(self.epoch_length(epoch), start + self._world_size * self.rank_samples(epoch, start))

    def position_after(self, epoch: int, start: int, taken: int) -> int:
        """Global position once every rank has taken ``taken`` samples from ``start``."""
        if taken >= self.rank_samples(epoch, start):
            return self.end_position(epoch, start)
        return start + self._world_size * taken

    def is_end(self, epoch: int, position: int) -> bool:
        """Whether ``position`` means epoch ``epoch`` is exhausted."""
        return position >= self.epoch_length(epoch)

    def index_chunks(
        self, epoch: int, start: int, count: int | None = None, *, first_chunk: int = _FIRST_CHUNK
    ) -> Iterator[np.ndarray]:
        """This rank's indices for epoch ``epoch`` from global ``start``, as int64 chunks.

        Pure: reads only the configuration. ``count`` limits how many indices are produced;
        ``first_chunk`` is the size of the first chunk (a restore needs just one batch), after which
        chunks double up to 65536.
        """
        samples = self.rank_samples(epoch, start)
        total = samples if count is None else min(count, samples)
        length, permutation = self.epoch_length(epoch), self._permutation_for(epoch)
        done, size = 0, max(1, first_chunk)
        while done < total:
            n = min(size, total - done)
            positions = start + self._rank + self._world_size * np.arange(done, done + n, dtype=np.int64)
            positions %= length  # the padded tail wraps to the start of the epoch's order
            yield permutation(positions) if permutation is not None else positions
            done += n
            size = min(2 * size, _MAX_CHUNK)

    def _permutation_for(self, epoch: int) -> PiecewisePermutation | None:
        if not self._shuffle:
            return None  # the pieces are consecutive ranges: in order, they are 0..length-1
        ends, cached = self.epoch_lengths(epoch), self._permutation
        if cached is None or cached.epoch != epoch or cached.seed != self._seed or cached.ends != ends:
            cached = self._permutation = PiecewisePermutation(ends, self._seed, epoch)
        return cached

    def __iter__(self) -> Iterator[int]:
        return _SamplerIterator(self)

    # -- state ---------------------------------------------------------------------------------
    def state_for(self, epoch: int, position: int) -> dict[str, Any]:
        """The state dict of this sampler's configuration at ``(epoch, position)``."""
        lengths = self.epoch_lengths(epoch)
        grown = lengths != (self._length,)
        skipped = [list(pair) for pair in self.skipped_ranges(epoch) if pair[1] <= position]
        version = GROWN_STATE_VERSION if grown else SAMPLER_STATE_VERSION
        state: dict[str, Any] = {
            keys.VERSION: SKIPPED_STATE_VERSION if skipped else version,
            keys.EPOCH: epoch,
            keys.POSITION: position,
            keys.DATASET_LENGTH: self._length,
            keys.SEED: self._seed,
            keys.SHUFFLE: self._shuffle,
            keys.WORLD_SIZE: self._world_size,
            keys.DROP_LAST: self._drop_last,
        }
        if grown:
            state[keys.EPOCH_LENGTHS] = list(lengths)
        if skipped:
            state[SKIPPED] = skipped
        return state

    def state_dict(self) -> dict[str, Any]:
        """A small plain dict: ``version``, ``epoch``, ``position`` (the newest iterator's) and what fixes the order.

        Examples:
            >>> sampler = ResumableSampler(10, seed=0)
            >>> indices = iter(sampler)
            >>> [next(indices) for _ in range(3)]
            [9, 8, 6]
            >>> sampler.state_dict()
            {'version': 2, 'epoch': 0, 'position': 3, 'dataset_length': 10, 'seed': 0, 'shuffle': True,
             'world_size': 1, 'drop_last': False}
        """
        return self.state_for(self._cursor.epoch, self._cursor.position)

    def load_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Continue from ``state_dict`` (a sampler's or a ResumableDataLoader's state).

        Args:
            state_dict: the state to resume from.
            strict: refuse a state whose dataset length, seed or shuffle differ from this
                sampler's (a longer dataset is taken as ``growth`` says). With ``strict=False``
                the position is kept but applied to this sampler's order, so the rest of that
                epoch is not the uninterrupted run's.

        Raises:
            ResumeError: the state is malformed or does not match; nothing was changed.
        """
        self.check_state(state_dict, strict=strict, what=_WHAT)()

    def check_state(
        self,
        state: Mapping[str, Any],
        *,
        strict: bool,
        what: str,
        through_iterator: bool = False,
        for_loader: bool = False,
    ) -> Callable[[], Segment]:
        """Validate ``state`` (errors name ``what``); return a thunk that restores it.

        The thunk moves the cursor to the state's position and returns that as the current
        segment. Nothing changes until it is called, so a caller can validate its own fields too
        before anything moves. ``through_iterator``: the state is restored into a sampler pass's
        iterator; ``for_loader``: into a loader (see :meth:`EpochCursor.restore`).
        """
        state = require_mapping(state, what)
        version = require_int(state, keys.VERSION, what)
        old_order = version < _ORDER_CHANGED_BEFORE
        if not old_order and version not in (GROWN_STATE_VERSION, SKIPPED_STATE_VERSION):
            check_version(state, SAMPLER_STATE_VERSION, what)
        epoch = require_int(state, keys.EPOCH, what, minimum=0)
        position = require_int(state, keys.POSITION, what, minimum=0)
        length = require_int(state, keys.DATASET_LENGTH, what, minimum=1)
        # A seed is any int64 or uint64 (torch.initial_seed() is a uint64).
        seed = require_int(state, keys.SEED, what, minimum=-(2**63), maximum=2**64 - 1)
        shuffle = require_bool(state, keys.SHUFFLE, what)
        saved_world = require_int(state, keys.WORLD_SIZE, what, minimum=1)
        require_bool(state, keys.DROP_LAST, what)
        if keys.BATCH_SIZE in state:
            require_int(state, keys.BATCH_SIZE, what, minimum=1)
        # Version 4 is version 2 or 3 plus the skipped ranges: epoch_lengths when the epoch grew.
        grown_state = version == GROWN_STATE_VERSION or (
            version == SKIPPED_STATE_VERSION and keys.EPOCH_LENGTHS in state
        )
        saved_lengths = require_pieces(state, keys.EPOCH_LENGTHS, what, at_most=length) if grown_state else (length,)
        skipped = require_skipped(state, what, position=position) if version == SKIPPED_STATE_VERSION else ()
        adopt = seed != self._seed and self._adopt_seed
        if old_order:
            check_version(state, 1, what)
            if strict and shuffle and length <= EXACT_MAX:
                raise ResumeError(
                    f"{what} state has version 1: its shuffled order of {length} samples (at most "
                    f"{EXACT_MAX}) was not uniformly random and has changed in this resumable_data "
                    f"(version {SAMPLER_STATE_VERSION}); resume with resumable_data 0.1.0, which wrote "
                    "it, or pass strict=False to load_state_dict to keep the position in the new order"
                )
        # The largest position a run can reach is the padded end: epoch length + world_size - 1.
        limit = saved_lengths[-1] + saved_world - 1
        if position > limit:
            raise ResumeError(
                f"{what} state field 'position' is {position}, past the end of an epoch of "
                f"{saved_lengths[-1]} samples over {saved_world} ranks (at most {limit})"
            )
        if length == self._length:
            lengths = saved_lengths
        elif length < self._length and self._growth != ERROR:
            lengths = grown_pieces(self._growth, saved_lengths, self._length, exhausted=position >= saved_lengths[-1])
        elif strict:
            raise ResumeError(self._length_changed(what, length))
        else:
            lengths = (self._length,)
        if strict:
            if seed != self._seed and not adopt:
                raise ResumeError(
                    f"seed changed: checkpoint has {seed}, {what} has {self._seed}; build the {what} "
                    f"with seed={seed} to resume exactly, or pass strict=False to load_state_dict to "
                    "keep the position in the new order"
                )
            if shuffle != self._shuffle:
                raise ResumeError(
                    f"shuffle changed: checkpoint has {shuffle}, {what} has {self._shuffle}; build the "
                    f"{what} with shuffle={shuffle} to resume exactly, or pass strict=False to "
                    "load_state_dict to keep the position in the new order"
                )
        # A finished epoch's padded end depends on the world size that wrote it: bring it within
        # this sampler's own bound, so its state_dict() loads into an identical sampler again.
        position = min(position, lengths[-1] + self._world_size - 1)
        grown = None if lengths == (self._length,) else lengths

        def apply() -> Segment:
            if adopt:
                warnings.warn(
                    f"{what}: adopting the checkpoint's seed {seed} (this {what} was built without an "
                    f"explicit seed and had {self._seed}); pass seed= to pin it",
                    ResumeWarning,
                    stacklevel=4,
                )
                self._seed = seed
            self._grown = None if grown is None else (epoch, grown)
            self._skipped = (epoch, skipped) if skipped else None
            return self._cursor.restore(
                epoch, position, position >= lengths[-1], through_iterator=through_iterator, for_loader=for_loader
            )

        return apply

    def _length_changed(self, what: str, length: int) -> str:
        """The refusal of a checkpoint taken on a dataset of another length, with the remedies."""
        if length > self._length:
            change = (
                "a dataset may grow since a checkpoint (growth=), but not shrink: the positions already "
                "consumed would name other samples"
            )
        else:
            change = (
                f"to take in the {self._length - length} appended samples, build the {what} with "
                "growth='next_epoch' (they join at the next epoch) or growth='append' (they join the rest "
                "of this epoch)"
            )
        return (
            f"dataset length changed: checkpoint has {length}, {what} has {self._length}; resume with the "
            f"dataset the checkpoint was taken on ({length} samples); {change}; or pass strict=False to "
            "load_state_dict to keep the position in the new order"
        )


class _SamplerIterator(Iterator[int]):
    """One pass of a standalone sampler over its stretch of an epoch; owns its progress, itself stateful.

    The stretch is entered lazily, on the first ``next()``, so that a ``load_state_dict`` between
    ``iter()`` and ``next()`` (what StatefulDataLoader does on a restore) decides it.
    """

    def __init__(self, sampler: ResumableSampler) -> None:
        self._sampler = sampler
        self._segment: Segment | None = None
        self._indices: Iterator[int] = iter(())
        self._taken = 0
        self._total = 0

    def __iter__(self) -> _SamplerIterator:
        return self

    def _enter(self, segment: Segment) -> Segment:
        sampler = self._sampler
        self._segment, self._taken = segment, 0
        self._total = sampler.rank_samples(segment.epoch, segment.start)
        chunks = sampler.index_chunks(segment.epoch, segment.start)
        self._indices = (index for chunk in chunks for index in chunk.tolist())
        return segment

    def __next__(self) -> int:
        sampler = self._sampler
        segment = self._segment or self._enter(sampler.cursor.begin_pass())
        if self._taken >= self._total:
            sampler.cursor.advance_pass(segment, sampler.end_position(segment.epoch, segment.start), True)
            raise StopIteration
        index = next(self._indices)
        self._taken += 1
        position = sampler.position_after(segment.epoch, segment.start, self._taken)
        sampler.cursor.advance_pass(segment, position, sampler.is_end(segment.epoch, position))
        return index

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state after the indices this iterator has drawn (before any: where it will start)."""
        if self._segment is None:
            return self._sampler.state_for(*self._sampler.cursor.next_pass())
        epoch = self._segment.epoch
        return self._sampler.state_for(epoch, self._sampler.position_after(epoch, self._segment.start, self._taken))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue this iterator from ``state_dict`` (the sampler's next pass too, if this one never draws)."""
        self._enter(self._sampler.check_state(state_dict, strict=True, what=_WHAT, through_iterator=True)())
