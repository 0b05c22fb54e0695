"""Reading shards: records in order from a cursor, records at given offsets, fingerprints, counts.

A reader is ``read_shard(shard, start)`` (records from record offset ``start``), or an object with
``read_from(shard, start)`` yielding ``(next offset, record)`` (its own offsets: bytes for
:class:`~resumable_data.streams.TextLineReader`). Optional capabilities, asked with ``getattr``:

* ``read_records(shard, offsets)``: the records at those ascending offsets, one open per shard;
* ``identity(shard)``: a short fingerprint of the shard as it is now (:class:`ShardedIterable`
  refuses a restore over a changed shard);
* ``known_identity(shard)``: the identity of a copy the reader holds locally (a node-local cache's),
  without a request, or None: a slot entering the shard takes it in place of asking ``identity``
  (a restore's check always asks);
* ``num_records(shard)``: the shard's record count, cheaply (:class:`RecordCounter`): asked for
  every shard when a ShardedIterable is built, unless ``sizes=`` says otherwise;
* ``reads_concurrently``: true when the reader may be called from several threads at once for
  different remote shards, and gains from it (its reads wait on the network:
  :class:`~resumable_data.streams.TokenShardReader`). A re-read of records from several shards then
  reads those that wait on the network all at once (:func:`at_once`) and checks the shards'
  identities alongside: a restore's first batch costs one round trip, not two per shard it touches.
  Such a reader may also say ``reads_locally(shard)``: true when reading the shard now asks nothing
  of the network (a copy in a node-local cache). Those reads run in the calling thread meanwhile;
  handing a read of a few microseconds to another thread costs more than the read.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

from ...core.state import check_int_arg
from ...errors import ResumeError
from ...storage.files import is_url, redact
from .keys import COUNT, UNKNOWN
from .shards import Shards

__all__ = [
    "RecordCounter",
    "at_once",
    "count_records",
    "read_at",
    "reads_concurrently",
    "records_from",
    "resolve_sizes",
    "waits_on_network",
]

_AT_ONCE = 8  # reads (and identity checks) of one re-read that run at the same time
_pool: tuple[ThreadPoolExecutor, int] | None = None  # this process's threads for them, and its pid


@runtime_checkable
class RecordCounter(Protocol):
    """A reader that knows each shard's record count cheaply (a file size, a Parquet footer).

    :class:`ShardedIterable` asks such a reader for the counts by default (once, when it is built:
    one count per shard, before anything is read), so its state is a position and
    :meth:`Stream.shuffle_window` reads by position without the caller listing the sizes.
    :class:`~resumable_data.streams.TokenShardReader` and
    :class:`~resumable_data.streams.ParquetReader` are record counters; a reader that would have to
    read a whole shard to count it (:class:`~resumable_data.streams.TextLineReader`) is not one.
    The counts must be record offsets as ``read_shard(shard, start)`` takes them (record numbers).
    """

    def num_records(self, shard: Any) -> int:
        """The number of records ``shard`` holds."""
        ...


def counts(reader: Any) -> bool:
    """Whether ``reader`` counts records cheaply, as record numbers (not offsets of its own)."""
    return isinstance(reader, RecordCounter) and not hasattr(reader, "read_from")


def resolve_sizes(
    sizes: Sequence[int] | str | None, reader: Any, shards: Sequence[Any]
) -> tuple[list[int] | None, bool]:
    """The shard sizes ``ShardedIterable(sizes=...)`` stands for, and whether the reader counted them.

    None counts with a reader that can (:func:`counts`) and leaves the sizes unknown otherwise;
    ``"count"`` must count; ``"unknown"`` never does; a list is taken as given.

    Raises:
        ResumeError: ``sizes`` is none of those, a list of the wrong length or with a bad count, a
            list or ``"count"`` with a reader whose offsets are its own, or counting fails.
    """
    if sizes is None:
        return (count_records(reader, shards), True) if counts(reader) else (None, False)
    if isinstance(sizes, str):
        if sizes == UNKNOWN:
            return None, False
        if sizes == COUNT:
            return count_records(reader, shards), True
        raise ResumeError(
            f"sizes should be a list of record counts, None, {COUNT!r} or {UNKNOWN!r}, but got sizes={sizes!r}"
        )
    listed = [check_int_arg("sizes[i]", size, minimum=0) for size in sizes]
    if len(listed) != len(shards):
        raise ResumeError(f"sizes must give one record count per shard: {len(shards)} shards but {len(listed)} sizes")
    if hasattr(reader, "read_from"):
        raise ResumeError(
            f"sizes= needs a reader whose offsets are record numbers, but {type(reader).__name__} keeps "
            f"its own offsets (bytes); leave sizes=None (or {UNKNOWN!r}) for it"
        )
    return listed, False


def count_records(reader: Any, shards: Sequence[Any]) -> list[int]:
    """The record count of each shard as ``reader`` gives it.

    Raises:
        ResumeError: the reader cannot count (no ``num_records``, or offsets of its own:
            ``read_from``), a shard cannot be read (missing), or a count is not an int >= 0.
    """
    if not counts(reader):
        raise ResumeError(
            f"sizes={COUNT!r} needs a reader that counts a shard's records cheaply, num_records(shard), with "
            f"record numbers as offsets, but {type(reader).__name__} has "
            + ("its own offsets (bytes)" if hasattr(reader, "read_from") else "no num_records")
            + f"; pass sizes=[record count of each shard] (e.g. from an index file), or sizes={UNKNOWN!r} "
            "(per-shard cursors)"
        )
    sizes = []
    for index, shard in enumerate(shards):
        try:
            count = reader.num_records(shard)
        except (OSError, ResumeError) as exc:
            raise ResumeError(
                f"cannot count the records of shard {index} {redact(shard)!r} (ShardedIterable asks a reader that "
                f"counts for every shard's count when it is built; with sizes={UNKNOWN!r} it opens a shard only "
                f"to read it): {exc}"
            ) from exc
        sizes.append(check_int_arg(f"{type(reader).__name__}.num_records({redact(shard)!r})", count, minimum=0))
    return sizes


def records_from(shards: Shards, reader: Any, index: int, start: int) -> Generator[tuple[int, Any], None, None]:
    """``(next offset, record)`` of shard ``index`` from ``start``; OSError becomes ResumeError, and a
    shard shorter than its known size is refused."""
    shard, name = shards.items[index], shards.names[index]
    try:
        if hasattr(reader, "read_from"):
            yield from reader.read_from(shard, start)
        elif shards.sizes is None:
            yield from enumerate(reader(shard, start), start=start + 1)
        else:
            size = shards.sizes[index]
            records = itertools.islice(reader(shard, start), max(0, size - start))
            offset = start
            for offset, record in enumerate(records, start=start + 1):
                yield offset, record
            if offset < size:
                raise ResumeError(
                    f"shard {index} {redact(name)!r} ended after {offset} records, but "
                    f"{'the reader counted' if shards.counted else 'sizes gives'} it {size}: the shard changed"
                    + ("" if shards.counted else ", or sizes is wrong")
                )
    except OSError as exc:
        raise ResumeError(f"cannot read shard {index} {redact(name)!r} at offset {start}: {exc}") from exc


def read_at(shards: Shards, reader: Any, index: int, offsets: list[int]) -> list[Any]:
    """The records of shard ``index`` at ``offsets`` (ascending); a missing one is a ResumeError.

    A reader with ``read_records(shard, offsets)`` gets them in one call; any other reader is read
    in runs, one ``read_shard`` call per run of consecutive records.
    """
    name = shards.names[index]
    read_records = getattr(reader, "read_records", None)
    if read_records is not None:
        try:
            records = list(read_records(shards.items[index], offsets))
        except OSError as exc:
            raise ResumeError(f"cannot read shard {index} {redact(name)!r} at offsets {offsets[:3]}...: {exc}") from exc
        if len(records) != len(offsets):
            raise ResumeError(
                f"{type(reader).__name__}.read_records returned {len(records)} records for "
                f"{len(offsets)} offsets of shard {index} {redact(name)!r}"
            )
        return records
    records = []
    while len(records) < len(offsets):
        run = records_from(shards, reader, index, offsets[len(records)])
        for next_offset, record in run:
            records.append(record)
            if len(records) == len(offsets) or offsets[len(records)] != next_offset:
                break
        else:
            missing = offsets[len(records)]
            raise ResumeError(
                f"shard {index} {redact(name)!r} has no record at offset {missing}: it is shorter "
                "than when the checkpoint was written (truncated or replaced?)"
            )
        run.close()  # releases the reader's file now, not at garbage collection
    return records


def reads_concurrently(reader: Any) -> bool:
    """Whether ``reader`` takes calls for different shards from several threads at once (see the
    module docstring)."""
    return getattr(reader, "reads_concurrently", False) is True


def waits_on_network(reader: Any, shard: Any) -> bool:
    """Whether reading ``shard`` with a reader that ``reads_concurrently`` waits on the network: a URL
    that the reader does not say it ``reads_locally`` (see the module docstring)."""
    if not is_url(shard):
        return False
    reads_locally = getattr(reader, "reads_locally", None)
    return reads_locally is None or not reads_locally(shard)


def at_once(calls: Sequence[Callable[[], Any]], here: Sequence[Callable[[], Any]] = ()) -> list[Any]:
    """Each call's result, or the exception it raised, in order: ``calls``, then ``here``.

    ``calls`` run at the same time (at most 8 at once) on this process's threads (a forked process
    makes its own); ``here`` run meanwhile in the calling thread, one after the other (reads that
    wait on nothing: a thread would cost more than they do).
    """
    global _pool
    if calls and (_pool is None or _pool[1] != os.getpid()):
        _pool = (ThreadPoolExecutor(_AT_ONCE, thread_name_prefix="shard-read"), os.getpid())
    futures = [_pool[0].submit(call) for call in calls] if _pool is not None else []
    done_here: list[Any] = []
    for call in here:
        try:
            done_here.append(call())
        except Exception as exc:  # as a future keeps it: the caller raises it after all are in
            done_here.append(exc)
    return [future.exception() or future.result() for future in futures] + done_here
