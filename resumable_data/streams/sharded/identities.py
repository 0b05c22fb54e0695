"""What a :class:`ShardedIterable` knows of its shards' identities (the reader's ``identity(shard)``).

Three uses. The identities of the shards a slot reads now, and of finished shards whose records a
window above still holds, go into the state (``current``). A restore compares each restored
identity with the shard as it is when the shard is next read, and refuses a changed one
(``unverified``, :meth:`ShardIdentities.verify`). Every identity taken in this epoch stays at hand
for a stage above that saves a finished shard's records with its own state (``entered``).

Over remote shards an identity is a request. A window's opening enters its shards without reading
them, so it leaves their identities to take (``untaken``): its first re-read asks them alongside its
reads, and anything that needs them first (a state, a read in order) takes them
(:meth:`ShardIdentities.settle`). A shard whose copy the reader holds locally (a node-local cache)
is entered with that copy's identity, which the reader knows without a request
(``known_identity(shard)``): it names the bytes the slot reads. A restored identity is always
compared with the shard as it is now on the server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ...errors import ResumeError
from ...storage.files import redact
from .keys import IDENTITIES

__all__ = ["ShardIdentities"]


class ShardIdentities:
    """The identities a slot's source holds, and the checks of restored ones.

    Args:
        items: the shards as the reader takes them.
        names: their names, for errors.
        read_identity: the reader's ``identity(shard)``, or None (a reader that gives none).
        known_identity: the reader's ``known_identity(shard)`` (an identity it holds without a
            request, or None), or None (a reader that has none).
    """

    def __init__(
        self,
        items: Sequence[Any],
        names: Sequence[str],
        read_identity: Callable[[Any], Any] | None,
        known_identity: Callable[[Any], Any] | None = None,
    ) -> None:
        self._items, self._names, self._read = items, names, read_identity
        self._known = known_identity if read_identity is not None else None
        self.current: dict[int, str] = {}  # shard index -> identity, saved in the state
        self.unverified: set[int] = set()  # restored identities not compared with the shard yet
        self.entered: dict[int, str] = {}  # every identity of this epoch, taken when entered or restored
        self.untaken: list[int] = []  # shards entered at their start, their identities not taken yet
        self.early: dict[int, str] = {}  # asked with a read ahead of shards not entered yet (see take)

    @property
    def given(self) -> bool:
        """Whether the reader gives identities at all."""
        return self._read is not None

    def ask(self, index: int) -> str | None:
        """The reader's fingerprint of shard ``index`` as it is now (None: the reader gives none)."""
        if self._read is None:
            return None
        try:
            return str(self._read(self._items[index]))
        except OSError as exc:
            raise ResumeError(f"cannot read shard {index} {redact(self._names[index])!r}: {exc}") from exc

    def known(self, index: int) -> str | None:
        """The identity of shard ``index`` that the reader holds without a request (a cached copy's,
        the bytes a read takes), or None."""
        identity = None if self._known is None else self._known(self._items[index])
        return None if identity is None else str(identity)

    def ahead(self, indices: Iterable[int]) -> list[int]:
        """Of the shards a re-read by position reads, those not entered yet (a window's read ahead into
        the next): their identities are asked alongside the read and kept in ``early`` for when they
        are entered."""
        known = self.current.keys() | self.entered.keys() | self.early.keys() | set(self.untaken)
        return sorted(set(indices) - known)

    def take(self, index: int) -> str | None:
        """The identity of shard ``index`` as it is now (as asked with the records read ahead of it,
        if they were; the cached copy's, if the reader holds one), noted as entered in this epoch."""
        identity = self.early.pop(index) if index in self.early else (self.known(index) or self.ask(index))
        if identity is not None:
            self.entered[index] = identity
        return identity

    def settle(self, taken: Sequence[str | None] | None = None) -> None:
        """Take the identities left to take (``taken``: asked already, in their order)."""
        untaken, self.untaken = self.untaken, []
        if taken is None:
            taken = [self.known(index) or self.ask(index) for index in untaken]
        for index, identity in zip(untaken, taken, strict=True):
            if identity is not None:
                self.current[index] = self.entered[index] = identity

    def answered(
        self, checks: Sequence[int], asked: Sequence[Any], where: Callable[[int], str], ahead: Sequence[int] = ()
    ) -> None:
        """The identities asked alongside a re-read: ``asked`` holds, in order, those of ``checks``
        (restored ones, compared now), of the untaken ones and of the shards read ``ahead``, or the
        error each ask raised."""
        for index, now in zip(checks, asked, strict=False):  # a changed shard first: it explains the rest
            if isinstance(now, BaseException):
                raise now
            self.compare(index, where(index), now)
        split = len(asked) - len(ahead)
        taken, early = asked[len(checks) : split], asked[split:]
        for outcome in [*taken, *early]:
            if isinstance(outcome, BaseException):
                raise outcome
        self.early.update((index, outcome) for index, outcome in zip(ahead, early, strict=True) if outcome is not None)
        self.settle(taken)

    def verify(self, index: int, where: str) -> None:
        """Before shard ``index`` is read again (``where``: from its cursor, or by key), refuse it if its
        restored identity differs from the shard as it is now."""
        if index in self.unverified:
            self.compare(index, where, self.ask(index))

    def compare(self, index: int, where: str, now: str | None) -> None:
        """Refuse shard ``index`` if its restored identity differs from ``now``, the shard's as asked."""
        saved = self.current[index]
        if now is not None and now != saved:
            raise ResumeError(
                f"shard {index} {redact(self._names[index])!r} ({where}) changed since the checkpoint: it was "
                f"{saved} (size:digest of its edges), it is {now} now; resuming would skip or repeat records. "
                "Restore the shard the checkpoint read, or pass allow_changed_shards=True to ShardedIterable "
                "to read it as it is"
            )
        self.unverified.discard(index)

    def added_to(self, state: dict[str, Any], held: Callable[[int], bool]) -> dict[str, Any]:
        """``state`` with the identities entered this epoch of the shards ``held`` selects, where it
        has none of its own (``with_identities``, ``with_held``)."""
        saved = state.get(IDENTITIES, {})
        added = {str(i): identity for i, identity in self.entered.items() if held(i) and str(i) not in saved}
        return {**state, IDENTITIES: {**saved, **added}} if added else state

    def reset(self) -> None:
        """A new epoch (or slot): nothing entered, nothing to check."""
        self.current, self.unverified, self.entered, self.untaken, self.early = {}, set(), {}, [], {}

    def restore(self, identities: Mapping[int, str], *, check: bool) -> None:
        """A restored state's identities; with ``check``, each compared when its shard is next read
        (a restore opens no shard it does not read)."""
        self.current, self.entered, self.untaken, self.early = dict(identities), dict(identities), [], {}
        self.unverified = set(identities) if check else set()
