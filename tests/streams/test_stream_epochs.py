"""A pipeline's set_epoch follows the loaders' rule: ``set_epoch(e)`` is a full pass of epoch ``e``,
also after that epoch was exhausted or broken off (a validation pipeline iterated each evaluation),
and keeps only a pending restore's position."""

from __future__ import annotations

import itertools

from resumable_data.streams import ShardedIterable
from streams_harness import MemoryShards


def pipeline() -> ShardedIterable:
    shards = MemoryShards((5, 7, 3))
    return ShardedIterable(shards.names, read_shard=shards, seed=3)


def test_set_epoch_of_an_exhausted_or_broken_off_epoch_is_a_full_pass_of_it() -> None:
    stream = pipeline()
    stream.set_epoch(0)
    full = list(stream)
    stream.set_epoch(0)  # on main: a no-op, and this pass was empty
    assert list(stream) == full
    stream.set_epoch(0)
    list(itertools.islice(stream, 4))
    stream.set_epoch(0)
    assert list(stream) == full


def test_set_epoch_of_the_restored_epoch_keeps_the_restored_position() -> None:
    stream = pipeline()
    stream.set_epoch(1)
    head = list(itertools.islice(stream, 6))
    state = stream.state_dict()
    rest = list(stream)
    restored = pipeline()
    restored.load_state_dict(state)
    restored.set_epoch(1)
    assert list(restored) == rest
    reference = pipeline()
    reference.set_epoch(1)
    assert head + rest == list(reference)
