"""ShardedIterable: the seekable source of a stream pipeline, as a set of per-shard cursors.

The state is which shards of the epoch are unfinished and where each one stands. Two shards held
in memory, five records read (shard "b" whole, then two of "a")::

    >>> from resumable_data.streams import ShardedIterable
    >>> records = {"a": [0, 1, 2, 3], "b": [4, 5, 6]}
    >>> def read(shard, start):
    ...     return iter(records[shard][start:])
    >>> stream = ShardedIterable(["a", "b"], read_shard=read, seed=0)
    >>> reading = iter(stream)
    >>> [next(reading) for _ in range(5)]
    [4, 5, 6, 0, 1]
    >>> stream.state_dict()
    {'version': 2, 'epoch': 0, 'seed': 0, 'shuffle': True, 'num_shards': 2, 'shards_digest': '...',
     'slot': 0, 'num_slots': 1, 'remaining': [[0, 'a', 2]], 'pending': [], 'identities': {}}

``remaining`` lists this slot's unfinished shards in the order they will be read, each as
``[shard index, shard name, cursor]``; the cursor is the reader's offset of the next record (a
record index for token windows, a byte offset for text). A restore opens the first shard *at* its
cursor: nothing before it is read. ``pending`` holds ``[shard index, offset]`` of single records to
read before the shards: records that a shuffle buffer held when the worker/rank layout changed.
The state grows with the number of shards, never with the number of records read.

Known sizes. Given the shards' record counts, a slot's state is one number instead of a list:
``"position"``, the records this slot has read in its shards' order, from which the current shard
and its cursor are computed (prefix sums of the sizes), with ``"sizes_digest"`` to refuse other
sizes. The state is then a few hundred bytes at any number of shards. By default the counts come
from a reader that counts cheaply, asked once when the ShardedIterable is built
(:class:`RecordCounter`: :class:`~resumable_data.streams.TokenShardReader` from the file size,
:class:`~resumable_data.streams.ParquetReader` from the footers), or from ``sizes=[...]`` (an index
file); ``sizes="unknown"`` keeps the cursors even with a counting reader::

    >>> sized = ShardedIterable(["a", "b"], read_shard=read, seed=0, sizes=[4, 3])
    >>> reading = iter(sized)
    >>> [next(reading) for _ in range(5)]
    [4, 5, 6, 0, 1]
    >>> sized.state_dict()
    {'version': 2, 'epoch': 0, 'seed': 0, 'shuffle': True, 'num_shards': 2, 'shards_digest': '...',
     'slot': 0, 'num_slots': 1, 'sizes_digest': '...', 'position': 5, 'pending': [], 'identities': {}}

After a layout change a slot reads the shards dealt to it (below); their order is computed
from the old slots' positions, kept in ``"dealt"`` as ``[[old number of slots, [their positions]],
...]`` (one entry per layout change in the epoch), so the state is still a position: a few bytes
per old slot, not a cursor per shard. A state saved by cursors (its ``"remaining"`` listed, no
``"sizes_digest"``: cursors mean the same whatever the sizes) still loads with counted sizes, reads
on from its cursors and is written back as it was; its next epoch is read by position. A state
with a position is refused when the counts differ from the checkpoint's (naming the changed shard
when the state holds its fingerprint).

Shard identity. When a shard is opened at its start, a reader with ``identity(shard)`` (the
ready-made ones: size plus a digest of the first and last 4 KiB, which holds a Parquet footer) is
asked for a short fingerprint, kept in ``"identities"`` while the shard is partly read, and while a
stage above holds records of it that a restore reads again: a ``shuffle_window``'s open window
(:meth:`ShardedIterable.seek`; for a window read from its source, the state at its start gets the
fingerprints of the shards the window entered, :meth:`Stream.with_identities`), a shuffle buffer's
records (:meth:`Stream.with_held`: the fingerprint noted when the shard was entered, or restored;
a restored one of a finished shard stays in the state until the epoch's end). A restore compares
each with the file as it is now before reading the shard again (in order or by key) and refuses a
changed shard (truncated, rewritten, replaced by same-size content) with a ResumeError naming it,
unless ``allow_changed_shards=True``.

Order. The shards of epoch ``e`` are read in the order of ``Permutation(num_shards, seed, e)``
(or in list order with ``shuffle=False``). Split over ``S`` (rank, worker) slots, slot ``s`` reads
the ``s``-th, ``s+S``-th, ... shard of that order.

Growth. Shards appended to the list since a checkpoint join as ``growth=`` says (see
``core.growth``): with ``"next_epoch"`` the restored epoch reads only the checkpoint's shards; with
``"append"`` the new shards, shuffled among themselves, follow every shard of the epoch's order, and
are dealt to the slots of the current layout after the shards they still have, so the old shards'
cursors (or, with sizes, the slots' positions) keep their meaning. The order is then a
:class:`~resumable_data.core.permutation.PiecewisePermutation` over the shard counts in
``"epoch_shards"`` (written, with ``"version": 3``, only for an epoch that grew). The checkpoint's
shard list must be a prefix of the new one, by names and sizes: ``"shards_digest"`` and
``"sizes_digest"`` are compared with the digests of the first ``"num_shards"`` shards.

Versions: ``"version"`` is 2 (``STREAM_STATE_VERSION``), or 3 for an epoch that grew; a state of
another version is refused.

Layout change. :meth:`ShardedIterable.rebalance` pools the unfinished shards of every old slot
with their cursors, sorts them back into the epoch order and deals them round-robin to the new
slots (pending records likewise). Every record of the epoch is still read exactly once, but the
order of the rest of the epoch differs from an uninterrupted run with the old layout. With known
sizes the pooled list is computed from the positions (array operations over the epoch's shards),
never listed.
"""

from __future__ import annotations

from .keys import (
    DEALT,
    EPOCH_SHARDS,
    GROWN_STATE_VERSION,
    IDENTITIES,
    NUM_SHARDS,
    NUM_SLOTS,
    PENDING,
    POSITION,
    REMAINING,
    SHARDS_DIGEST,
    SIZES_DIGEST,
    SLOT,
)
from .layout import NO_CURSOR
from .reading import RecordCounter
from .source import ShardedIterable
from .state import ShardState

__all__ = [
    "DEALT",
    "EPOCH_SHARDS",
    "GROWN_STATE_VERSION",
    "IDENTITIES",
    "NO_CURSOR",
    "NUM_SHARDS",
    "NUM_SLOTS",
    "PENDING",
    "POSITION",
    "REMAINING",
    "SHARDS_DIGEST",
    "SIZES_DIGEST",
    "SLOT",
    "RecordCounter",
    "ShardState",
    "ShardedIterable",
]
