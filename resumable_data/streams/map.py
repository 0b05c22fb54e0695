"""Map: apply a function to every record, optionally with a per-record random generator."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..core.hash import hash_ints
from ..core.state import SEED, check_int_arg
from ..rng.sample import sample_generator
from .base import Key, Stream, check_same, record_key
from .epoch_positions import EpochPositions
from .positional import PassThrough, Positional
from .record_rngs import RECORD, check_record_rng, per_record_salt, seeded_call
from .wrapper import Wrapper

__all__ = ["Map"]


class Map(Wrapper):
    """``fn(record)``; with ``seed`` set, ``fn(record, generator)`` where the generator is
    ``sample_generator(seed, epoch, hash_ints(*where))`` for the record key ``(epoch, *where)``.

    The generator depends only on the record's identity (shard, offset, epoch), so augmentation is
    bitwise the same after any resume, with any number of workers, and in any order.
    Stateless itself: its state is its source's (plus the seed, checked on load).

    Without ``seed``, ``fn`` may draw from the global RNGs, which :class:`StreamLoader` seeds per
    batch. Below a stage that reads records again (``pack``, ``shuffle_buffer``,
    ``batch_by_tokens``, ``shuffle_window``) they are seeded per record instead, from its key, and
    put back after the call: a record read again after a restore is mapped as it was the first
    time (see ``record_rngs``; ``benchmarks/bench_record_rngs.py`` measures what it costs per record).
    ``global_rng=None`` promises that ``fn`` draws nothing from the global RNGs (a tokenizer before
    ``pack``): the seeding is skipped; a function that does draw then resumes with other draws.

    Example::

        noisy = stream.map(lambda x, g: x + torch.randn(x.shape, generator=g), seed=0)
        noisy.load_state_dict(saved)  # the next record gets the same noise as before
    """

    in_order = True

    def __init__(
        self, source: Stream, fn: Callable[..., Any], *, seed: int | None = None, global_rng: str | None = RECORD
    ) -> None:
        super().__init__(source)
        self.global_rng = check_record_rng("map", global_rng)
        if seed is not None:
            check_int_arg("seed", seed, minimum=-(2**63))
            if not source.keyed:
                raise TypeError("map(seed=...) needs records with an identity; apply it before batch()")
        self.fn = fn
        self.seed = seed
        self._salt: int | None = None  # set below a re-reading stage: fn runs under per-record global RNGs

    def expect_rereads(self, branch: tuple[int, ...] = ()) -> None:
        if self.seed is None and self.global_rng is not None:
            self._salt = per_record_salt(self.depth, branch)
        super().expect_rereads(branch)

    def _call(self, key: Key | None, value: Any) -> Any:
        if self.seed is None:
            if self._salt is not None:
                return seeded_call(self._salt, record_key(key, "map"), self.fn, value)
            return self.fn(value)
        key = record_key(key, "map(seed=...)")
        generator: torch.Generator = sample_generator(self.seed, key[0], hash_ints(*key[1:]))
        return self.fn(value, generator)

    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        if self.seed is None and self._salt is None:  # the per-record path of most pipelines: no call in between
            fn = self.fn
            for key, value in self.source.iter_keyed():
                yield key, fn(value)
            return
        for key, value in self.source.iter_keyed():
            yield key, self._call(key, value)

    def positional(self) -> Positional | None:
        # The source's keys, order and position are this stage's: a positional source stays one,
        # its records fetched through fetch_many below (the function applied as on a re-read).
        inner = self.source.positional()
        return None if inner is None else PassThrough(self, inner)

    def upcoming_keys(self, count: int) -> list[Key] | None:
        return self.source.upcoming_keys(count)  # the source's keys, in its order

    def epoch_positions(self) -> EpochPositions | None:
        return self.source.epoch_positions()  # the source's keys at the source's positions

    def fetch(self, key: Key) -> Any:
        return self._call(key, self.source.fetch(key))

    def fetch_many(self, keys: Sequence[Key]) -> list[Any]:
        return [self._call(key, value) for key, value in zip(keys, self.source.fetch_many(keys), strict=True)]

    def _own_state(self) -> dict[str, Any]:
        return {SEED: self.seed}

    _own_state_fresh = _own_state

    def _check_own(self, state: Mapping[str, Any]) -> Callable[[], None]:
        check_same("map", SEED, state.get(SEED), self.seed, "build the map with the checkpoint's seed")
        return lambda: None
