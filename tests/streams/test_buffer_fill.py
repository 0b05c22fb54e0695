"""A shuffle buffer over a ShardedIterable with known sizes fills with keys, not records.

Specifications: at an epoch's start (and at a restore to it) the buffer takes the keys of the
source's next ``size`` records from its position, and reads each record when a draw picks it, as a
restore re-reads its keys: the first batch costs the records of about 64 draws, not ``size``
reads. Everything yielded, and every state (identities of the shards being read included), equals
what filling the buffer by reading the records in order gives; a reader without ``read_records``,
a source with records pending from a layout change, or one without sizes still fills by reading.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_resumes_identically
from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader
from streams_harness import MemoryShards, ids, write_token_shards

WINDOW = 4  # 250 windows per shard of 1000 tokens


class InOrderTokenReader:
    """A TokenShardReader without ``read_records``: its shards can only be read in order (from a
    start), so a shuffle buffer over it fills by reading. Counts the records it hands out."""

    def __init__(self, window: int) -> None:
        self.reader = TokenShardReader(window)
        self.read = 0

    def __call__(self, shard: Any, start: int) -> Iterator[torch.Tensor]:
        for record in self.reader(shard, start):
            self.read += 1
            yield record

    def identity(self, shard: Any) -> str:
        return self.reader.identity(shard)


class CountingTokenReader(InOrderTokenReader):
    """The same, with ``read_records`` (records read by offset count too)."""

    def read_records(self, shard: Any, offsets: Sequence[int]) -> list[torch.Tensor]:
        self.read += len(offsets)
        return self.reader.read_records(shard, offsets)


class MemoryRecords(MemoryShards):
    """In-memory shards that can also be read by offset."""

    def read_records(self, shard: str, offsets: Sequence[int]) -> list[int]:
        return [self.records[shard][o] for o in offsets]


def token_loader(paths: list[Path], reader: InOrderTokenReader, size: int, **kwargs: Any) -> StreamLoader:
    source = ShardedIterable(paths, read_shard=reader, seed=2, sizes=[250] * len(paths))
    return StreamLoader(source.shuffle_buffer(size, seed=5), batch_size=8, **kwargs)


def run(loader: StreamLoader, epochs: int) -> tuple[list[int], list[str]]:
    """Record ids of ``epochs`` epochs and the JSON state after each batch."""
    seen, states = [], []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            seen += ids([batch])
            states.append(json.dumps(loader.state_dict(), sort_keys=True))
    return seen, states


def test_a_fresh_epoch_reads_about_a_batch_of_draws_before_its_first_batch(tmp_path: Path) -> None:
    paths = write_token_shards(tmp_path, [1000] * 8)  # 2,000 records
    reader = CountingTokenReader(WINDOW)
    loader = token_loader(paths, reader, 1000)
    next(iter(loader))
    # The records of the first 64 draws (at most 64 slots) and the 8 that entered the buffer.
    assert 0 < reader.read <= 64 + 8
    sequential = InOrderTokenReader(WINDOW)
    next(iter(token_loader(paths, sequential, 1000)))
    assert sequential.read == 1000 + 8


def test_a_restore_at_an_epoch_start_reads_about_a_batch_of_draws(tmp_path: Path) -> None:
    paths = write_token_shards(tmp_path, [1000] * 8)
    state = json.loads(json.dumps(token_loader(paths, CountingTokenReader(WINDOW), 1000).state_dict()))
    reader = CountingTokenReader(WINDOW)
    restored = token_loader(paths, reader, 1000)
    restored.load_state_dict(state)
    first = next(iter(restored))
    assert 0 < reader.read <= 64 + 8
    assert torch.equal(first, next(iter(token_loader(paths, InOrderTokenReader(WINDOW), 1000))))


@pytest.mark.parametrize(
    ("size", "workers"),
    [(1, 0), (100, 0), (249, 0), (250, 0), (1000, 0), (3000, 0), (300, 2)],  # within a shard, at its end, past the data
)
def test_the_stream_and_its_states_equal_a_fill_by_reading(tmp_path: Path, size: int, workers: int) -> None:
    paths = write_token_shards(tmp_path, [1000] * 8)
    by_key = run(token_loader(paths, CountingTokenReader(WINDOW), size, num_workers=workers), 2)
    by_reading = run(token_loader(paths, InOrderTokenReader(WINDOW), size, num_workers=workers), 2)
    assert by_key == by_reading
    assert sorted(by_key[0][:2000]) == [s * 1000 + j for s in range(8) for j in range(0, 1000, WINDOW)]


def test_a_resumed_stream_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    paths = write_token_shards(tmp_path, [1000] * 8)
    cuts = [0, 0, 1, 3, 125, 130, 250, 251]  # batches: the start, several in a row, epoch end, next epoch
    assert_resumes_identically(lambda: token_loader(paths, CountingTokenReader(WINDOW), 300), cuts, epochs=2)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=8),
    size=st.integers(1, 40),
    world=st.integers(1, 3),
    seed=st.integers(0, 3),
)
def test_in_memory_shards_of_any_sizes_equal_a_fill_by_reading(
    sizes: list[int], size: int, world: int, seed: int
) -> None:
    memory = MemoryRecords(sizes)
    in_order = MemoryShards(sizes)  # no read_records: fills by reading
    for rank in range(world):
        streams = [
            ShardedIterable(shards.names, read_shard=shards, seed=seed, sizes=sizes).shuffle_buffer(size, seed=seed)
            for shards in (memory, in_order)
        ]
        runs = []
        for stream in streams:
            loader = StreamLoader(stream, batch_size=3, rank=rank, world_size=world)
            runs.append(run(loader, 2))
        assert runs[0] == runs[1]


def test_records_pending_from_a_layout_change_are_read_first(tmp_path: Path) -> None:
    """After a layout change the buffer's records come back as the new slots' pending records: the
    buffer fills by reading them, and every record of the epoch is still read exactly once."""
    memory = MemoryRecords([20] * 6)

    def make(rank: int, world: int) -> StreamLoader:
        source = ShardedIterable(memory.names, read_shard=memory, seed=1, sizes=[20] * 6)
        return StreamLoader(source.shuffle_buffer(16, seed=3), batch_size=4, rank=rank, world_size=world)

    old = [make(r, 2) for r in range(2)]
    seen = [i for loader in old for i in ids(list(itertools.islice(iter(loader), 5)))]
    merged = json.loads(json.dumps(StreamLoader.merge_states([loader.state_dict() for loader in old])))
    for rank in range(3):
        new = make(rank, 3)
        new.load_state_dict(merged)
        seen += ids(list(new))
    assert sorted(seen) == sorted(memory.all_records())
