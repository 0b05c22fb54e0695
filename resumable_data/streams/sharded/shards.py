"""The shard list a ShardedIterable reads and what fixes its order, with the layouts computed from it.

:class:`Shards` holds the names, the digests a checkpoint is compared with, the sizes when known,
and caches of the known-size layouts (:mod:`.layout`): a restore asks for the same slot layouts
once per slot state, and each batch asks for its slot's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ...core.growth import ERROR
from ...core.state import brief, require_int
from ...errors import ResumeError
from ...storage.files import redact
from ..base import Slot, check_same
from .keys import COUNT, IDENTITIES, NUM_SHARDS, POSITION, SHARDS_DIGEST, SIZES_DIGEST, UNKNOWN, WHAT
from .layout import Dealt, EpochOrder, Layout, dealing, shard_order, slot_layout

__all__ = ["Shards"]

_LAYOUTS_CACHED = 8  # slot layouts kept: a restore reads the states of several slots in turn


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


class Shards:
    """The shards, their order arguments (seed, shuffle, growth) and, when known, their sizes.

    Args:
        items: the shards as the reader takes them.
        seed: seed of the shard order.
        shuffle: shuffle the shard order each epoch.
        sizes: the record count of each shard, or None.
        growth: what a restore does with a checkpoint taken on fewer shards (``core.growth``).
        counted: whether the reader counted ``sizes`` (not the caller's ``sizes=``; see
            :meth:`check_list`).
        identity: the reader's ``identity(shard)``, if it has one: names the shard whose count
            changed when a restore refuses counted sizes.
    """

    def __init__(
        self,
        items: list[Any],
        *,
        seed: int,
        shuffle: bool,
        sizes: list[int] | None,
        growth: str,
        counted: bool = False,
        identity: Callable[[Any], Any] | None = None,
    ) -> None:
        self.items = items
        self.names = [str(s) for s in items]
        self.count = len(items)
        self.seed = seed
        self.shuffle = shuffle
        self.sizes = sizes
        self.counted = counted
        self.identity = identity
        self.growth = growth
        self.digest = _digest("\n".join(self.names).encode())
        self.size_array = np.zeros(0, dtype=np.int64) if sizes is None else np.asarray(sizes, dtype=np.int64)
        self.sizes_digest = None if sizes is None else _digest(self.size_array.tobytes())
        self._prefix_digests: dict[int, str] = {}  # digests of the first k names / sizes, for a restore
        self._prefix_sizes: dict[int, str] = {}
        self._order: tuple[EpochOrder, np.ndarray] | None = None  # the cached shard order of an epoch
        self._dealing: tuple[Any, tuple[np.ndarray, np.ndarray]] | None = None  # the cached dealing
        self._layouts: dict[Any, Layout] = {}  # cached layouts of the slots asked for lately

    def order(self, order: EpochOrder) -> np.ndarray:
        """The shard order as an array, cached for the last order asked for (a layout change needs it
        again, and computing it costs in proportion to the number of shards)."""
        if self._order is None or self._order[0] != order:
            self._order = (order, shard_order(order, self.seed, self.shuffle))
        return self._order[1]

    def dealing(self, order: EpochOrder, dealt: Dealt) -> tuple[np.ndarray, np.ndarray]:
        """:func:`.layout.dealing` of the epoch's order, cached: a restore asks for it once per slot."""
        if self._dealing is None or self._dealing[0] != (order, dealt):
            self._dealing = ((order, dealt), dealing(self.size_array, self.order(order), dealt))
        return self._dealing[1]

    def layout(self, order: EpochOrder, slot: Slot, dealt: Dealt) -> Layout:
        """The slot's shards in reading order, where each one starts and the offset it is read from
        (cached: each batch asks for it). Needs the sizes."""
        layout = self._layouts.get((order, slot, dealt))
        if layout is None:
            shards, offsets = self.dealing(order, dealt)
            if len(self._layouts) >= _LAYOUTS_CACHED:
                self._layouts.clear()
            layout = self._layouts[order, slot, dealt] = slot_layout(self.size_array, shards, offsets, slot)
        return layout

    def check_list(self, state: Mapping[str, Any]) -> int:
        """Refuse a state whose shard list is not this one, or (with ``growth``) a prefix of it, by
        names and sizes; return the checkpoint's number of shards."""
        n = self.count
        saved_n = require_int(state, NUM_SHARDS, WHAT, minimum=1)
        if saved_n > n or (saved_n < n and self.growth == ERROR):
            remedy = (
                "shards may be appended since a checkpoint (growth=), but not removed"
                if saved_n > n
                else "to read the appended shards, build the ShardedIterable with growth='next_epoch' (they join "
                "at the next epoch) or growth='append' (they join the rest of this epoch)"
            )
            raise ResumeError(
                f"{WHAT} number of shards changed: checkpoint has {saved_n}, pipeline has {n}; pass the "
                f"checkpoint's shard list, in its order; {remedy}"
            )
        check_same(
            WHAT,
            "shard list (digest of the names)",
            state.get(SHARDS_DIGEST),
            self._prefix_digest(saved_n),
            "pass the checkpoint's shard list, in its order"
            + (f" (its {saved_n} shards first, then the appended ones)" if saved_n < n else ""),
        )
        saved_sizes = state.get(SIZES_DIGEST)
        if saved_sizes is None and self.counted and POSITION not in state:
            # Saved without sizes (by a release that did not ask the reader to count): the state
            # lists its shards' cursors, which mean the same whatever the sizes are.
            return saved_n
        expected = self._prefix_sizes_digest(saved_n)
        if saved_sizes is not None and expected is None:
            raise ResumeError(
                f"{WHAT} state was saved with the shards' sizes (its position needs them), but this pipeline has "
                f"none: build it with sizes=None and a reader that counts (RecordCounter), sizes={COUNT!r}, or the "
                f"checkpoint's sizes=[...], not sizes={UNKNOWN!r}"
            )
        if saved_sizes != expected and self.counted and saved_sizes is not None:
            raise ResumeError(
                f"{WHAT} shard sizes changed: the reader counted other record counts than the checkpoint's (sizes "
                f"digest {brief(saved_sizes)}, now {brief(expected)}){self._changed(state)}; its position would mean "
                f"other records. Restore the shards the checkpoint read (a state saved with sizes={UNKNOWN!r}, "
                "by cursors, reads on over changed shards with allow_changed_shards=True)"
            )
        check_same(
            WHAT,
            "shard sizes (digest)",
            saved_sizes,
            expected,
            "pass the checkpoint's sizes= (the same record count for every shard), or for a state saved by "
            f"cursors, sizes=None or {UNKNOWN!r}",
        )
        return saved_n

    def _changed(self, state: Mapping[str, Any]) -> str:
        """Which shard partly read (or held) by ``state`` changed, by the fingerprints the state holds,
        as a clause of the message refusing its sizes; else that the changed one is another."""
        saved = state.get(IDENTITIES)
        if self.identity is None or not isinstance(saved, Mapping):
            return ": the reader gives no fingerprints to tell which shard changed"
        for key, identity in saved.items():
            index = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 20 else -1
            if not 0 <= index < self.count:
                continue  # a malformed state: parsing it would refuse it, naming the field
            try:
                now = str(self.identity(self.items[index]))
            except (OSError, ResumeError) as exc:
                return f": shard {index} {redact(self.names[index])!r} cannot be read now ({exc})"
            if now != identity:
                return (
                    f": shard {index} {redact(self.names[index])!r} changed, it was {brief(identity)}, it is {now} now"
                )
        return ": a shard that is not being read changed (the fingerprints in the state are unchanged)"

    def _prefix_digest(self, count: int) -> str:
        """The digest of the first ``count`` shard names (what a checkpoint with that many shards holds)."""
        if count == self.count:  # the usual case, computed once at construction
            return self.digest
        if count not in self._prefix_digests:
            self._prefix_digests[count] = _digest("\n".join(self.names[:count]).encode())
        return self._prefix_digests[count]

    def _prefix_sizes_digest(self, count: int) -> str | None:
        """The digest of the first ``count`` shard sizes (None without sizes)."""
        if self.sizes is None or count == self.count:
            return self.sizes_digest
        if count not in self._prefix_sizes:
            self._prefix_sizes[count] = _digest(self.size_array[:count].tobytes())
        return self._prefix_sizes[count]
