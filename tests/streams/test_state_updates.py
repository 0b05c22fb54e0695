"""The state a batch carries: what changed since the last batch, never the whole shuffle buffer.

``StreamLoader`` keeps each slot's state after every batch. A shuffle buffer's state lists every
buffered key, so it sends ``state_update()`` instead (the keys that entered since the last one),
and the loader rebuilds the state with ``apply_update``. The specification: applying each update
to the previous state gives exactly ``state_dict()``, at every batch of every pipeline shape
(filling, full, draining, epoch ends, repeat rounds, mixed sources); an update holds at most the
records read since the last one; and so an epoch lists the buffer's keys in proportion to the records it
reads, not to its batches times the buffer size (the time per batch is measured in benchmarks/).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_data.streams import ShardedIterable, ShuffleBuffer, Stream, StreamLoader, mix
from streams_harness import MemoryShards


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


class _CountingBuffer(ShuffleBuffer):
    """A shuffle buffer that counts the keys it lists when asked for its whole state."""

    listed = 0

    def _own_state(self) -> dict[str, Any]:
        state = super()._own_state()
        self.listed += len(state["buffer"])
        return state


@pytest.mark.parametrize("size", [64, 4096])
def test_an_epoch_lists_the_buffer_in_proportion_to_its_records_not_its_batches(size: int) -> None:
    """What made a large buffer slow was listing its keys after every batch (500 batches x 4096
    keys here). Now an epoch lists at most about one key per record it reads, whatever the buffer
    size: a 0-worker loader keeps each batch's update and lists the buffer only when the kept
    updates outgrow that listing. (With workers the buffer sends updates, never its list: the
    first test above bounds what each holds.)"""
    shards = MemoryShards([1000] * 16)
    buffer = _CountingBuffer(ShardedIterable(shards.names, read_shard=shards, seed=0), size, seed=1)
    loader = StreamLoader(buffer, batch_size=32)
    records = sum(len(batch) for batch in loader)
    loader.state_dict()  # one checkpoint at the end lists the buffer once more
    assert records == 16_000
    assert buffer.listed <= records + size, buffer.listed


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
        loader.set_epoch(epoch)
        while stopped:  # a new iter() after a stop goes on where the loader stopped
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
                if handed_out == len(states) - 1:
                    break  # stopped on the epoch's last batch: a new iter() would start the next epoch
        assert handed_out == len(states) - 1
        if not stopped:
            assert loader.state_dict() == ends[epoch]
