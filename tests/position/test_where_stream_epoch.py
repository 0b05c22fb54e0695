"""``where_stream(previous=n)`` and ``where_stream(step=s)`` against the StreamLoader itself.

The specification: for a StreamLoader state over a positional pipeline (a ShardedIterable with known
sizes, behind ``map`` and ``shuffle_window``), any shard sizes, batch size, window size, drop_last,
0 or 2 workers, 1 or 2 ranks and interruption point,

* ``previous=n`` is, rank by rank, the ``(shard, record)`` of every record of the last ``n`` batches
  the uninterrupted loader yielded in the state's epoch, each ``read``;
* ``step=s`` is each rank's ``s``-th batch of the uninterrupted run (earlier epochs counted in
  full), in an earlier epoch, the state's or a later one, ``read`` before the state and ``unread`` after;
* both read no record, at any position of an epoch of 10**7 records;
* a state whose epoch changed layout at a resume is refused for both (its positions before the
  change were other slots'), the error saying that ``next`` still answers;
* a state that does not fit the pipeline (another batch size) is refused, not answered wrongly.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_where_stream import CONFIGS, WIDE, Reader, build, keys_of, loader, states_after

from resumable_data.position import skip_stream_state, where_stream
from resumable_data.streams import StreamLoader


def uninterrupted(
    config: dict[str, Any], rank: int, world: int, workers: int, epochs: int
) -> list[list[list[tuple[str, int]]]]:
    """Rank ``rank``'s batches (as keys) in each of the first ``epochs`` epochs of an uninterrupted run."""
    each = loader(config, rank, world, workers)
    return [[keys_of(batch, config) for batch in each] for _ in range(epochs)]


def done_of(state: dict[str, Any], rank: int) -> int:
    local = max(1, state["num_workers"])
    return sum(state["batches"][str(g)] for g in range(rank * local, (rank + 1) * local))


def check(config: dict[str, Any], world: int, workers: int, steps: int, n: int, step: int) -> None:
    states = states_after(config, world, workers, steps)
    epochs = max(state["epoch"] for state in states) + 3
    runs = [uninterrupted(config, r, world, workers, epochs) for r in range(world)]
    for rank, state in enumerate(states):
        epoch, done = state["epoch"], done_of(state, rank)
        kwargs = {"batch_size": config["batch_size"], "drop_last": config["drop_last"]}
        before = where_stream(state, build(config), previous=n, **kwargs)
        expected = runs[rank][epoch][max(0, done - n) : done]
        assert [b.records for b in before.batches] == expected
        assert {b.status for b in before.batches} <= {"read"}
        assert [b.batch for b in before.batches] == list(range(max(0, done - n), done))
        flat = [(e, j, keys) for e, batches in enumerate(runs[rank]) for j, keys in enumerate(batches)]
        if step < len(flat):
            (answer,) = where_stream(state, build(config), step=step, **kwargs).batches
            e, j, keys = flat[step]
            assert (answer.epoch, answer.batch, answer.records, answer.step) == (e, j, keys, step)
            read = (e, j) < (epoch, done)
            assert answer.status == ("read" if read else "unread")


@settings(max_examples=100, deadline=None)
@given(
    config=CONFIGS,
    world=st.sampled_from([1, 2]),
    steps=st.integers(0, 30),
    n=st.integers(1, 8),
    step=st.integers(0, 60),
)
def test_previous_and_step_name_the_records_the_uninterrupted_loader_yielded(config, world, steps, n, step):
    check(config, world, 0, steps, n, step)


@pytest.mark.slow  # worker processes; the default suite has the deterministic cases below
@settings(max_examples=25, deadline=None)
@given(config=CONFIGS, world=st.sampled_from([1, 2]), steps=st.integers(0, 12), n=st.integers(1, 6))
def test_previous_and_step_with_two_workers(config, world, steps, n):
    check(config, world, 2, steps, n, steps + n)


@pytest.mark.parametrize("steps", [1, 4, 9])
def test_two_workers_previous_batches_alternate_between_the_slots(steps):
    check(WIDE, 2, 2, steps, 5, steps + 2)


def test_a_state_deep_in_an_epoch_of_ten_million_records_is_answered_without_reading():
    # Rank 1 of 2, 60,000 batches (3.84 million records) into its epoch of 5 * 10**6: the batches
    # before the state (previous) and at a step are computed from the positions, equal to the next
    # batches of a state two batches earlier (computed another way: upcoming_keys), reading nothing.
    sizes = [1_000_000] * 10
    config = {"sizes": sizes, "batch_size": 64, "window": 10_000, "map": "below", "drop_last": False, "seed": 3}
    start = StreamLoader.merge_states([loader(config, r, 2, 0).state_dict() for r in range(2)])
    deep = 60_000
    counted = Reader(sizes)
    pipeline = build(config, counted)
    began = time.perf_counter()
    earlier = skip_stream_state(start, pipeline, batches=deep - 2, batch_size=64)
    state = skip_stream_state(start, pipeline, batches=deep, batch_size=64)
    coming = where_stream(earlier, pipeline, batch_size=64, next=2, rank=1).batches
    before = where_stream(state, pipeline, batch_size=64, previous=2, rank=1).batches
    (at,) = where_stream(state, pipeline, batch_size=64, step=deep - 1, rank=1).batches
    elapsed = time.perf_counter() - began
    assert counted.calls == 0
    assert elapsed < 3.0, f"{elapsed:.2f} s: the answers must not grow with the position"
    assert [b.batch for b in before] == [deep - 2, deep - 1] == [b.batch for b in coming]
    assert [b.records for b in before] == [b.records for b in coming]
    assert at.records == before[1].records and {b.status for b in before} == {"skipped"}
