"""StreamLoader: a stream pipeline behind a DataLoader, split over ranks and workers, resumable.

Slots. With ``world_size`` ranks of ``max(1, num_workers)`` workers each there are ``S`` global
slots; worker ``w`` of rank ``r`` serves slot ``r * max(1, num_workers) + w`` and reads every
``S``-th shard of the epoch's shard order (see :class:`ShardedIterable`), through its own copy of
the pipeline.

Exact position with prefetching, no extra messages. Each worker yields every batch together with
its pipeline's state *after* that batch, as a change to the state after its previous batch
(:meth:`Stream.state_update`: a shuffle buffer sends the keys that entered it, not its whole key
list). The loader strips it off and applies it to its copy of that slot's state
(:meth:`Stream.apply_update`), so its state describes exactly the batches handed to the caller;
batches still sitting in a prefetch queue are not counted.

With 0 workers the pipeline is this process's own and stops right after each batch, so it holds
the state after the batch handed out: the loader reads it from there (the slot ledger, see
:mod:`.ledger`, keeps what a state one batch back needs).
With 0 workers (and no ``pin_memory``) no DataLoader iterates the pipeline either (see :mod:`.slots`).
The state holds the pipeline state of each of this rank's slots under ``"slots"`` (keyed by global
slot number), here of a 0-worker loader after one batch::

    >>> from resumable_data.streams import ShardedIterable, StreamLoader
    >>> records = {"a": [0, 1, 2, 3], "b": [4, 5, 6]}
    >>> stream = ShardedIterable(["a", "b"], read_shard=lambda shard, start: iter(records[shard][start:]), seed=0)
    >>> loader = StreamLoader(stream, batch_size=2)
    >>> next(iter(loader))
    tensor([4, 5])
    >>> state = loader.state_dict()
    >>> {key: value for key, value in state.items() if key != "slots"}
    {'version': 1, 'epoch': 0, 'epoch_done': False, 'world_size': 1, 'num_workers': 0,
     'next_worker': {'0': 0}, 'batches': {'0': 1}}
    >>> state["slots"]["0"]["source"]["remaining"]  # slot 0: the batch stage's state, its source's under "source"
    [[1, 'b', 2], [0, 'a', 0]]

``batches`` counts what each slot has yielded in the epoch: with ``global_rng="batch"`` (the
default) slot ``g``'s ``n``-th batch is pulled through the pipeline with the global RNGs seeded from
``(epoch, g, number of slots, n)``, so a ``map`` drawing from ``torch.rand`` resumes exactly.

Bitwise resume. With ``in_order=True`` a DataLoader takes batches from its workers round-robin
starting at worker 0, skipping a worker for good once it is exhausted. ``next_worker`` records
where that round-robin stands; a restored loader rotates which slot each worker serves, so the
round-robin continues where it stopped and the stream is bitwise identical.

Different layout on resume. Each rank's state holds only that rank's slots. Merge all ranks'
states with :meth:`StreamLoader.merge_states` (e.g. after ``torch.distributed.all_gather_object``)
and load the merged state on every rank: with the same layout each rank picks its slots; with a
different ``world_size`` or ``num_workers`` the unfinished shards with their cursors, and the
records held in shuffle buffers (as pending records), are dealt to the new slots. Every record of
the epoch is then consumed exactly once, in a different order than the old layout would have used.
A pipeline with ``take``/``repeat``/``IterableSource`` refuses a layout change.

Warm start. Worker processes take tens of milliseconds or more to start, and a stream loader
starts them at every restore and epoch start. With ``warm_start`` (the default with workers and no
``worker_init_fn``) the main process fetches the first batch of each pass itself, from the slot
that is next, and the workers start on the next request with that slot one batch further on. The
stream is the same as a restore right after that batch: bitwise the uninterrupted one. The
trade-off: the second batch of a pass waits for the workers' start instead of the first.

Epochs follow :class:`~resumable_data.ResumableDataLoader`: iterating continues the current epoch;
once it is exhausted, the next ``iter()`` starts the next epoch unless ``set_epoch`` chose one. A
restored epoch remainder that turns out empty (checkpoint taken right after the epoch's last batch)
goes straight on with the next epoch instead of yielding an empty one. Ranks may get different
numbers of batches per epoch (shards differ in size).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from ..audit.records import loader_id, recorder
from ..core.cursor import EpochCursor
from ..core.dist import distributed_defaults
from ..core.hash import hash_ints
from ..core.ranges import Ranges
from ..core.state import (
    VERSION,
    WORLD_SIZE,
    brief,
    check_int_arg,
    is_int,
    require_bool,
    require_mapping,
)
from ..errors import ResumeError
from .base import EPOCH, Stream, require_count
from .batch import Batch
from .ledger import SlotLedger, batch_counts, slot_states
from .loader_state import BATCHES, EPOCH_DONE, NEXT_WORKER, NUM_WORKERS, SLOTS, merge_loader_states
from .plan_scope import withdrawn_after
from .skipped import PLAIN_LOADER_VERSION, SKIPPED, SKIPPED_LOADER_VERSION, check_loader_version, rank_skipped
from .slots import Seeding, SlotDataset, slot_batches, slot_loader

__all__ = ["StreamLoader"]

_WHAT = "StreamLoader"
_BATCH_SALT = 0x73747265616D  # "stream": the global-RNG keys must not coincide with other keys
# DataLoader arguments the loader decides itself.
_OWNED = ("batch_size", "shuffle", "sampler", "batch_sampler", "generator", "collate_fn")


class StreamLoader:
    """Batches of a stream pipeline from worker processes, with an exact and elastic state.

    Args:
        pipeline: a :class:`Stream` of records (or of batches, with ``batch_size=None``).
        batch_size: records per batch, batched inside each worker; None when the pipeline batches.
        drop_last: drop each slot's last partial batch.
        collate_fn: how a list of records becomes a batch (``default_collate`` when None).
        num_workers: worker processes per rank.
        rank: this rank; defaults to ``group``'s rank when ``torch.distributed`` is initialized, else 0.
        world_size: number of ranks; defaults to ``group``'s size when initialized, else 1.
        group: the data-parallel process group (``None``: the default group); ranks that share a
            group rank (tensor-parallel peers) get the same batches.
        global_rng: ``"batch"`` seeds torch's, numpy's and python's global RNGs before each batch
            is pulled through the pipeline, from ``(epoch, slot, batches the slot has yielded)``,
            so a ``map`` drawing from them (``torch.rand``) resumes exactly with any
            ``num_workers``; with 0 workers the main process's RNGs are put back after each batch.
            ``None`` leaves them be.
        warm_start: with workers, fetch the first batch of each pass (a restore, an epoch start)
            in the main process while the workers start (see the module docstring). None: on
            unless a ``worker_init_fn`` is given (a pipeline may depend on what it sets up).
        batches_per_message: with workers, how many batches a worker sends to this process at
            once. Each message costs a fixed amount (the worker queue, a shared-memory segment
            per tensor), more than a small batch's own work: for batches of a few KB, 8 to 32
            make the loader faster (figures: benchmarks/README.md). The batches still come one
            by one in the same order, with the same states; a worker computes up to that many
            batches ahead, and that many more per worker are held in memory.
        **dataloader_kwargs: other ``DataLoader`` keywords (``pin_memory``, ``prefetch_factor``,
            ``worker_init_fn``, ``multiprocessing_context``, ...).

    Example::

        stream = ShardedIterable(paths, read_shard=TokenShardReader(1025)).shuffle_buffer(1000)
        loader = StreamLoader(stream, batch_size=32, num_workers=2)
        if checkpoint:
            loader.load_state_dict(checkpoint["dataloader"])
        for batch in loader:
            train_step(batch)
            save({"dataloader": loader.state_dict(), ...})
    """

    def __init__(
        self,
        pipeline: Stream,
        *,
        batch_size: int | None = None,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        group: Any = None,
        global_rng: str | None = "batch",
        warm_start: bool | None = None,
        batches_per_message: int = 1,
        **dataloader_kwargs: Any,
    ) -> None:
        if global_rng not in ("batch", None):
            raise ResumeError(f"global_rng should be 'batch' or None, but got global_rng={global_rng!r}")
        self.global_rng = global_rng
        if not isinstance(pipeline, Stream):
            raise TypeError(f"StreamLoader takes a Stream pipeline, got {type(pipeline).__name__}")
        for name in _OWNED:
            if name in dataloader_kwargs:
                raise ResumeError(f"StreamLoader decides {name!r} itself; remove {name}=... (batch with batch_size=)")
        if dataloader_kwargs.get("persistent_workers"):
            raise ResumeError(
                "persistent_workers=True keeps each worker's pipeline copy from the first epoch, so "
                "the loader could not hand it the restored or next epoch's cursors; leave it False"
            )
        if dataloader_kwargs.get("in_order", True) is False:
            raise ResumeError("in_order=False hands out batches in completion order, which cannot resume exactly")
        default_rank, default_world = distributed_defaults(group)
        self.world_size = check_int_arg("world_size", default_world if world_size is None else world_size, minimum=1)
        self.rank = check_int_arg("rank", default_rank if rank is None else rank, minimum=0)
        if self.rank >= self.world_size:
            raise ResumeError(f"rank should be < world_size, but got rank={self.rank}, world_size={self.world_size}")
        self.num_workers = check_int_arg("num_workers", num_workers, minimum=0)
        self.batches_per_message = check_int_arg("batches_per_message", batches_per_message, minimum=1)
        if warm_start is None:
            warm_start = dataloader_kwargs.get("worker_init_fn") is None
        self.warm_start = bool(warm_start) and self.num_workers > 0
        self.batch_size, self.drop_last = batch_size, drop_last  # as a DataLoader's (None: the pipeline batches)
        self._stream = (
            pipeline if batch_size is None else Batch(pipeline, batch_size, drop_last=drop_last, collate_fn=collate_fn)
        )
        self._dataloader_kwargs = dataloader_kwargs
        self._local = max(1, self.num_workers)
        # The epoch rules; the position itself is the slot states (the cursor's position is unused).
        self._cursor = EpochCursor("stream_loader")
        self._fresh = True  # the slot states are an epoch's start, not a position inside it
        # Each local slot's state as of the batches handed out, and which slot is next.
        self._ledger = SlotLedger(self._stream, workers=self.num_workers > 0)
        # The epoch whose batches a skip moved past (streams.skipped) and this rank's ranges of them.
        self._skipped: tuple[int, Ranges] | None = None
        self._start_epoch(0)
        self._audit_id = loader_id()  # None unless RESUMABLE_DATA_AUDIT asks for batch records

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._cursor.epoch

    @property
    def batches_yielded(self) -> int:
        """Batches this rank has handed out in the current epoch (restored ones included)."""
        return self._ledger.batches_yielded

    @property
    def num_slots(self) -> int:
        """Global (rank, worker) slots."""
        return self.world_size * self._local

    def _start_epoch(self, epoch: int) -> None:
        states: list[dict[str, Any]] = [{}] * self._local
        for local in _ending_with(0, self._local):
            self._stream.reset(epoch, (self.rank * self._local + local, self.num_slots))
            states[local] = self._stream.state_dict()
        self._ledger.reset(states, [0] * self._local, 0)
        self._fresh = True
        self._skipped = None

    def set_epoch(self, epoch: int) -> None:
        """The next pass is epoch ``epoch`` from its start; a pending restore of that epoch is kept."""
        if self._cursor.set_epoch(epoch):  # from its start (not a kept restored position)
            self._start_epoch(self._cursor.epoch)

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """The epochs still to run, each already ``set_epoch``-ed; starts at the restored epoch."""
        return self._cursor.epochs(num_epochs, self.set_epoch)

    def __iter__(self) -> Iterator[Any]:
        epoch = self._cursor.next_segment()[0]
        if epoch != self._cursor.epoch:
            self._start_epoch(epoch)
        pinned, fresh = self._cursor.pinned, self._fresh
        segment = self._cursor.begin()
        yielded, audit = False, recorder(self._audit_id, self.rank)
        # From here on the pipeline may move (or workers move their copies): nothing is known to
        # hold a recorded state until a batch arrives.
        ledger = self._ledger
        holds, ledger.holds = ledger.holds, None
        if holds is None:
            ledger.bring_up_to_date()  # the pipeline loads the slot's state: it must be up to date
        for local, count, update, batch in self._batches(segment.epoch, holds):
            # With 0 workers the pipeline stopped right after this batch: it holds the state just
            # recorded, and keeps holding it if the caller stops here (the generator closes at the yield).
            ledger.record(local, count, update)
            if audit is not None:  # the (global slot, batches it has yielded) pair is the batch's key
                audit.batch(batch, epoch=segment.epoch, position=[self.rank * self._local + local, count])
            self._fresh, yielded = False, True
            self._cursor.advance(segment, 0, False)
            try:
                yield batch
            finally:
                # The caller wants the next batch, or stopped: fold this one in before the pipeline moves.
                ledger.settle()
            ledger.holds = None  # the pipeline moves again
        self._cursor.advance(segment, 0, True)
        if not yielded and not fresh and not pinned:
            # Restored right after the epoch's last batch: go on with the next epoch rather than
            # hand the caller an empty one.
            yield from self

    def _batches(self, epoch: int, holds: int | None) -> Iterator[tuple[int, int, dict[str, Any], Any]]:
        """``(slot, batches it has yielded, state update, batch)`` of this pass: the first from this
        process when warm."""
        if self.warm_start:
            ledger = self._ledger
            local = ledger.next_worker
            # The worker for this slot will load the state after this batch, never this pipeline.
            seeding = self._seeding(epoch)
            # The pipeline holds the next slot's state after a restore or an epoch start (they make
            # it last): the warm batch then needs no second check of that state.
            load = holds != local
            # The pipeline here reads nothing after this batch: what it told a cache it reads next
            # is withdrawn (the worker tells it again), or it keeps shards the workers need out.
            with withdrawn_after():
                first = next(
                    slot_batches(self._stream, local, ledger.states[local], ledger.yielded[local], seeding, load=load),
                    None,
                )
            if first is not None:
                yield first
                # The state after the warm batch (just recorded by the caller), the next slot next.
                holds = None
        yield from self._slots(epoch, holds)

    def _seeding(self, epoch: int) -> Seeding | None:
        """How this pass seeds the global RNGs before each batch (None: ``global_rng=None``)."""
        if self.global_rng is None:
            return None
        return Seeding(hash_ints(epoch, self.num_slots, _BATCH_SALT), self.rank * self._local)

    def _slots(self, epoch: int, holds: int | None) -> Iterable[tuple[int, int, dict[str, Any], Any]]:
        """The pass's batches from the slots: through a DataLoader's workers, or in this process."""
        ledger = self._ledger
        dataset = SlotDataset(
            self._stream,
            list(ledger.states),
            list(ledger.yielded),
            self._seeding(epoch),
            ledger.next_worker,
            holds,
            self.batches_per_message,
        )
        return slot_loader(dataset, self.num_workers, hash_ints(epoch, self.rank) >> 1, self._dataloader_kwargs)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self, *, unconsumed: int = 0) -> dict[str, Any]:
        """This rank's slots, each as the pipeline state after its last batch handed out.

        Args:
            unconsumed: 1 describes the position before the last batch handed out, for a caller
                that fetched a batch ahead and has not used it (Lightning's fetcher does so with a
                loader without ``len``: ``ResumeCallback`` passes 1 then); a restore yields that
                batch again. 0 (the default) or 1.

        Raises:
            ResumeError: ``unconsumed`` is 1 but no batch of this pass is still held back (none
                was handed out since the last restore or epoch start, or the caller has asked
                for the next one since).
        """
        check_int_arg("unconsumed", unconsumed, minimum=0)
        if unconsumed > 1 or (unconsumed and not self._ledger.holds_back):
            held = "1" if self._ledger.holds_back else "0 (no batch handed out is held back)"
            raise ResumeError(f"state_dict(unconsumed={unconsumed}): can take back at most {held}")
        states, yielded, next_worker = self._ledger.snapshot(unconsumed)
        skipped = self._skipped[1] if self._skipped is not None and self._skipped[0] == self._cursor.epoch else ()
        state = {
            VERSION: SKIPPED_LOADER_VERSION if skipped else PLAIN_LOADER_VERSION,
            EPOCH: self._cursor.epoch,
            EPOCH_DONE: self._cursor.done,
            WORLD_SIZE: self.world_size,
            NUM_WORKERS: self.num_workers,
            NEXT_WORKER: {str(self.rank): next_worker},
            SLOTS: {str(self.rank * self._local + local): s for local, s in enumerate(states)},
            BATCHES: {str(self.rank * self._local + local): n for local, n in enumerate(yielded)},
        }
        if skipped:
            state[SKIPPED] = {str(self.rank): [list(pair) for pair in skipped]}
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from this rank's state, or from :meth:`merge_states` of every rank's.

        With the checkpoint's world size and number of workers the stream is bitwise identical;
        with others, the unfinished shards are redistributed (see the module docstring).

        Raises:
            ResumeError: malformed state, a slot missing, or a pipeline that does not fit; the
                loader is unchanged.
        """
        state = require_mapping(state_dict, _WHAT)
        check_loader_version(state, _WHAT)
        epoch = require_count(state, EPOCH, _WHAT)
        epoch_done = require_bool(state, EPOCH_DONE, _WHAT)
        old_world = require_count(state, WORLD_SIZE, _WHAT)
        if old_world < 1:
            raise ResumeError(f"{_WHAT} state field {WORLD_SIZE!r} must be >= 1, but got {old_world}")
        old_workers = require_count(state, NUM_WORKERS, _WHAT)
        old_local = max(1, old_workers)
        # The slot count comes from untrusted ints: compare it, never materialize a range of it.
        old_slots = old_world * old_local
        slots = slot_states(state, SLOTS, old_slots, _WHAT)
        for g, slot_state in slots.items():
            slot_epoch = slot_state.get(EPOCH) if isinstance(slot_state, Mapping) else None
            if isinstance(slot_epoch, int) and slot_epoch != epoch:
                raise ResumeError(
                    f"{_WHAT} state is in epoch {epoch} but its slot {g} is in epoch {brief(slot_epoch)}; "
                    "pass a state_dict() (or merge_states of every rank's) unchanged"
                )
        mine = range(self.rank * self._local, (self.rank + 1) * self._local)
        if (old_world, old_local) == (self.world_size, self._local):
            missing = [g for g in mine if g not in slots]
            if missing:
                raise ResumeError(
                    f"{_WHAT} state has no slots {missing} for rank {self.rank} (it holds slots "
                    f"{sorted(slots)[:20]}); load this rank's own state or StreamLoader.merge_states of all ranks'"
                )
            raw = [slots[g] for g in mine]
            yielded = batch_counts(state, BATCHES, mine, _WHAT)
            next_worker = require_mapping(state.get(NEXT_WORKER), f"{_WHAT} {NEXT_WORKER!r}").get(str(self.rank))
            if not is_int(next_worker) or not 0 <= next_worker < self._local:
                raise ResumeError(
                    f"{_WHAT} state field {NEXT_WORKER!r} has {brief(next_worker)} for rank {self.rank}, "
                    f"expected an int in [0, {self._local})"
                )
            skipped = rank_skipped(state, self.rank, sum(yielded), _WHAT)
        else:
            if len(slots) < old_slots:  # every key is a distinct slot number below old_slots
                missing = [g for g in itertools.islice(range(old_slots), len(slots) + 10) if g not in slots][:10]
                more = old_slots - len(slots) - len(missing)
                raise ResumeError(
                    f"resuming with world_size={self.world_size}, num_workers={self.num_workers} from a checkpoint "
                    f"with world_size={old_world}, num_workers={old_workers} redistributes the unfinished "
                    f"shards of every old slot, but the state lacks slots {missing}"
                    + (f" and {more} more" if more else "")
                    + "; load StreamLoader.merge_states([state of each rank]) instead"
                )
            for g in sorted(slots):
                self._stream.check(slots[g])
            every = self._stream.rebalance([slots[g] for g in sorted(slots)], self.num_slots, [])
            raw = [every[g] for g in mine]
            yielded = [0] * self._local  # new slots: their global-RNG keys start afresh
            next_worker = 0
            skipped = ()  # the new ranks' batch numbers count other batches
        applies = [self._stream.check(s) for s in raw]
        for g, s in zip(mine, raw, strict=True):  # (a redistributed state is built for its slot)
            wrong = [saved for saved in self._stream.saved_slots(s) if saved != (g, self.num_slots)]
            if wrong:
                raise ResumeError(
                    f"{_WHAT} state: slot {g} holds a pipeline state saved for slot {wrong[0][0]} of "
                    f"{wrong[0][1]}; pass a state_dict() (or merge_states of every rank's) unchanged"
                )
        # Keep each slot as the pipeline's own state_dict() after applying it: plain, normalized
        # data that shares nothing with the caller's dict (and drops unknown keys).
        # The next slot's state applied last, so that the pipeline holds it (see SlotLedger.reset).
        states: list[dict[str, Any]] = [{}] * self._local
        for local in _ending_with(next_worker, self._local):
            applies[local]()
            states[local] = self._stream.state_dict()
        self._ledger.reset(states, yielded, next_worker)
        self._fresh = False
        self._skipped = (epoch, skipped) if skipped else None
        self._cursor.restore(epoch, 0, epoch_done)

    @staticmethod
    def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One state holding the slots of every rank's state (all saved at the same step).

        Example::

            gathered = [None] * world_size
            torch.distributed.all_gather_object(gathered, loader.state_dict())
            checkpoint["dataloader"] = StreamLoader.merge_states(gathered)

        Raises:
            ResumeError: no states, a malformed one, or states that disagree or overlap.
        """
        return merge_loader_states(states)


def _ending_with(last: int, count: int) -> list[int]:
    """``range(count)`` rotated to end with ``last``."""
    return [(last + 1 + i) % count for i in range(count)]
