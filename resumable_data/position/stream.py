"""``where`` for a stream: the shard and record of every record of a StreamLoader's batches.

A stream's checkpoint holds per-slot positions (``StreamLoader``: a pipeline state per (rank,
worker) slot), not the pipeline: which records a position stands for depends on the shard list,
their sizes and the stages, which are code. So the caller passes the pipeline, built as the
training script builds it (unstarted), and :func:`where_stream` loads each slot's state into it,
as a restore does. The next batches: it asks the pipeline for the keys of its next records
(:meth:`Stream.upcoming_keys <resumable_data.streams.Stream.upcoming_keys>`). Any batch of an
epoch (``previous``, ``step``): it asks for the slot's whole epoch as positions
(:meth:`Stream.epoch_positions <resumable_data.streams.Stream.epoch_positions>`) and deals the
rank's batches from the slots' batch counts by arithmetic (:mod:`.dealing`). Either way computed
from the positions, no record read, at a cost in proportion to the batches asked for (a shuffle
window's order, once per window), wherever in the epoch the state stands. The batches are dealt as
the loader deals them: each slot's records cut into batches of ``batch_size`` (its last one kept
unless ``drop_last``), a rank's slots taken round-robin (from slot 0 at an epoch's start), a slot
that ends skipped for the rest of the epoch, then the next epoch from its start. A batch the
state's epoch has handed out is ``read``, or ``skipped`` where a ``skip`` moved past it
(:mod:`resumable_data.streams.skipped`); the rest are ``unread``.

Answered: a :class:`~resumable_data.streams.ShardedIterable` with known sizes (``sizes=``,
``from_index``, a reader that counts), behind ``map`` and ``shuffle_window``. Refused, naming the
stage: a stage whose next records depend on the records it reads (``shuffle_buffer``'s draws over
what it holds, ``filter``, ``mix``, ``pack``, ``take``, ``batch_by_tokens``), and a source that
reads by cursors (sizes unknown): answering would mean reading the data, which a restored loader
does (a replay), not ``where``. ``previous`` and ``step`` also refuse an epoch whose layout changed
at a resume (another ``num_workers`` or world size): the positions before the change were other
slots'; ``next`` answers it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.state import check_int_arg
from ..errors import ResumeError
from ..streams.base import Key, Stream
from ..streams.batch import Batch
from .source import Source, find_stream_state
from .stream_state import LoaderState, RankEpoch, batched_pipeline, refusal, shard_names
from .where import READ, SKIPPED, UNREAD

__all__ = ["StreamBatch", "StreamWhereReport", "where_stream"]

_WHAT = "StreamLoader"
MAX_EPOCHS = 10_000  # how far --step looks: each epoch's batch counts are computed in turn


@dataclass(frozen=True)
class StreamBatch:
    """One batch of one rank, as the (restored) loader yields it.

    Attributes:
        rank: The rank that yields it.
        epoch: Its epoch.
        batch: Its number among the rank's batches of the epoch (those before the state included).
        slot: The global (rank, worker) slot whose pipeline copy reads it.
        records: ``(shard, record)`` of each record: the shard's name in the source's list and the
            record's number in the shard.
        status: ``read``, ``skipped`` or ``unread``, relative to the state (see the module docstring).
        step: Its number among the rank's batches of the run, every earlier epoch counted in full
            (None where not computed: ``next``).
    """

    rank: int
    epoch: int
    batch: int
    slot: int
    records: list[tuple[str, int]]
    status: str = UNREAD
    step: int | None = None


@dataclass(frozen=True)
class StreamWhereReport:
    """The answer of :func:`where_stream`, with the state it is about."""

    key: str
    epoch: int
    epoch_done: bool
    world_size: int
    num_workers: int
    batch_size: int
    skipped: dict[int, list[list[int]]] = field(default_factory=dict)
    batches: list[StreamBatch] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The human-readable answer."""
        workers = max(1, self.num_workers)
        skipped = "; ".join(
            f"rank {rank}: " + ", ".join(f"[{a}, {b})" for a, b in ranges) for rank, ranges in self.skipped.items()
        )
        out = [
            f"stream state {self.key}: epoch {self.epoch}{' (done)' if self.epoch_done else ''}, world size "
            f"{self.world_size}, num_workers {self.num_workers} ({self.world_size * workers} slots), "
            f"batch size {self.batch_size}; skipped batches: {skipped or 'none'}"
        ]
        for b in self.batches:
            records = " ".join(f"{shard}[{record}]" for shard, record in b.records)
            step = "" if b.step is None else f"step {b.step}, "
            out.append(f"  rank {b.rank}, {step}epoch {b.epoch}, batch {b.batch} (slot {b.slot}) {b.status}: {records}")
        return out

    def as_json(self) -> dict[str, Any]:
        """The same answer as plain data (for scripts)."""
        out = asdict(self)
        out["skipped"] = {str(rank): ranges for rank, ranges in self.skipped.items()}
        for b in out["batches"]:
            b["records"] = [list(record) for record in b["records"]]
        return out


def where_stream(
    source: Source,
    pipeline: Stream,
    *,
    batch_size: int | None = None,
    drop_last: bool = False,
    next: int | None = None,
    previous: int | None = None,
    step: int | None = None,
    rank: int | None = None,
    key: str | None = None,
) -> StreamWhereReport:
    """The shard and record of every record of batches of each rank around a StreamLoader state.

    Give one of ``next``, ``previous`` and ``step`` (none: ``next=1``).

    Args:
        source: A ``StreamLoader`` state dict (one rank's, or :meth:`StreamLoader.merge_states` of
            all ranks'), or a checkpoint as ``python -m resumable_data inspect`` takes it.
        pipeline: The stream the loader was built over, built as the training script builds it
            (same shards, sizes, seeds, stages) and not started: each slot's state is loaded into it.
            A pipeline ending in ``.batch(n)`` (a loader with ``batch_size=None``) gives the batch size.
        batch_size: The loader's ``batch_size`` (the state does not hold it).
        drop_last: The loader's ``drop_last``.
        next: The next ``n`` batches per rank the restored loader yields, into the following epochs.
        previous: The last ``n`` batches per rank of the state's epoch before its position.
        step: Each rank's batch of that number in the run: its batches of every earlier epoch
            counted in full, as the pipeline reads those epochs now (a dataset that grew since
            counts its new shards in them too).
        rank: Only this rank (default: every rank whose slots the state holds).
        key: Which StreamLoader state of a checkpoint holding several: its key path (``/dataloader``).

    Returns:
        Each rank's batches, in the order the loader yields (or yielded) them.

    Raises:
        ResumeError: a bad source or argument, a pipeline that does not fit the state, a pipeline
            whose records depend on the records it reads (the message names the stage), or, for
            ``previous`` and ``step``, an epoch whose layout changed at a resume.

    Example:
        >>> from resumable_data.streams import ShardedIterable, StreamLoader
        >>> records = {"a": [0, 1, 2, 3], "b": [4, 5, 6]}
        >>> def pipeline():
        ...     read = lambda shard, start: iter(records[shard][start:])
        ...     return ShardedIterable(["a", "b"], read_shard=read, seed=0, sizes=[4, 3]).shuffle_window(3)
        >>> loader = StreamLoader(pipeline(), batch_size=2)
        >>> batches = iter(loader)
        >>> first = next(batches).tolist()
        >>> where_stream(loader.state_dict(), pipeline(), batch_size=2).batches[0].records
        [('b', 2), ('a', 0)]
        >>> next(batches).tolist()  # b's record 2 is 6, a's record 0 is 0
        [6, 0]
        >>> where_stream(loader.state_dict(), pipeline(), batch_size=2, previous=2).batches[0].records
        [('b', 0), ('b', 1)]
        >>> first  # b's records 0 and 1
        [4, 5]
    """
    chosen = [name for name, value in (("next", next), ("previous", previous), ("step", step)) if value is not None]
    if len(chosen) > 1:
        raise ResumeError(f"give one of next, previous and step, not {' and '.join(chosen)}")
    batched = batched_pipeline(pipeline, batch_size, drop_last)
    found = find_stream_state(source, key)
    layout = LoaderState.parse(found.state)
    ranks = layout.ranks(rank)
    names = shard_names(batched.source)
    if previous is not None:
        count = check_int_arg("previous", previous, minimum=1)
        batches = [b for r in ranks for b in _previous(layout, batched, r, count, names)]
    elif step is not None:
        at = check_int_arg("step", step, minimum=0)
        batches = [_step(layout, batched, r, at, names) for r in ranks]
    else:
        count = check_int_arg("next", 1 if next is None else next, minimum=1)
        batches = [b for r in ranks for b in _rank_batches(layout, batched, r, count, names)]
    skipped = {r: [list(pair) for pair in layout.skipped(r)] for r in ranks if layout.skipped(r)}
    return StreamWhereReport(
        found.key, layout.epoch, layout.epoch_done, layout.world, layout.workers, batched.batch_size, skipped, batches
    )


def _status(layout: LoaderState, rank: int, epoch: int, j: int, done: int) -> str:
    if epoch != layout.epoch:
        return READ if epoch < layout.epoch else UNREAD
    if j >= done:
        return UNREAD
    return SKIPPED if any(a <= j < b for a, b in layout.skipped(rank)) else READ


def _steps_before(layout: LoaderState, batched: Batch, rank: int, epoch: int) -> int:
    """The rank's batches in the epochs before ``epoch``, each counted in full."""
    return sum(RankEpoch(layout, batched, rank, e).dealing.total for e in range(epoch))


def _batch(here: RankEpoch, layout: LoaderState, j: int, names: Callable[[int], str], step: int) -> StreamBatch:
    slot, keys = here.batch(j)
    records = [(names(key[1]), int(key[2])) for key in keys]
    status = _status(layout, here.rank, here.epoch, j, here.done)
    return StreamBatch(here.rank, here.epoch, j, slot, records, status, step)


def _previous(
    layout: LoaderState, batched: Batch, rank: int, count: int, names: Callable[[int], str]
) -> list[StreamBatch]:
    here = RankEpoch(layout, batched, rank, layout.epoch)
    before = _steps_before(layout, batched, rank, layout.epoch)
    return [_batch(here, layout, j, names, before + j) for j in range(max(0, here.done - count), here.done)]


def _step(layout: LoaderState, batched: Batch, rank: int, step: int, names: Callable[[int], str]) -> StreamBatch:
    before = 0
    for epoch in range(layout.epoch + MAX_EPOCHS):
        here = RankEpoch(layout, batched, rank, epoch)
        if step < before + here.dealing.total:
            return _batch(here, layout, step - before, names, step)
        before += here.dealing.total
    raise ResumeError(
        f"step {step}: rank {rank} has {before} batches in epochs 0..{layout.epoch + MAX_EPOCHS - 1}; "
        f"ask for a step within {MAX_EPOCHS} epochs of the state's"
    )


class _SlotKeys:
    """One slot's upcoming record keys in an epoch, asked of the pipeline in growing amounts.

    ``prepare`` puts the (shared) pipeline at the slot's position: it loads the slot's state, or
    starts the slot's epoch. Asking again from there costs what was asked: the amount doubles.
    """

    def __init__(self, batched: Batch, prepare: Callable[[], None]) -> None:
        self._batched = batched
        self._prepare = prepare
        self._keys: list[Key] = []
        self._asked = 0

    def batch(self, k: int) -> list[Key]:
        """The keys of the slot's ``k``-th batch from here ([] when there is none)."""
        size = self._batched.batch_size
        while len(self._keys) == self._asked and self._asked < (k + 1) * size:
            self._asked = max((k + 1) * size, 2 * self._asked)
            self._prepare()
            keys = self._batched.source.upcoming_keys(self._asked)
            if keys is None:
                raise ResumeError(refusal(self._batched.source))
            self._keys = keys
        keys = self._keys[k * size : (k + 1) * size]
        return [] if self._batched.drop_last and len(keys) < size else keys


def _rank_batches(
    layout: LoaderState, batched: Batch, rank: int, count: int, names: Callable[[int], str]
) -> list[StreamBatch]:
    """Rank ``rank``'s next ``count`` batches: its slots round-robin from the next one, epoch by epoch."""
    slots = layout.mine(rank)
    num_slots = layout.world * layout.local

    def restore(g: int) -> Callable[[], None]:
        return lambda: layout.restore(batched, g)

    def start(epoch: int, g: int) -> Callable[[], None]:
        return lambda: batched.reset(epoch, (g, num_slots))

    out: list[StreamBatch] = []
    epoch = layout.epoch
    if layout.epoch_done:
        epoch, sources, local, done = epoch + 1, [_SlotKeys(batched, start(epoch + 1, g)) for g in slots], 0, 0
    else:
        sources = [_SlotKeys(batched, restore(g)) for g in slots]
        local, done = layout.next_worker(rank), sum(layout.yielded(rank))
    fresh = layout.epoch_done
    while True:
        taken = [0] * len(sources)
        active = set(range(len(sources)))
        before = len(out)
        while active and len(out) < count:
            if local in active:
                keys = sources[local].batch(taken[local])
                if keys:
                    records = [(names(k[1]), int(k[2])) for k in keys]
                    out.append(StreamBatch(rank, epoch, done + len(out) - before, slots[local], records))
                    taken[local] += 1
                else:
                    active.discard(local)
            local = (local + 1) % len(sources)
        if len(out) >= count or (fresh and len(out) == before):  # an epoch of no batch: none ever
            return out
        epoch, fresh, local, done = epoch + 1, True, 0, 0
        sources = [_SlotKeys(batched, start(epoch, g)) for g in slots]
