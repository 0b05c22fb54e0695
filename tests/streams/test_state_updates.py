"""The state a batch carries: what changed since the last batch, never the whole shuffle buffer.

``StreamLoader`` keeps each slot's state after every batch. A shuffle buffer's state lists every
buffered key, so it sends ``state_update()`` instead (the keys that entered since the last one),
and the loader rebuilds the state with ``apply_update``. The specification: applying each update
to the previous state gives exactly ``state_dict()``, at every batch of every pipeline shape
(filling, full, draining, epoch ends, repeat rounds, mixed sources); an update holds at most the
records read since the last one; and so a batch costs about the same with a buffer of 4096 as of 64.
"""

from __future__ import annotations

import copy
import itertools
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_data.streams import ShardedIterable, Stream, StreamLoader, TokenShardReader, mix
from streams_harness import MemoryShards, write_token_shards


def source(sizes: list[int], seed: int) -> ShardedIterable:
    shards = MemoryShards(sizes)
    return ShardedIterable(shards.names, read_shard=shards, seed=seed)


SHAPES = {
    "buffer": lambda sizes, buffer: source(sizes, 0).shuffle_buffer(buffer, seed=1),
    "buffer then map": lambda sizes, buffer: source(sizes, 0).shuffle_buffer(buffer, seed=1).map(lambda x: x + 1),
    "repeated buffer": lambda sizes, buffer: source(sizes, 0).shuffle_buffer(buffer, seed=1).repeat(2),
    "nested buffers": lambda sizes, buffer: source(sizes, 0).shuffle_buffer(buffer).shuffle_buffer(buffer + 1),
    "buffer then pack": lambda sizes, buffer: (
        source(sizes, 0).map(lambda x: [x] * (x % 3 + 1)).shuffle_buffer(buffer, seed=1).pack(2, eos=0)
    ),
    "mixed buffers": lambda sizes, buffer: mix(
        [source(sizes, 0).shuffle_buffer(buffer), source(sizes[::-1], 1)], seed=2
    ).shuffle_buffer(buffer, seed=3),
}


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from(sorted(SHAPES)),
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    buffer=st.integers(1, 8),
    batch=st.integers(1, 5),
    epochs=st.integers(1, 2),
)
def test_each_update_applied_to_the_previous_state_is_the_state(shape, sizes, buffer, batch, epochs) -> None:
    stream: Stream = SHAPES[shape](sizes, buffer).batch(batch)
    for epoch in range(epochs):
        stream.set_epoch(epoch)
        state = copy.deepcopy(stream.state_dict())
        stream.state_update()  # the reset's state is the base of the next update
        for _ in stream:
            update = stream.state_update()
            state = stream.apply_update(state, copy.deepcopy(update))
            assert state == stream.state_dict()
            entered = update["source"].get("entered")
            if entered is not None and shape == "buffer":
                assert len(entered) <= batch + buffer  # the records read for this batch, at most


def test_a_restored_buffer_sends_updates_relative_to_the_restored_state() -> None:
    def make() -> Stream:
        return source([7, 5, 9], 0).shuffle_buffer(6, seed=1).batch(2)

    stream = make()
    batches = iter(stream)
    for _ in range(3):
        next(batches)
    restored = make()
    restored.load_state_dict(stream.state_dict())
    state = copy.deepcopy(restored.state_dict())
    for _ in restored:
        update = restored.state_update()
        assert "buffer" not in update["source"]  # a change, not the whole list
        state = restored.apply_update(state, update)
        assert state == restored.state_dict()


def _seconds_per_epoch(paths: list[Path], buffer: int) -> float:
    stream = ShardedIterable(paths, read_shard=TokenShardReader(2), seed=0).shuffle_buffer(buffer, seed=0)
    loader = StreamLoader(stream, batch_size=32)
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def test_a_batch_costs_the_same_with_a_large_buffer(tmp_path: Path) -> None:
    # 16 shards x 500 windows of 2 tokens. Before state updates a 4096-record buffer cost ~15x
    # the 64-record one (its whole key list was rebuilt after every batch); now the difference is
    # the fill and the drain. Best of two runs each, interleaved.
    paths = write_token_shards(tmp_path, [1000] * 16)
    small, large = [], []
    for _ in range(2):
        small.append(_seconds_per_epoch(paths, 64))
        large.append(_seconds_per_epoch(paths, 4096))
    assert min(large) < 4 * min(small), (small, large)


# What the caller does after a batch of a 0-worker loader: nothing, save (with or without the
# batch it holds taken back, in either order), or stop and iterate again.
NOTHING, SAVE, TAKE_BACK, BOTH, STOP = range(5)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from(sorted(SHAPES)),
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    buffer=st.integers(1, 24),
    batch=st.integers(1, 4),
    actions=st.lists(st.integers(NOTHING, STOP), min_size=1, max_size=60),
)
def test_a_0_worker_loader_reads_its_state_from_the_pipeline_and_takes_a_batch_back_exactly(
    shape, sizes, buffer, batch, actions
) -> None:
    """With 0 workers the loader applies no update per batch: it reads the state from its pipeline
    and keeps the updates, refreshing its copy from the pipeline once they hold more than it.
    Whatever the caller does between batches, ``state_dict()`` is the state after the batch just
    handed out and ``state_dict(unconsumed=1)`` the state before it, as a reference loader that
    saved after every batch recorded them; small buffers refresh every few batches, large ones
    take back through a long run of updates."""

    def make() -> StreamLoader:
        return StreamLoader(SHAPES[shape](sizes, buffer), batch_size=batch)

    reference, recorded, ends = make(), [], []  # per epoch: the states at its start and after each batch; at its end
    for epoch in range(2):
        reference.set_epoch(epoch)
        recorded.append([reference.state_dict()])
        for _ in reference:
            recorded[epoch].append(reference.state_dict())
        ends.append(reference.state_dict())
    loader, act = make(), itertools.cycle(actions)
    for epoch in range(2):
        states, handed_out, stopped = recorded[epoch], 0, True
        while stopped:
            loader.set_epoch(epoch)  # (again after a stop: the epoch goes on where it stopped)
            stopped = False
            for _ in loader:
                handed_out += 1
                action = next(act)
                if action in (SAVE, BOTH):
                    assert loader.state_dict() == states[handed_out]
                if action in (TAKE_BACK, BOTH):
                    assert loader.state_dict(unconsumed=1) == states[handed_out - 1]
                if action == STOP:
                    stopped = True
                    break
            if stopped:
                assert loader.state_dict() == states[handed_out]  # settled: read from the pipeline
        assert handed_out == len(states) - 1
        assert loader.state_dict() == ends[epoch]
