"""mix: draw records from several streams at random with given weights, deterministically.

Draw ``d`` of epoch ``e`` picks a source with ``u = hash_ints(seed, e, d) / 2**64`` against the
cumulative weights of the sources not yet exhausted. An exhausted source drops out (the others'
weights are renormalized); the mix ends when every source has ended. Pairing it with
``repeat()`` gives an endless mixture at fixed proportions.

Schedules. The weights may change as the mix goes: a list of ``(records drawn, weights)`` pieces
(each piece's weights hold from its count on; the first count is 0), or a function of the number
of records drawn that returns the weights. The count is this pipeline copy's (one per worker/rank
slot) in the current epoch, which the state already holds (draws made, less one per exhausted
source), so a schedule costs the state nothing. A schedule's weights may be 0 (a source off for
a while); when every source still running has weight 0, the draw is uniform over them, so each
source still yields each of its records once per epoch. A layout change (another number of
workers or ranks) starts each new slot at the old slots' mean count: the schedule goes on where
it stood.

Growth. A source whose shards were appended since the checkpoint (``growth="append"``) reads them
in the restored epoch, also when the mix had found it exhausted: a restore marks it running again
and takes back the draw that found it ended. Every unread record of the epoch and every appended
one is then drawn once, as from a source that grew without a mix around it.

State: the per-source positions (``"sources"``, one state per source) plus two small counters,
the draws made and which sources are exhausted; ``"weights"`` is the fixed weights, the
schedule's pieces, or None for a function (which a state cannot check)::

    >>> from resumable_data.streams import ShardedIterable, mix
    >>> records = {"code": [0, 1, 2], "prose": [10, 11, 12, 13]}
    >>> def source(shard):
    ...     return ShardedIterable([shard], read_shard=lambda shard, start: iter(records[shard][start:]))
    >>> mixed = mix([source("code"), source("prose")], weights=[1, 3], seed=0)
    >>> reading = iter(mixed)
    >>> [next(reading) for _ in range(3)]
    [0, 10, 1]
    >>> {key: value for key, value in mixed.state_dict().items() if key != "sources"}
    {'version': 2, 'epoch': 0, 'seed': 0, 'weights': [1.0, 3.0], 'draws': 3, 'exhausted': [False, False]}

A record's key gets its source index inserted after the epoch, ``(epoch, source, *where)``, so
records of different sources never share a key.
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

from ..core.hash import DrawHashes
from ..core.state import SEED, VERSION, brief, check_int_arg, check_version, require_mapping
from ..errors import ResumeError
from .base import (
    DRAWS,
    EPOCH,
    SOURCES,
    STREAM_STATE_VERSION,
    Key,
    Slot,
    Stream,
    check_same,
    fetch_grouped,
    record_key,
    require_count,
    require_epoch,
)

__all__ = ["Mix", "mix"]

_WHAT = "mix"
WEIGHTS = "weights"
EXHAUSTED = "exhausted"

Weights: TypeAlias = Sequence[float] | Sequence[tuple[int, Sequence[float]]] | Callable[[int], Sequence[float]]
"""Fixed weights, ``(records drawn, weights)`` pieces, or a function of the records drawn."""


class Schedule:
    """The weights of a mix as a function of the records drawn, from any form of :data:`Weights`."""

    def __init__(self, weights: Weights | None, n: int) -> None:
        self.n = n
        self._fn: Callable[[int], Sequence[float]] | None = None
        self._starts: list[int] = []
        self._pieces: list[list[float]] = []
        if weights is None:
            self.saved: Any = [1.0] * n
            self._pieces = [self.saved]
            self._starts = [0]
        elif callable(weights):
            self._fn, self.saved = weights, None
        elif all(isinstance(w, numbers.Real) for w in weights):  # fixed weights
            fixed = [float(w) for w in weights]  # type: ignore[arg-type]  # (all of them numbers)
            if len(fixed) != n or not all(math.isfinite(w) and w > 0 for w in fixed):
                raise ResumeError(f"weights must be {n} positive finite numbers, but got weights={fixed!r}")
            self.saved, self._pieces, self._starts = fixed, [fixed], [0]
        else:
            self._piecewise(weights)

    def _piecewise(self, pieces: Any) -> None:
        starts: list[int] = []
        for piece in pieces:
            if not isinstance(piece, (tuple, list)) or len(piece) != 2:
                raise ResumeError(f"a weight schedule is a list of (records drawn, weights) pairs, but got {piece!r}")
            start = check_int_arg("a schedule piece's records drawn", piece[0], minimum=0)
            if (starts and start <= starts[-1]) or (not starts and start != 0):
                raise ResumeError(
                    f"a weight schedule's counts must start at 0 and increase, but got {[p[0] for p in pieces]!r}"
                )
            starts.append(start)
            self._pieces.append(self._checked(piece[1], f"the weights from {start} records on"))
        self._starts = starts
        self.saved = [[start, weights] for start, weights in zip(starts, self._pieces, strict=True)]

    def _checked(self, weights: Any, what: str) -> list[float]:
        try:
            values = [float(w) for w in weights]
        except (TypeError, ValueError):
            values = []
        if len(values) != self.n or not all(math.isfinite(w) and w >= 0 for w in values) or not sum(values) > 0:
            raise ResumeError(f"{what} must be {self.n} finite numbers >= 0, not all 0, but got {weights!r}")
        return values

    def at(self, drawn: int) -> list[float]:
        """The weights once ``drawn`` records are drawn."""
        if self._fn is None:
            return self._pieces[bisect.bisect_right(self._starts, drawn) - 1]
        return self._checked(self._fn(drawn), f"the schedule's weights at {drawn} records drawn")


class _Weighing(NamedTuple):
    """How a draw weighs the sources: the same for every draw while the schedule's piece and the
    exhausted sources stay the same, so it is computed once for them, not per draw."""

    piece: list[float]  # the schedule's weights it was computed from
    exhausted: list[bool]  # a copy of the exhausted flags it was computed for
    active: list[int]  # the sources still running
    weights: list[float]  # the piece, or 1 each when every running source has weight 0
    total: float  # the running sources' weights summed
    last: int  # the last running source of weight > 0: where float rounding at the top lands

    @staticmethod
    def of(piece: list[float], exhausted: list[bool]) -> _Weighing:
        active = [i for i, done in enumerate(exhausted) if not done]
        weights = piece
        if not any(weights[i] > 0 for i in active):
            weights = [1.0] * len(weights)  # only sources at weight 0 are left: they still run out
        total = sum(weights[i] for i in active)
        return _Weighing(piece, list(exhausted), active, weights, total, [i for i in active if weights[i] > 0][-1])


class Mix(Stream):
    """Records from ``streams`` chosen at random in proportion to ``weights``.

    Args:
        streams: the streams to mix (at least one).
        weights: one positive weight per stream (equal weights when None), or a schedule: a list
            of ``(records drawn, weights)`` pieces starting at 0, or a function of the records
            drawn returning the weights (see the module docstring).
        seed: seed of the choices; only ``(seed, epoch, draw number)`` decide each one.

    Example::

        data = mix([code, prose], weights=[1, 3], seed=0).batch(32)
        data.load_state_dict(saved)  # each source continues at its own cursor
        # A schedule: code off for the first 10_000 records drawn, then at 1:3.
        warmup = mix([code, prose], weights=[(0, [0, 1]), (10_000, [1, 3])], seed=0)
    """

    POSITION_KEYS = frozenset({EPOCH, DRAWS, EXHAUSTED})

    def __init__(self, streams: Sequence[Stream], weights: Weights | None = None, *, seed: int = 0) -> None:
        super().__init__()
        self.streams = list(streams)
        if not self.streams or not all(isinstance(s, Stream) for s in self.streams):
            raise TypeError(f"mix takes a non-empty list of Streams, got {streams!r}")
        if not all(s.keyed for s in self.streams):
            raise TypeError("mix takes record streams; batch after mixing, not before")
        self.schedule = Schedule(weights, len(self.streams))
        self.seed = check_int_arg("seed", seed, minimum=-(2**63))
        self.fetchable = all(s.fetchable for s in self.streams)
        self.depth = 1 + max(s.depth for s in self.streams)
        self._draws = 0
        self._exhausted = [False] * len(self.streams)
        self._epoch = self.streams[0].epoch
        self._weighing: _Weighing | None = None  # the last draw's weights, kept while they hold
        self._hashes = DrawHashes(self.seed)

    def _choose(self) -> int:
        # Records drawn so far: every draw but the one that found each exhausted source ended.
        piece = self.schedule.at(self._draws - sum(self._exhausted))
        weighing = self._weighing
        if weighing is None or weighing.piece is not piece or weighing.exhausted != self._exhausted:
            weighing = self._weighing = _Weighing.of(piece, self._exhausted)
        u = self._hashes.at(self._epoch, self._draws) / 2.0**64 * weighing.total
        self._draws += 1
        weights = weighing.weights
        for i in weighing.active:
            u -= weights[i]
            if u < 0:
                return i
        return weighing.last  # float rounding at the very top of the range

    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        iterators: dict[int, Iterator[tuple[Key | None, Any]]] = {}
        while not all(self._exhausted):
            i = self._choose()
            if i not in iterators:
                iterators[i] = self.streams[i].iter_keyed()
            item = next(iterators[i], None)
            if item is None:
                self._exhausted[i] = True
                continue
            key, value = record_key(item[0], _WHAT), item[1]
            yield (key[0], i, *key[1:]), value

    def fetch(self, key: Key) -> Any:
        return self.streams[key[1]].fetch((key[0], *key[2:]))

    def expect_rereads(self, branch: tuple[int, ...] = ()) -> None:
        for i, stream in enumerate(self.streams):
            stream.expect_rereads((*branch, i))

    def with_identities(self, state: dict[str, Any]) -> dict[str, Any]:
        sources = [stream.with_identities(s) for stream, s in zip(self.streams, state[SOURCES], strict=True)]
        return {**state, SOURCES: sources}

    def with_held(self, state: dict[str, Any], shards: Iterable[Key]) -> dict[str, Any]:
        # (epoch, source, *shard): the source's own shard is (epoch, *shard).
        mine: list[list[Key]] = [[] for _ in self.streams]
        for shard in shards:
            mine[shard[1]].append((shard[0], *shard[2:]))
        sources = [
            stream.with_held(s, held) if held else s
            for stream, s, held in zip(self.streams, state[SOURCES], mine, strict=True)
        ]
        return {**state, SOURCES: sources}

    def fetch_many(self, keys: Sequence[Key]) -> list[Any]:
        def fetch(source: int, positions: list[int]) -> list[Any]:
            return self.streams[source].fetch_many([(keys[p][0], *keys[p][2:]) for p in positions])

        return fetch_grouped(keys, 1, fetch)

    def key_checker(self, state: Mapping[str, Any] | None) -> Callable[[Key], None]:
        sources = [None] * len(self.streams) if state is None else self._sources_of(state)
        # A source's checker is built at its first key: pack checks one carried key, and building
        # a checker parses that source's state.
        subs: list[Callable[[Key], None] | None] = [None] * len(self.streams)

        def check(key: Key) -> None:
            # (epoch, source, *where): the source's own key is (epoch, *where).
            if len(key) < 3 or not 0 <= key[1] < len(self.streams):
                raise ResumeError(
                    f"mix: a record key is [epoch, source < {len(self.streams)}, ...], but got {brief(list(key))}"
                )
            sub = subs[key[1]]
            if sub is None:
                sub = subs[key[1]] = self.streams[key[1]].key_checker(sources[key[1]])
            sub((key[0], *key[2:]))

        return check

    def saved_slots(self, state: Mapping[str, Any]) -> list[Slot]:
        return [
            slot
            for stream, sub in zip(self.streams, self._sources_of(state), strict=True)
            for slot in stream.saved_slots(sub)
        ]

    def appends(self, state: Mapping[str, Any]) -> bool:
        return any(stream.appends(sub) for stream, sub in zip(self.streams, self._sources_of(state), strict=True))

    def reset(self, epoch: int, slot: Slot | None) -> None:
        self._epoch, self._draws, self._exhausted = epoch, 0, [False] * len(self.streams)
        for stream in self.streams:
            stream.reset(epoch, slot)

    def state_dict(self) -> dict[str, Any]:
        return self._state([s.state_dict() for s in self.streams])

    def state_update(self) -> dict[str, Any]:
        return self._state([s.state_update() for s in self.streams])

    def _state(self, sources: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            VERSION: STREAM_STATE_VERSION,
            EPOCH: self._epoch,
            SEED: self.seed,
            WEIGHTS: self.schedule.saved,
            DRAWS: self._draws,
            EXHAUSTED: list(self._exhausted),
            SOURCES: sources,
        }

    def apply_update(self, previous: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
        state = dict(update)
        state[SOURCES] = [
            stream.apply_update(p, u)
            for stream, p, u in zip(self.streams, previous[SOURCES], update[SOURCES], strict=True)
        ]
        return state

    def _sources_of(self, state: Mapping[str, Any]) -> list[Any]:
        sources = state.get(SOURCES)
        if not isinstance(sources, list) or len(sources) != len(self.streams):
            raise ResumeError(
                f"mix state field {SOURCES!r} must list {len(self.streams)} source states, got {brief(sources)}"
            )
        return sources

    def check(self, state: Any) -> Callable[[], None]:
        state = require_mapping(state, _WHAT)
        check_version(state, STREAM_STATE_VERSION, _WHAT)
        epoch = require_epoch(state, _WHAT)
        check_same(_WHAT, SEED, state.get(SEED), self.seed, "build the mix with the checkpoint's seed")
        check_same(
            _WHAT, WEIGHTS, state.get(WEIGHTS), self.schedule.saved, "build the mix with the checkpoint's weights"
        )
        draws = require_count(state, DRAWS, _WHAT)
        exhausted = state.get(EXHAUSTED)
        if (
            not isinstance(exhausted, list)
            or len(exhausted) != len(self.streams)
            or not all(isinstance(e, bool) for e in exhausted)
        ):
            raise ResumeError(
                f"mix state field {EXHAUSTED!r} must be {len(self.streams)} bools, got {brief(exhausted)}"
            )
        if draws < sum(exhausted):
            raise ResumeError(
                f"mix state has {sum(exhausted)} sources {EXHAUSTED} but only {draws} {DRAWS}: each source is found "
                "exhausted by a draw; pass a state_dict() of this pipeline unchanged"
            )
        sources = self._sources_of(state)
        applies = [s.check(sub) for s, sub in zip(self.streams, sources, strict=True)]
        for i, sub in enumerate(sources):
            sub_epoch = sub.get(EPOCH) if isinstance(sub, Mapping) else None
            if isinstance(sub_epoch, int) and sub_epoch != epoch:
                raise ResumeError(
                    f"mix state is in epoch {epoch} but source {i}'s state is in epoch {brief(sub_epoch)}; "
                    "pass a state_dict() of this pipeline unchanged"
                )
        # A source found exhausted that has records appended since (growth="append") runs again; the
        # draw that found it ended is taken back, so the draws less the exhausted sources still count
        # the records drawn (the schedule's place).
        reopened = [e and s.appends(sub) for e, s, sub in zip(exhausted, self.streams, sources, strict=True)]
        exhausted = [e and not r for e, r in zip(exhausted, reopened, strict=True)]
        draws -= sum(reopened)

        def apply() -> None:
            self._epoch, self._draws, self._exhausted = epoch, draws, list(exhausted)
            for apply_source in applies:
                apply_source()

        return apply

    def rebalance(
        self, states: Sequence[Mapping[str, Any]], num_slots: int, pending: list[Key]
    ) -> list[dict[str, Any]]:
        per_source = []
        for i, stream in enumerate(self.streams):
            routed = [(key[0], *key[2:]) for key in pending if key[1] == i]
            per_source.append(stream.rebalance([self._sources_of(s)[i] for s in states], num_slots, routed))
        # Each new slot goes on at the old slots' mean count of records drawn (its schedule's place).
        drawn = sum(s[DRAWS] - sum(s[EXHAUSTED]) for s in states) // len(states)
        return [
            {
                VERSION: STREAM_STATE_VERSION,
                EPOCH: states[0][EPOCH],
                SEED: self.seed,
                WEIGHTS: self.schedule.saved,
                DRAWS: drawn,
                EXHAUSTED: [False] * len(self.streams),
                SOURCES: [rebalanced[s] for rebalanced in per_source],
            }
            for s in range(num_slots)
        ]


def mix(streams: Sequence[Stream], weights: Weights | None = None, *, seed: int = 0) -> Mix:
    """Mix ``streams`` with ``weights`` (fixed, or a schedule); see :class:`Mix`."""
    return Mix(streams, weights, seed=seed)
