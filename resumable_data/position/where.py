"""``where``: which samples a map-style run reads at which batch, and where a sample is read.

The order of an epoch is a keyed permutation evaluated per position (``core.permutation``), so both
directions cost one position each, at any dataset size: the samples of a batch are the permutation
at its positions, and the position of a sample is the permutation's inverse at it. The batches are
those of a ``ResumableDataLoader`` with the state's layout (batch size, world size, drop_last):
batch ``k`` of an epoch holds positions ``[k*W*B, (k+1)*W*B)``, rank ``r`` the ones ``r`` apart by
``W``. A batch's *step* is its number in the run, counting every earlier epoch's batches over the
whole dataset (with gradient accumulation ``g``, the optimizer step is ``step // g``). Batches
before the state's position are *read*, or *skipped* when a ``skip`` moved past them
(``map.skipped``); the rest are *unread*; with ``drop_last``, positions past the last full batch
are *dropped*.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.state import check_int_arg
from ..errors import ResumeError
from .layout import MapLayout
from .source import Source, find_state

__all__ = ["DROPPED", "READ", "SKIPPED", "UNREAD", "BatchReport", "SampleReport", "WhereReport", "locate", "where"]

READ, SKIPPED, UNREAD, DROPPED = "read", "skipped", "unread", "dropped"
MAX_POSITIONS = 100_000  # a --positions range is printed position by position


@dataclass(frozen=True)
class BatchReport:
    """One batch of every rank (or of one): where it lies and what it holds.

    Attributes:
        epoch: Its epoch.
        batch: Its number in the epoch.
        step: Its number in the run (see the module docstring).
        start: The global position it begins at.
        end: The global position after it.
        status: ``read``, ``skipped`` or ``unread`` (relative to the state's position).
        indices: Sample indices by rank.
    """

    epoch: int
    batch: int
    step: int
    start: int
    end: int
    status: str
    indices: dict[int, list[int]]


@dataclass(frozen=True)
class SampleReport:
    """Where a sample is read in an epoch (twice when the padded tail repeats it).

    Attributes:
        sample: The dataset index.
        epoch: The epoch.
        position: Its global position in the epoch's order.
        rank: The rank that reads it.
        batch: The batch of the epoch that holds it.
        step: That batch's number in the run.
        status: ``read``, ``skipped``, ``unread`` or ``dropped``.
    """

    sample: int
    epoch: int
    position: int
    rank: int
    batch: int
    step: int
    status: str


@dataclass(frozen=True)
class WhereReport:
    """The answer of :func:`where` or :func:`locate`, with the state it is about."""

    key: str
    epoch: int
    position: int
    epoch_length: int
    world_size: int
    batch_size: int
    skipped: list[list[int]]
    batches: list[BatchReport] = field(default_factory=list)
    samples: list[SampleReport] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The human-readable answer."""
        skipped = ", ".join(f"[{a}, {b})" for a, b in self.skipped) or "none"
        out = [
            f"data state {self.key}: epoch {self.epoch}, position {self.position} of {self.epoch_length}, "
            f"world size {self.world_size}, batch size {self.batch_size}; skipped positions: {skipped}"
        ]
        for b in self.batches:
            out.append(
                f"  step {b.step} (epoch {b.epoch}, batch {b.batch}, positions {b.start}..{b.end - 1}) {b.status}"
            )
            out.extend(f"    rank {rank}: {indices}" for rank, indices in b.indices.items())
        for s in self.samples:
            out.append(
                f"  sample {s.sample}: epoch {s.epoch}, position {s.position}, rank {s.rank}, batch {s.batch}, "
                f"step {s.step}: {s.status}"
            )
        return out

    def as_json(self) -> dict[str, Any]:
        """The same answer as plain data (for scripts)."""
        out = asdict(self)
        for b in out["batches"]:
            b["indices"] = {str(rank): indices for rank, indices in b["indices"].items()}
        return out


def where(
    source: Source,
    *,
    next: int | None = None,
    previous: int | None = None,
    step: int | None = None,
    positions: tuple[int, int] | None = None,
    rank: int | None = None,
    batch_size: int | None = None,
    key: str | None = None,
) -> WhereReport:
    """The sample indices of batches around a map-style data state, by rank.

    Give one of ``next``, ``previous``, ``step`` or ``positions`` (none: ``next=1``).

    Args:
        source: A ``ResumableSampler`` / ``ResumableDataLoader`` state dict, or a checkpoint as
            ``python -m resumable_data inspect`` takes it.
        next: The next ``n`` batches the restored loader yields (into the following epochs).
        previous: The last ``n`` batches of the state's epoch before its position.
        step: The batch of that number in the run (see the module docstring).
        positions: ``(a, b)``: the global positions ``[a, b)`` of the state's epoch, one row each
            (a :class:`BatchReport` of one sample, on the rank that reads it).
        rank: Only this rank's indices.
        batch_size: For a sampler's state, which has none.
        key: Which data state of a checkpoint holding several: the key path ``inspect`` prints.

    Returns:
        The batches, in the order they are (or were) read.

    Raises:
        ResumeError: a bad source or argument; the message names it.

    Example:
        >>> from resumable_data import ResumableDataLoader
        >>> loader = ResumableDataLoader(list(range(10)), batch_size=2, seed=0)
        >>> batches = iter(loader)
        >>> _ = next(batches)
        >>> where(loader.state_dict()).batches[0].indices == {0: next(batches).tolist()}
        True
    """
    chosen = [
        name
        for name, value in (("next", next), ("previous", previous), ("step", step), ("positions", positions))
        if value is not None
    ]
    if len(chosen) > 1:
        raise ResumeError(f"give one of next, previous, step and positions, not {' and '.join(chosen)}")
    found = find_state(source, key)
    layout = MapLayout.parse(found.state, batch_size=batch_size)
    ranks = _ranks(layout, rank)
    if previous is not None:
        batches = _previous(layout, check_int_arg("previous", previous, minimum=1), ranks)
    elif step is not None:
        batches = [_step(layout, check_int_arg("step", step, minimum=0), ranks)]
    elif positions is not None:
        batches = _positions(layout, positions, ranks)
    else:
        batches = _next(layout, check_int_arg("next", 1 if next is None else next, minimum=1), ranks)
    return _report(found.key, layout, batches=batches)


def locate(
    source: Source, sample: int, *, epoch: int | None = None, batch_size: int | None = None, key: str | None = None
) -> WhereReport:
    """Where sample ``sample`` is read in an epoch (default: the state's): position, rank, batch, step, status.

    One inverse permutation evaluation, whatever the dataset size. A sample the padded tail repeats
    (no ``drop_last``, the dataset not a multiple of the world size) is reported at both positions.

    Args:
        source: A state dict or a checkpoint, as :func:`where` takes it.
        sample: The dataset index.
        epoch: The epoch to look in (default: the state's); an earlier one counts as read, a later one
            as unread (skips are known for the state's epoch only).
        batch_size: For a sampler's state, which has none.
        key: Which data state of a checkpoint holding several.

    Returns:
        The report, its ``samples`` one :class:`SampleReport` per position that reads the sample.

    Raises:
        ResumeError: a bad source, or ``sample`` is not in the epoch's order.
    """
    found = find_state(source, key)
    layout = MapLayout.parse(found.state, batch_size=batch_size)
    epoch = layout.epoch if epoch is None else check_int_arg("epoch", epoch, minimum=0)
    sampler = layout.samplers[0]
    length = layout.epoch_length(epoch)
    check_int_arg("sample", sample, minimum=0)
    if sample >= length:
        why = (
            f"it was appended after the checkpoint and joins at epoch {epoch + 1}"
            if sample < sampler.dataset_length
            else f"the dataset has {sampler.dataset_length} samples"
        )
        raise ResumeError(f"sample {sample} is not in epoch {epoch}'s order of {length} samples: {why}")
    position = layout.position_of(epoch, sample)
    # The padded tail re-reads the order's first positions after its end.
    end = sampler.end_position(epoch, 0)
    occurrences = [position] + ([position + length] if position + length < end else [])
    samples = []
    for q in occurrences:
        batch = layout.batch_of(q)
        samples.append(
            SampleReport(
                sample,
                epoch,
                q,
                q % layout.world_size,
                batch,
                layout.step_of(epoch, batch),
                _status(layout, epoch, q, q + 1),
            )
        )
    return _report(found.key, layout, samples=samples)


def _ranks(layout: MapLayout, rank: int | None) -> list[int]:
    if rank is None:
        return list(range(layout.world_size))
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < layout.world_size:
        raise ResumeError(f"rank should be in [0, {layout.world_size}) (the state's world size), but got rank={rank!r}")
    return [rank]


def _status(layout: MapLayout, epoch: int, start: int, end: int) -> str:
    """A stretch of positions relative to the state: read, skipped, unread, or dropped (no batch reads it)."""
    if start >= layout.read_limit(epoch):
        return DROPPED
    if epoch != layout.epoch:
        return READ if epoch < layout.epoch else UNREAD
    if start >= layout.position:
        return UNREAD
    if any(a <= start and end <= b for a, b in layout.skipped):
        return SKIPPED
    return READ


def _batch(layout: MapLayout, epoch: int, start: int, ranks: list[int]) -> BatchReport:
    batch = layout.batch_of(start)
    end = layout.batcher(0).position_after(epoch, start, 1)
    indices = {rank: layout.indices(epoch, start, rank) for rank in ranks}
    return BatchReport(
        epoch, batch, layout.step_of(epoch, batch), start, end, _status(layout, epoch, start, end), indices
    )


def _next(layout: MapLayout, n: int, ranks: list[int]) -> list[BatchReport]:
    epoch, start = (layout.epoch + 1, 0) if layout.done() else (layout.epoch, layout.position)
    out: list[BatchReport] = []
    batcher = layout.batcher(0)
    while len(out) < n:
        if batcher.batch_count(epoch, start) == 0:
            if start == 0:  # an epoch without a batch (drop_last, fewer samples than a batch): none ever
                break
            epoch, start = epoch + 1, 0
            continue
        out.append(_batch(layout, epoch, start, ranks))
        start = out[-1].end
    return out


def _previous(layout: MapLayout, n: int, ranks: list[int]) -> list[BatchReport]:
    # With drop_last a finished epoch's position counts the trimmed tail too: no batch read it.
    last = min(layout.batch_of(layout.position - 1), layout.batches_in_epoch(layout.epoch) - 1)
    if layout.position == 0 or last < 0:
        return []
    first = max(0, last - n + 1)
    return [_batch(layout, layout.epoch, layout.batch_start(layout.epoch, k), ranks) for k in range(first, last + 1)]


def _step(layout: MapLayout, step: int, ranks: list[int]) -> BatchReport:
    per_epoch = layout.batches_in_epoch(layout.epoch + 1)
    if per_epoch == 0:
        raise ResumeError("step: an epoch of this layout has no batch (drop_last, fewer samples than a batch)")
    epoch, batch = divmod(step, per_epoch)
    if epoch == layout.epoch and batch >= layout.batches_in_epoch(epoch):
        raise ResumeError(f"step {step}: epoch {epoch} has only {layout.batches_in_epoch(epoch)} batches")
    return _batch(layout, epoch, layout.batch_start(epoch, batch), ranks)


def _positions(layout: MapLayout, positions: tuple[int, int], ranks: list[int]) -> list[BatchReport]:
    a, b = positions
    epoch, end = layout.epoch, layout.samplers[0].end_position(layout.epoch, 0)
    if not (0 <= a < b <= end):
        raise ResumeError(f"positions should be A:B with 0 <= A < B <= {end} (epoch {epoch}'s end), but got {a}:{b}")
    if b - a > MAX_POSITIONS:
        raise ResumeError(f"positions: at most {MAX_POSITIONS} at a time, but got {b - a}")
    out = []
    for q in range(a, b):
        rank = q % layout.world_size
        if rank not in ranks:
            continue
        sample = layout.sample_at(epoch, q)
        batch = layout.batch_of(q)
        status = _status(layout, epoch, q, q + 1)
        out.append(BatchReport(epoch, batch, layout.step_of(epoch, batch), q, q + 1, status, {rank: [sample]}))
    return out


def _report(key: str, layout: MapLayout, **answers: Any) -> WhereReport:
    return WhereReport(
        key=key,
        epoch=layout.epoch,
        position=layout.position,
        epoch_length=layout.epoch_length(layout.epoch),
        world_size=layout.world_size,
        batch_size=layout.batch_size,
        skipped=[list(pair) for pair in layout.skipped],
        **answers,
    )
