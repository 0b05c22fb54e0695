"""The slot ledger of a StreamLoader: each local slot's pipeline state as of the batches handed out.

Two verbs, as torchdata's ``incremental_state`` has ``generate_delta``/``apply_delta``: a worker
sends each batch with its delta (:meth:`Stream.state_update`, generated in the worker), and the
loader :meth:`SlotLedger.record`\\ s it as handed out; :meth:`SlotLedger.snapshot` gives the slot
states as of the batches handed out (or as of all but the last, for a caller that fetched a batch
ahead). The last batch's delta is folded in only when the caller asks for the next batch or stops
(:meth:`SlotLedger.settle`): until then a snapshot can still leave it out.

With 0 workers the pipeline is this process's own and stops right after each batch, so it holds
the state after the batch handed out; the ledger reads it from there when a state is asked for,
rather than applying every delta to a copy as it goes (a copy whose writes, one per record into a
list as long as the buffer, cost more than the batch's own state change). It still keeps each
batch's delta, for ``unconsumed=1`` (the position before the last batch): the deltas since its copy
was last refreshed are kept, pickled (as hundreds of batches' small dicts and lists they would set
off the garbage collector's full collections, a tenth of a second each beside a large model's
objects), and the copy is refreshed from the pipeline once they are ``_REFRESH_RATIO`` (8) times
its size, so the per-batch cost stays in proportion to the batch, whatever the buffer size. The
copy stays pickled until it is needed.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from typing import Any

from ..core.state import INT64_MAX, brief, is_int, require_mapping
from ..errors import ResumeError
from .base import Stream

__all__ = ["SlotLedger", "batch_counts", "slot_states"]

# With 0 workers, the pickled deltas kept beside the slot's copy may grow to this many times the
# copy's pickled size before the copy is refreshed from the pipeline (about one state_dict()).
_REFRESH_RATIO = 8


class SlotLedger:
    """Each local slot's pipeline state, batches yielded, and which slot is next.

    Args:
        stream: the loader's own pipeline (it applies deltas; with 0 workers it holds the state).
        workers: whether worker processes iterate copies of the pipeline (else this process does).
    """

    def __init__(self, stream: Stream, *, workers: bool) -> None:
        self._stream = stream
        self._workers = workers
        self.states: list[dict[str, Any]] = []
        self.yielded: list[int] = []  # per local slot, batches yielded in the epoch (global_rng keys)
        self.next_worker = 0
        # The last batch handed out, (slot, its batch count, its delta), folded into the three
        # fields above only when the caller asks for the next batch or stops (settle).
        self._last: tuple[int, int, dict[str, Any]] | None = None
        # The slot whose state the loader's pipeline holds right now, exactly as ``states`` records
        # it, or None. With 0 workers that pipeline then iterates without loading the state again:
        # a restored state is validated once, and a shuffle buffer keeps the records it holds after
        # a break (a reload would re-read them).
        self.holds: int | None = None
        # With 0 workers: the deltas of the batches handed out since the slot's copy was last
        # brought up to date, pickled; their bytes, and the copy's. The copy is states[0], or these
        # bytes when refreshed from the pipeline since.
        self._deltas: list[bytes] = []
        self._deltas_size = self._copy_size = 0
        self._pickled_states: bytes | None = None

    def reset(self, states: list[dict[str, Any]], yielded: list[int], next_worker: int) -> None:
        """Start from these slot states (an epoch's start, a restore), the pipeline holding the
        state of slot ``next_worker`` (the caller makes or applies that one last)."""
        self.states, self.yielded, self.next_worker = states, yielded, next_worker
        self._last = None
        self.holds = next_worker
        self._drop_deltas(0)

    @property
    def batches_yielded(self) -> int:
        """Batches handed out in the epoch, the last one included."""
        last = self._last
        return sum(self.yielded) + (last[1] - self.yielded[last[0]] if last else 0)

    @property
    def holds_back(self) -> bool:
        """Whether a batch handed out is not folded in yet (a snapshot can leave it out)."""
        return self._last is not None

    def record(self, local: int, count: int, delta: dict[str, Any]) -> None:
        """Slot ``local`` handed out its ``count``-th batch of the epoch, whose state change is ``delta``.
        With 0 workers the pipeline then holds that slot's state."""
        self._last = (local, count, delta)
        if not self._workers:
            self.holds = local

    def settle(self) -> None:
        """Fold the last batch handed out into the slot states (the caller moved on, or stopped)."""
        if self._last is None:
            return
        local, count, delta = self._last
        self._last = None
        if self._workers:
            self.states[local] = self._stream.apply_update(self.states[local], delta)
        else:
            # The pipeline holds this state; the delta is kept for snapshot(unconsumed=1) until the
            # deltas outgrow a refresh of the copy from the pipeline.
            kept = pickle.dumps(delta, protocol=pickle.HIGHEST_PROTOCOL)
            self._deltas.append(kept)
            self._deltas_size += len(kept)
            if self._deltas_size > _REFRESH_RATIO * self._copy_size and self.holds == local:
                self._refresh()
        self.yielded[local] = count
        self.next_worker = (local + 1) % len(self.states)

    def bring_up_to_date(self) -> None:
        """Make ``states`` hold every delta settled (before the pipeline loads one of them)."""
        if self._pickled_states is not None:
            self.states = pickle.loads(self._pickled_states)
            self._pickled_states = None
        if self._deltas:
            state = self.states[0]
            for kept in self._deltas:
                state = self._stream.apply_update(state, pickle.loads(kept))
            self.states[0] = state
            self._drop_deltas(self._copy_size)

    def snapshot(self, unconsumed: int) -> tuple[list[dict[str, Any]], list[int], int]:
        """``(slot states, batches yielded, next worker)`` as of the batches handed out, the last one
        left out with ``unconsumed=1``; the states are the caller's own copies."""
        yielded, next_worker = list(self.yielded), self.next_worker
        last = None if unconsumed else self._last
        if last is not None:
            local, count, _ = last
            yielded[local], next_worker = count, (local + 1) % len(self.states)
        if not self._workers and self.holds is not None and not unconsumed:
            # The pipeline holds the state after the last batch handed out: read it from there,
            # and refresh the copy from it unless a batch is still held back.
            states = _copy([self._stream.state_dict()]) if last is not None else pickle.loads(self._refresh())
        else:
            self.bring_up_to_date()
            states = _copy(self.states)
            if last is not None:
                # On a copy: self.states stays as it is, so a later call can still take the batch
                # back; copied again, since the state shares lists with the delta.
                local, _, delta = last
                states[local] = _copy([self._stream.apply_update(states[local], delta)])[0]
        return states, yielded, next_worker

    def _refresh(self) -> bytes:
        """Make the pipeline's state the slot's copy, with no deltas beside it (0 workers, the
        pipeline holding the state after the last batch handed out); returns the copy pickled.

        The copy stays pickled until it is needed (:meth:`bring_up_to_date`): most are replaced by
        the next refresh unread, and a buffer's worth of key lists unpickled at every refresh would
        be that many more objects for the garbage collector to track."""
        kept = pickle.dumps([self._stream.state_dict()], protocol=pickle.HIGHEST_PROTOCOL)
        self._drop_deltas(len(kept))
        self._pickled_states = kept
        return kept

    def _drop_deltas(self, copy_size: int) -> None:
        """No deltas are kept beside the slot's copy, whose pickled size is ``copy_size`` (0: unknown,
        so the first delta kept refreshes it), and the copy is ``states``."""
        self._deltas, self._deltas_size, self._copy_size = [], 0, copy_size
        self._pickled_states = None


_SLOT_NAME = re.compile(r"0|[1-9][0-9]*")


def slot_states(state: Mapping[str, Any], key: str, num_slots: int, what: str) -> dict[int, Any]:
    """A loader state's ``key`` field (``"slots"``) as ``{slot number: pipeline state}``; names are canonical ASCII decimals."""
    slots = require_mapping(state.get(key), f"{what} {key!r}")
    parsed = {}
    for name in slots:
        # Canonical decimal only: "²" and "٣" pass str.isdigit(), and "01" would alias slot 1.
        # Checking the length first bounds int(), which refuses strings of over 4300 digits.
        if not (
            isinstance(name, str)
            and len(name) <= len(str(num_slots))
            and _SLOT_NAME.fullmatch(name)
            and int(name) < num_slots
        ):
            raise ResumeError(f"{what} state: slot {brief(name)} is not a slot number below {num_slots}")
        parsed[int(name)] = slots[name]
    return parsed


def batch_counts(state: Mapping[str, Any], key: str, mine: range, what: str) -> list[int]:
    """A loader state's ``key`` field (``"batches"``): the counts of this rank's slots (0 for a state saved before they were kept)."""
    counts = require_mapping(state.get(key, {}), f"{what} {key!r}")
    batches = [counts.get(str(g), 0) for g in mine]
    for g, n in zip(mine, batches, strict=True):
        if not is_int(n) or not 0 <= n <= INT64_MAX:
            raise ResumeError(f"{what} state field {key!r} has {brief(n)} for slot {g}, expected an int >= 0")
    return batches


def _copy(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A deep copy of the slot states, so that the caller owns what state_dict() returns.

    A pickle round trip of data this loader made itself: a shuffle buffer's state lists every
    buffered key, and copy.deepcopy is several times slower on such lists.
    """
    copied: list[dict[str, Any]] = pickle.loads(pickle.dumps(states, protocol=pickle.HIGHEST_PROTOCOL))
    return copied
