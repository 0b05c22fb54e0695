"""``where`` for a stream: the shard and record of every record of a StreamLoader's next batches.

A stream's checkpoint holds per-slot positions (``StreamLoader``: a pipeline state per (rank,
worker) slot), not the pipeline: which records a position stands for depends on the shard list,
their sizes and the stages, which are code. So the caller passes the pipeline, built as the
training script builds it (unstarted), and :func:`where_stream` loads each slot's state into it,
as a restore does, and asks it for the keys of its next records (:meth:`Stream.upcoming_keys
<resumable_data.streams.Stream.upcoming_keys>`): computed from the positions, no record read, at a
cost in proportion to the batches asked for (a shuffle window's order, once per window), wherever
in the epoch the state stands. The batches are dealt as the loader deals them: each slot's
records cut into batches of ``batch_size`` (its last one kept unless ``drop_last``), a rank's
slots taken round-robin from the one the state names next, a slot that ends skipped for the rest
of the epoch, then the next epoch from its start.

Answered: a :class:`~resumable_data.streams.ShardedIterable` with known sizes (``sizes=``,
``from_index``, a reader that counts), behind ``map`` and ``shuffle_window``. Refused, naming the
stage: a stage whose next records depend on the records it reads (``shuffle_buffer``'s draws over
what it holds, ``filter``, ``mix``, ``pack``, ``take``, ``batch_by_tokens``), and a source that
reads by cursors (sizes unknown): answering would mean reading the data, which a restored loader
does (a replay), not ``where``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.state import EPOCH, WORLD_SIZE, check_int_arg, check_version, is_int, require_bool, require_mapping
from ..errors import ResumeError
from ..streams.base import Key, Stream, require_count
from ..streams.batch import Batch
from ..streams.ledger import batch_counts, slot_states
from ..streams.loader import BATCHES, EPOCH_DONE, LOADER_STATE_VERSION, NEXT_WORKER, NUM_WORKERS, SLOTS
from .source import Source, find_stream_state

__all__ = ["StreamBatch", "StreamWhereReport", "where_stream"]

_WHAT = "StreamLoader"
POSITIONAL_PIPELINES = (
    "`where` answers a stream whose order follows from positions: a ShardedIterable with known sizes (sizes=, "
    "ShardedIterable.from_index, or a reader that counts), behind map and shuffle_window"
)


@dataclass(frozen=True)
class StreamBatch:
    """One batch of one rank, as the restored loader yields it.

    Attributes:
        rank: The rank that yields it.
        epoch: Its epoch.
        batch: Its number among the rank's batches of the epoch (those before the state included).
        slot: The global (rank, worker) slot whose pipeline copy reads it.
        records: ``(shard, record)`` of each record: the shard's name in the source's list and the
            record's number in the shard.
    """

    rank: int
    epoch: int
    batch: int
    slot: int
    records: list[tuple[str, int]]


@dataclass(frozen=True)
class StreamWhereReport:
    """The answer of :func:`where_stream`, with the state it is about."""

    key: str
    epoch: int
    epoch_done: bool
    world_size: int
    num_workers: int
    batch_size: int
    batches: list[StreamBatch] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The human-readable answer."""
        workers = max(1, self.num_workers)
        out = [
            f"stream state {self.key}: epoch {self.epoch}{' (done)' if self.epoch_done else ''}, world size "
            f"{self.world_size}, num_workers {self.num_workers} ({self.world_size * workers} slots), "
            f"batch size {self.batch_size}"
        ]
        for b in self.batches:
            records = " ".join(f"{shard}[{record}]" for shard, record in b.records)
            out.append(f"  rank {b.rank}, epoch {b.epoch}, batch {b.batch} (slot {b.slot}): {records}")
        return out

    def as_json(self) -> dict[str, Any]:
        """The same answer as plain data (for scripts)."""
        out = asdict(self)
        for b in out["batches"]:
            b["records"] = [list(record) for record in b["records"]]
        return out


def where_stream(
    source: Source,
    pipeline: Stream,
    *,
    batch_size: int | None = None,
    drop_last: bool = False,
    next: int = 1,
    rank: int | None = None,
    key: str | None = None,
) -> StreamWhereReport:
    """The shard and record of every record of the next ``next`` batches of each rank of a StreamLoader state.

    Args:
        source: A ``StreamLoader`` state dict (one rank's, or :meth:`StreamLoader.merge_states` of
            all ranks'), or a checkpoint as ``python -m resumable_data inspect`` takes it.
        pipeline: The stream the loader was built over, built as the training script builds it
            (same shards, sizes, seeds, stages) and not started: each slot's state is loaded into it.
            A pipeline ending in ``.batch(n)`` (a loader with ``batch_size=None``) gives the batch size.
        batch_size: The loader's ``batch_size`` (the state does not hold it).
        drop_last: The loader's ``drop_last``.
        next: Batches per rank, into the following epochs.
        rank: Only this rank (default: every rank whose slots the state holds).
        key: Which StreamLoader state of a checkpoint holding several: its key path (``/dataloader``).

    Returns:
        Each rank's next batches, in the order the restored loader yields them.

    Raises:
        ResumeError: a bad source or argument, a pipeline that does not fit the state, or a pipeline
            whose next records depend on the records it reads (the message names the stage).

    Example:
        >>> from resumable_data.streams import ShardedIterable, StreamLoader
        >>> records = {"a": [0, 1, 2, 3], "b": [4, 5, 6]}
        >>> def pipeline():
        ...     read = lambda shard, start: iter(records[shard][start:])
        ...     return ShardedIterable(["a", "b"], read_shard=read, seed=0, sizes=[4, 3]).shuffle_window(3)
        >>> loader = StreamLoader(pipeline(), batch_size=2)
        >>> batches = iter(loader)
        >>> _ = next(batches)
        >>> where_stream(loader.state_dict(), pipeline(), batch_size=2).batches[0].records
        [('b', 2), ('a', 0)]
        >>> next(batches).tolist()  # b's record 2 is 6, a's record 0 is 0
        [6, 0]
    """
    count = check_int_arg("next", next, minimum=1)
    if isinstance(pipeline, Batch):
        if batch_size is not None and batch_size != pipeline.batch_size:
            raise ResumeError(f"batch_size is {batch_size}, but the pipeline batches by {pipeline.batch_size}")
        batched = pipeline
    elif not isinstance(pipeline, Stream) or not pipeline.keyed:
        raise ResumeError(
            f"pipeline: expected the Stream of records the StreamLoader was built over (or one ending in .batch(n)), "
            f"got {type(pipeline).__name__}"
        )
    elif batch_size is None:
        raise ResumeError("batch_size: the state does not hold the loader's batch size: pass it (--batch-size)")
    else:
        batched = Batch(pipeline, check_int_arg("batch_size", batch_size, minimum=1), drop_last=drop_last)
    found = find_stream_state(source, key)
    layout = _LoaderState.parse(found.state)
    ranks = layout.ranks(rank)
    names = _shard_names(batched.source)
    batches = [b for r in ranks for b in _rank_batches(layout, batched, r, count, names)]
    return StreamWhereReport(
        found.key, layout.epoch, layout.epoch_done, layout.world, layout.workers, batched.batch_size, batches
    )


@dataclass(frozen=True)
class _LoaderState:
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

    @classmethod
    def parse(cls, state: Mapping[str, Any]) -> _LoaderState:
        check_version(state, LOADER_STATE_VERSION, _WHAT)
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
                raise ResumeError(_refusal(self._batched.source))
            self._keys = keys
        keys = self._keys[k * size : (k + 1) * size]
        return [] if self._batched.drop_last and len(keys) < size else keys


def _rank_batches(
    layout: _LoaderState, batched: Batch, rank: int, count: int, names: Callable[[int], str]
) -> list[StreamBatch]:
    """Rank ``rank``'s next ``count`` batches: its slots round-robin from the next one, epoch by epoch."""
    slots = layout.mine(rank)
    num_slots = layout.world * layout.local

    def restore(g: int) -> Callable[[], None]:
        def prepare() -> None:
            apply = batched.check(layout.slots[g])
            saved = [s for s in batched.saved_slots(layout.slots[g]) if s != (g, num_slots)]
            if saved:
                raise ResumeError(f"{_WHAT} state: slot {g} holds a pipeline state saved for slot {saved[0][0]}")
            apply()

        return prepare

    def start(epoch: int, g: int) -> Callable[[], None]:
        return lambda: batched.reset(epoch, (g, num_slots))

    out: list[StreamBatch] = []
    epoch = layout.epoch
    if layout.epoch_done:
        epoch, sources, local, done = epoch + 1, [_SlotKeys(batched, start(epoch + 1, g)) for g in slots], 0, 0
    else:
        sources = [_SlotKeys(batched, restore(g)) for g in slots]
        local, done = layout.next_worker(rank), sum(batch_counts(layout.state, BATCHES, slots, _WHAT))
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


def _stages(stream: Stream) -> list[Stream]:
    """The pipeline's chain of stages, from the top down to its source."""
    chain = [stream]
    while isinstance(below := getattr(chain[-1], "source", None), Stream):
        chain.append(below)
    return chain


def _shard_names(stream: Stream) -> Callable[[int], str]:
    """Shard index -> its name in the source's shard list (the index itself for a source without one)."""
    shards = getattr(_stages(stream)[-1], "shards", None)
    if shards is None:
        return str
    return lambda index: str(shards[index])


def _refusal(stream: Stream) -> str:
    """Why the (loaded) pipeline cannot name its next records: the lowest stage that cannot."""
    stage = next(s for s in reversed(_stages(stream)) if s.upcoming_keys(1) is None)
    name = type(stage).__name__
    if hasattr(stage, "shards"):
        why = "reads by per-shard cursors (its shard sizes are unknown, or the state was saved so)"
    else:
        why = "decides its next records by the records it reads (a buffer's draws, a predicate, a mix)"
    return (
        f"where: {name} {why}, so its next records follow from the data, not from the state; {POSITIONAL_PIPELINES}. "
        "To see the records anyway, restore the loader from the checkpoint and read its next batches (a replay)"
    )
