"""The base of every stream stage: keyed iteration, epochs, nested state, re-reading, rebalancing.

A stream pipeline is a chain of small stages (a source, then ``map``, ``filter``,
``shuffle_buffer``, ``batch``, ...). Each stage is iterable and :class:`~resumable_data.Stateful`;
a parent nests its source's state under ``"source"`` (``"sources"`` for :func:`mix`).

Record identity. Internally every stage yields ``(key, value)`` pairs. A record's *key* is a tuple
of ints fixed by where the record lives, not by when or by which worker it was read:
``(epoch, shard index, offset)`` from a :class:`ShardedIterable`, with the source index inserted
after the epoch by :func:`mix`. Keys are what make the rest exact and small:

* ``map(fn, seed=...)`` draws each record's randomness from its key, so augmentation does not
  depend on the order, the worker or the number of resumes;
* ``shuffle_buffer`` saves the keys of its buffered records, never their payloads, and re-reads
  them through :meth:`Stream.fetch` on restore;
* a different worker/rank layout puts buffered records back into the sources as *pending* keys
  (:meth:`Stream.rebalance`), so every record is still consumed exactly once.

Epochs. ``set_epoch(e)`` starts epoch ``e`` from its beginning, also after an exhausted or broken-off
epoch ``e``, unless a restore is pending (``load_state_dict``, and no record drawn since) and ``e`` is
the restored epoch: then it keeps the restored position, so a loop that calls ``set_epoch`` at the top
of every epoch resumes mid-epoch (the loaders' rule, ``core.cursor``). A stage holds
all of its iteration state on itself, not in the generator: iterating again after a ``break``
continues where the last yielded item left off. One active iterator per stage object.

Loading is validate-then-mutate: :meth:`Stream.check` validates a whole nested state and returns
a thunk that applies it, so a failed ``load_state_dict`` leaves the pipeline unchanged. A state is
untrusted data: saved keys are vouched for by the source (:meth:`Stream.key_checker`: right shape,
epoch and shard, already read), each stage's epoch must agree with its source's, and every counter
is an int64, so an edited or corrupted state is refused rather than yielding wrong records.

The stage protocol. Stages talk to each other (and :class:`StreamLoader` to its pipeline) only
through these public methods of :class:`Stream`, which a custom stage implements:

* :meth:`~Stream.iter_keyed` -- yield ``(key, value)`` pairs from the current position;
* :meth:`~Stream.reset` ``(epoch, slot)`` -- start an epoch, optionally for a (rank, worker) slot;
* :meth:`~Stream.state_dict` / :meth:`~Stream.check` ``(state)`` -- save; validate and return the
  thunk that applies;
* :meth:`~Stream.state_update` / :meth:`~Stream.apply_update` ``(previous, update)`` -- the state
  after each batch as a change to the previous one, for a consumer that keeps that one
  (:class:`StreamLoader`'s per-batch path): what a batch carries stays the size of a batch;
* :meth:`~Stream.fetch` ``(key)`` / :meth:`~Stream.fetch_many` ``(keys)`` -- re-read records;
* :meth:`~Stream.key_checker` ``(state)`` -- refuse keys this stage could not have yielded;
* :meth:`~Stream.saved_slots` ``(state)`` -- the slots a state's sources were saved for;
* :meth:`~Stream.rebalance` ``(states, num_slots, pending)`` -- re-split positions over a new layout;
* :meth:`~Stream.appends` ``(state)`` -- whether loading a state adds records to its epoch (growth);
* :meth:`~Stream.expect_rereads` -- told by a stage above that it reads records again (by key, or
  by iterating again from a saved state): what it reads again must come out the same;
* :meth:`~Stream.with_identities` ``(state)`` -- an earlier state of this stage that a restore reads
  forward from again, with the identities of the shards entered since (so they are checked);
* :meth:`~Stream.with_held` ``(state, shards)`` -- a state of this stage with the identities of the
  shards whose records a stage above holds and re-reads by key on restore (a shuffle buffer's);
* :meth:`~Stream.positional` -- an optional capability: records addressed by position
  (:mod:`~resumable_data.streams.positional`), what the shuffles' fast paths use;
* :meth:`~Stream.upcoming_keys` -- optional: the next records' keys, computed (``where``'s answer);
* :meth:`~Stream.epoch_positions` -- optional: the slot's whole epoch as positions
  (:mod:`~resumable_data.streams.epoch_positions`), what ``where --previous`` and ``skip`` use;
* :attr:`~Stream.POSITION_KEYS` -- the fields of the stage's own state that say where it stands.

A one-source stage subclasses :class:`~resumable_data.streams.wrapper.Wrapper`, which forwards all
of them to its source and nests the state; it then overrides only what it changes (and
``Wrapper.expected_source_epoch`` when its epochs are not its source's).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ..core.state import (
    EPOCH,
    INT64_MAX,
    brief,
    check_int_arg,
    is_int,
    require_int,
)
from ..errors import ResumeError

if TYPE_CHECKING:
    from .epoch_positions import EpochPositions
    from .positional import Positional

__all__ = ["Key", "Slot", "Stream"]

Key = tuple[int, ...]
"""A record's identity: ``(epoch, *where)``; see the module docstring."""

Slot = tuple[int, int]
"""``(slot, num_slots)``: which of the global (rank, worker) slots a pipeline copy serves."""


class PlainKeys(list[Key]):
    """Record keys a stage has checked in bulk to be tuples of plain ints, each ``width`` long (a
    shuffle buffer's saved keys): a bulk :meth:`Stream.keys_checker` need not look at every int again."""

    width: int = 0  # 0: the keys are not all one length


STREAM_STATE_VERSION = 2  # 2: ShardedIterable's shuffled shard order changed (core.permutation.ORDER_VERSION 2)
# Keys of stream stage states, declared once (EPOCH, SEED, SHUFFLE, WORLD_SIZE come from _state).
SOURCE = "source"
SOURCES = "sources"
DRAWS = "draws"  # random draws made so far: shuffle_buffer's and mix's position in their RNG stream


class Stream:
    """Base class of stream stages; users compose them with the fluent methods below.

    Example:
        >>> from resumable_data import ShardedIterable
        >>> records = {"a": [0, 1, 2, 3], "b": [4, 5, 6]}  # two shards, in memory here
        >>> def read(shard, start):  # a shard's records from offset ``start`` on
        ...     return iter(records[shard][start:])
        >>> def pipeline():
        ...     return ShardedIterable(["a", "b"], read_shard=read, seed=0).shuffle_buffer(3, seed=0).batch(2)
        >>> stream = pipeline()
        >>> batches = iter(stream)
        >>> first = next(batches)
        >>> state = stream.state_dict()  # shard cursors and 3 buffered keys: no records
        >>> resumed = pipeline()
        >>> resumed.load_state_dict(state)
        >>> [b.tolist() for b in resumed] == [b.tolist() for b in batches]  # the rest of the epoch
        True
    """

    #: Whether items carry a record key (batches do not).
    keyed: bool = True
    #: Whether a record can be re-read from its key alone (needed by shuffle_buffer).
    fetchable: bool = True
    #: Whether the stage yields its source's records in their order, each as soon as it is read
    #: (map, filter, take; a source reads its shards in order): records appended after the
    #: source's end then come after everything it yielded before (see :func:`growth_reorders`).
    in_order: bool = False
    #: The fields of this stage's own state that say where it stands (every other field says what
    #: the stage is: seeds, sizes, the shard list). Each stage declares its own; a loader merging
    #: the states of several ranks compares the rest (:func:`position_keys`).
    POSITION_KEYS: ClassVar[frozenset[str]] = frozenset({EPOCH})
    # load_state_dict happened and no record was drawn since: set_epoch of its epoch keeps it.
    _restore_pending: bool = False

    def __init__(self) -> None:
        self._epoch = 0
        self.depth = 0  # stages below this one (0: a source); tells apart stages of one pipeline

    # -- the stage protocol: what each stage implements -------------------------------------
    # These methods are public so that stages (and StreamLoader) call each other through a
    # documented interface; a custom stage subclasses Stream (or Wrapper) and overrides them.
    # Training code never needs them: it uses iteration, set_epoch, state_dict, load_state_dict.
    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        """Yield ``(key, value)`` from the current position, updating the state before each yield.

        The key is ``None`` only for stages whose items are not records (:attr:`keyed` is False,
        e.g. batches).
        """
        raise NotImplementedError

    def reset(self, epoch: int, slot: Slot | None) -> None:
        """Start ``epoch`` from its beginning (for ``slot`` when given, else the current one)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The position after the last item this stage yielded, as plain nested data."""
        raise NotImplementedError

    def state_update(self) -> dict[str, Any]:
        """The state after the last item, as a change to the state this stage was at when it last
        gave an update, was reset or had a state applied; :meth:`apply_update` turns it into the
        :meth:`state_dict` it stands for.

        A consumer that keeps a copy of the previous state (a loader taking a state after every
        batch) asks for this instead of :meth:`state_dict`: a stage whose state is large (a
        shuffle buffer's keys) then sends what changed, in proportion to the records read since,
        not to the state. The default is the whole state.
        """
        return self.state_dict()

    def apply_update(self, previous: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
        """The :meth:`state_dict` that ``update`` (from :meth:`state_update`) stands for.

        ``previous`` is the state the update is relative to: the consumer's own copy, which this
        may change in place (its large lists are updated rather than copied) and return.
        """
        return update

    def check(self, state: Any) -> Callable[[], None]:
        """Validate ``state`` (recursively, sources included) and return a thunk that applies it.

        Nothing may change before the thunk runs: this is what makes ``load_state_dict``
        validate-then-mutate across a whole pipeline.
        """
        raise NotImplementedError

    def fetch(self, key: Key) -> Any:
        """Re-read the record with ``key`` (what this stage would yield for it)."""
        raise TypeError(f"{type(self).__name__} cannot re-read a record from its key")

    def fetch_many(self, keys: Sequence[Key]) -> list[Any]:
        """Re-read the records with ``keys``, in that order (what :meth:`fetch` gives for each).

        A shuffle buffer's restore re-reads up to its whole buffer at once; stages that can group
        those reads (one open per shard, contiguous records together) override this.
        """
        return [self.fetch(key) for key in keys]

    def key_checker(self, state: Mapping[str, Any] | None) -> Callable[[Key], None]:
        """A function that refuses a saved record key this stage could not have yielded.

        ``state`` is this stage's part of a state that :meth:`check` has already accepted: a key
        must then be one of the records read so far in that state's epoch (a shuffle buffer's
        saved keys are checked this way before anything is re-read). With ``state=None`` the key
        may be from another epoch, and only its shape and ranges are checked. A stage that cannot
        tell accepts every key, and its :meth:`fetch` must refuse what it cannot read.
        """
        return _accept_any

    def keys_checker(self, state: Mapping[str, Any] | None) -> Callable[[Sequence[Key]], None]:
        """:meth:`key_checker` for a whole list of keys (a shuffle buffer's restore checks thousands).

        The same refusals, key by key here; a source that can check them in bulk overrides it.
        """
        check = self.key_checker(state)

        def check_all(keys: Sequence[Key]) -> None:
            for key in keys:
                check(key)

        return check_all

    def saved_slots(self, state: Mapping[str, Any]) -> list[Slot]:
        """The ``(slot, num_slots)`` that the sources in a checked ``state`` were saved for.

        A loader compares them with the slot it loads the state into: a source that keeps its
        slot (for the next round of ``repeat``) would otherwise read another slot's shards.
        """
        return []

    def rebalance(
        self, states: Sequence[Mapping[str, Any]], num_slots: int, pending: list[Key]
    ) -> list[dict[str, Any]]:
        """Turn the (checked) states of every old slot into states for ``num_slots`` new slots.

        ``pending`` are keys of records this stage's consumer had read but not handed out (a
        shuffle buffer's contents): the new slots must yield them again.

        Raises:
            ResumeError: this stage cannot split its position over another layout (the default).
        """
        raise ResumeError(
            f"{type(self).__name__} keeps a per-stream count that cannot be split over a different "
            "number of workers or ranks; resume with the checkpoint's num_workers and world_size"
        )

    def appends(self, state: Mapping[str, Any]) -> bool:
        """Whether loading the (checked) ``state`` adds records to its epoch that it did not hold
        when saved: a source built with ``growth="append"`` over shards appended since.

        A stage that recorded a source as ended (:func:`mix`) then reads that source again, so
        the appended records are read in the restored epoch.
        """
        return False

    def expect_rereads(self, branch: tuple[int, ...] = ()) -> None:
        """Called by a stage built over this one that reads records again: by key (a shuffle buffer's
        restore, a carried record) or by iterating again from a saved state (a window's start).

        A record read again must come out as it did the first time, although it is read later,
        under another batch's global-RNG seed: a stage whose output would then differ makes it
        the same (a ``map`` without ``seed=`` draws each record's global randomness from its key),
        and passes the call on to its sources. A source has nothing to do (the default).
        ``branch`` is the path of source indices from the re-reading stage through the ``mix``es
        on the way: two branches' records can have the same keys, and must not get the same draws.
        """

    def with_identities(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state``, an earlier :meth:`state_dict` of this stage in the current epoch, with the
        identities of the shards entered since added (see :class:`ShardedIterable`).

        A stage that saves the state at the start of what it holds and reads it again on restore
        (a window read from its source) saves this instead: the restore then refuses a shard that
        changed under the held records rather than reading it as it is now. The default (a stage
        without shards) returns ``state``.
        """
        return state

    def with_held(self, state: dict[str, Any], shards: Iterable[Key]) -> dict[str, Any]:
        """``state`` (a :meth:`state_dict` or :meth:`state_update` of this stage, now) with the
        identities of ``shards`` added where it has none: the shards of records a stage above
        holds and a restore re-reads by key, each named by its records' key without the last int
        (the offset), e.g. ``(epoch, shard index)``.

        A shard the source has finished keeps no identity of its own; a shuffle buffer still
        holding its records saves this instead, so the restore refuses a shard changed under them.
        The default (a stage without shards) returns ``state``.
        """
        return state

    def positional(self) -> Positional | None:
        """This stage's records addressed by position (see :mod:`~resumable_data.streams.positional`),
        or None (the default): what ``shuffle_window`` and ``shuffle_buffer`` ask their source for
        to read by position instead of in order."""
        return None

    def upcoming_keys(self, count: int) -> list[Key] | None:
        """The keys of the next ``count`` records this stage yields in its epoch (fewer at its end),
        computed from its state, nothing read or moved; None (the default) where they depend on the
        records (a filter's predicate, a buffer's draws over what it holds)."""
        return None

    def epoch_positions(self) -> EpochPositions | None:
        """The current slot's epoch as positions (see :mod:`~resumable_data.streams.epoch_positions`),
        or None (the default): where the records follow from the records read, or the epoch's
        layout changed."""
        return None

    # -- public behaviour shared by all stages -------------------------------------------------
    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; keeps a pending restore of that epoch (see the module docstring)."""
        check_int_arg("epoch", epoch, minimum=0)
        if not (self._restore_pending and epoch == self._epoch):
            self._restore_pending = False
            self.reset(epoch, None)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from ``state_dict`` (from :meth:`state_dict` of an identical pipeline).

        Raises:
            ResumeError: malformed state, or one that does not fit this pipeline; the pipeline is
                unchanged.
        """
        self.check(state_dict)()
        self._restore_pending = True

    def __iter__(self) -> Iterator[Any]:
        records = self.iter_keyed()
        for _, value in records:  # the first record spends a pending restore
            self._restore_pending = False
            yield value
            break
        for _, value in records:
            yield value

    # -- fluent composition (the wrappers subclass Stream, hence the local imports) -------------
    def map(self, fn: Callable[..., Any], *, seed: int | None = None, global_rng: str | None = "record") -> Stream:
        """``fn(record)``, or ``fn(record, generator)`` with a per-record generator when ``seed`` is set.

        ``global_rng=None``: ``fn`` draws nothing from the global RNGs, so a map below a stage that
        re-reads records does not seed them per record (see :class:`~resumable_data.streams.map.Map`).
        """
        from .map import Map

        return Map(self, fn, seed=seed, global_rng=global_rng)

    def filter(self, predicate: Callable[[Any], bool], *, global_rng: str | None = "record") -> Stream:
        """Keep the records for which ``predicate`` is true (``global_rng``: as for :meth:`map`)."""
        from .filter import Filter

        return Filter(self, predicate, global_rng=global_rng)

    def batch(
        self, batch_size: int, *, drop_last: bool = False, collate_fn: Callable[[list[Any]], Any] | None = None
    ) -> Stream:
        """Group consecutive records into batches (``default_collate`` unless ``collate_fn``)."""
        from .batch import Batch

        return Batch(self, batch_size, drop_last=drop_last, collate_fn=collate_fn)

    def batch_by_tokens(
        self,
        max_tokens: int,
        *,
        length: Callable[[Any], int] = len,
        padded: bool = False,
        oversized: Literal["error", "alone"] = "error",
        collate_fn: Callable[[list[Any]], Any] | None = None,
        bucket: int | None = None,
        seed: int = 0,
    ) -> Stream:
        """Batches of consecutive records whose tokens (``length`` each) stay within ``max_tokens``;
        with ``bucket``, of records of similar lengths within windows of ``bucket`` records."""
        from .token_batch import BatchByTokens, BucketedBatchByTokens

        options: dict[str, Any] = {"length": length, "padded": padded, "oversized": oversized, "collate_fn": collate_fn}
        if bucket is None:
            return BatchByTokens(self, max_tokens, **options)
        return BucketedBatchByTokens(self, max_tokens, bucket=bucket, seed=seed, **options)

    def shuffle_buffer(self, size: int, *, seed: int = 0) -> Stream:
        """Shuffle through a buffer of ``size`` records."""
        from .shuffle import ShuffleBuffer

        return ShuffleBuffer(self, size, seed=seed)

    def shuffle_window(self, size: int, *, seed: int = 0) -> Stream:
        """Shuffle within consecutive windows of ``size`` records; the state is a few integers."""
        from .window import ShuffleWindow

        return ShuffleWindow(self, size, seed=seed)

    def pack(
        self, block_size: int, *, eos: int | None = None, boundaries: bool = False, pad_id: int | None = None
    ) -> Stream:
        """Concatenate token records into windows of ``block_size`` tokens; the state is a record key."""
        from .pack import Pack

        return Pack(self, block_size, eos=eos, boundaries=boundaries, pad_id=pad_id)

    def take(self, n: int) -> Stream:
        """At most ``n`` records per epoch."""
        from .take import Take

        return Take(self, n)

    def repeat(self, times: int | None = None) -> Stream:
        """Iterate the source ``times`` times (forever when None), one source epoch per round."""
        from .repeat import Repeat

        return Repeat(self, times)


def position_keys() -> frozenset[str]:
    """The :attr:`Stream.POSITION_KEYS` of every stage class defined so far (the library's are all
    imported with :mod:`resumable_data.streams`): the fields a state's position is made of, wherever
    they are nested."""
    keys: set[str] = set()
    classes: list[type[Stream]] = [Stream]
    while classes:
        cls = classes.pop()
        keys |= cls.POSITION_KEYS
        classes.extend(cls.__subclasses__())
    return frozenset(keys)


def fetch_grouped(
    keys: Sequence[Key],
    field: int,
    fetch: Callable[[int, list[int]], list[Any]],
    run: Callable[[Sequence[Any], Sequence[Callable[[], list[Any]]]], list[list[Any]]] | None = None,
) -> list[Any]:
    """Records for ``keys`` in their order, read one group at a time: what ``fetch_many`` needs.

    A group is the keys sharing ``key[field]`` (a shard, a source); within it, positions come in
    ascending order of ``key[field:]`` (for a shard: ascending offsets, so reads go forward).
    ``fetch(group, positions)`` returns the records of ``keys[p]`` for those positions, in order.
    ``run(groups, fetches)`` takes the groups (ascending) and their fetches and returns the fetches'
    results in that order: by default they run one after the other; a source whose reads wait on
    the network runs them at once.
    """
    ascending = sorted(range(len(keys)), key=lambda p: keys[p][field:])
    groups = [(group, list(members)) for group, members in itertools.groupby(ascending, key=lambda p: keys[p][field])]
    calls = [functools.partial(fetch, group, positions) for group, positions in groups]
    fetched = [call() for call in calls] if run is None else run([group for group, _ in groups], calls)
    records: list[Any] = [None] * len(keys)
    for (_, positions), group_records in zip(groups, fetched, strict=True):
        for position, record in zip(positions, group_records, strict=True):
            records[position] = record
    return records


MAX_COUNT = INT64_MAX
"""Largest epoch, cursor, offset or counter a state may hold (an int64; any real run stays far below)."""


def require_epoch(state: Mapping[str, Any], what: str) -> int:
    """Read the ``"epoch"`` field."""
    return require_count(state, EPOCH, what)


def require_count(state: Mapping[str, Any], key: str, what: str) -> int:
    """Read a non-negative int64 counter (epoch, draws, round, ...)."""
    return require_int(state, key, what, minimum=0, maximum=MAX_COUNT)


def check_same(what: str, field: str, saved: Any, current: Any, remedy: str) -> None:
    """Refuse a state whose ``field`` differs from this pipeline's, naming both values."""
    if not same_value(saved, current):
        raise ResumeError(f"{what} {field} changed: checkpoint has {brief(saved)}, pipeline has {current!r}; {remedy}")


def same_value(saved: Any, current: Any) -> bool:
    """Whether untrusted ``saved`` equals this pipeline's plain ``current`` value (int, float, bool,
    str, None or a list of them) without trusting ``saved``'s ``==`` (a tensor's is elementwise)."""
    if isinstance(current, list):
        return (
            isinstance(saved, (list, tuple))
            and len(saved) == len(current)
            and all(same_value(s, c) for s, c in zip(saved, current, strict=True))
        )
    if isinstance(current, bool) or isinstance(saved, bool):
        return type(saved) is type(current) and saved == current
    if isinstance(current, (int, float)):
        return isinstance(saved, (int, float)) and saved == current
    return type(saved) is type(current) and saved == current


def require_key(value: Any, what: str) -> Key:
    """Read a record key saved as a list of ints."""
    if not isinstance(value, (list, tuple)) or len(value) < 2 or not all(is_int(v) for v in value):
        raise ResumeError(f"{what}: a record key must be a list of at least 2 ints, but got {brief(value)}")
    return tuple(value)


def record_key(key: Key | None, what: str) -> Key:
    """The key of an item from a stage whose :attr:`Stream.keyed` is True (only batches have none)."""
    if key is None:
        raise TypeError(f"{what} needs records with an identity (a key); apply it before batch()")
    return key


def _accept_any(key: Key) -> None:
    """The key checker of a stage that cannot tell which keys it yields."""
