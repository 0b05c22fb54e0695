"""The keys of a ShardedIterable slot state, declared once (see the package docstring for the schema),
and the named values of its ``sizes=`` argument."""

from __future__ import annotations

WHAT = "ShardedIterable"  # how messages name the source
NUM_SHARDS = "num_shards"
SHARDS_DIGEST = "shards_digest"
SLOT = "slot"
NUM_SLOTS = "num_slots"
REMAINING = "remaining"  # without sizes: [[shard index, name, cursor], ...] of the unfinished shards
PENDING = "pending"
POSITION = "position"  # records read by this slot in its shards' order (with known sizes)
SIZES_DIGEST = "sizes_digest"
IDENTITIES = "identities"  # {shard index: fingerprint} of the shards partly read
DEALT = "dealt"  # with sizes, after layout changes: [[old number of slots, [old slots' positions]], ...]
# The shard counts the epoch's order was built over, when a restore grew it (core.growth); written
# only then, with GROWN_STATE_VERSION, so an older release refuses what it would misread.
EPOCH_SHARDS = "epoch_shards"
GROWN_STATE_VERSION = 3

COUNT = "count"  # sizes="count": ask the reader for the record counts (RecordCounter), or fail
UNKNOWN = "unknown"  # sizes="unknown": read by per-shard cursors even when the reader could count
