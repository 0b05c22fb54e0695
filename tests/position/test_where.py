"""``where`` against the loader itself: the indices it names are the ones a restored loader yields.

The specification: for any map-style state (dataset size, batch size, world size, drop_last,
shuffle, how far the run got, across epochs),

* ``where(state, next=n)`` is, rank by rank, the next ``n`` batches of a loader restored from it;
* ``where(state, previous=n)`` is the uninterrupted run's last ``n`` batches before the state;
* ``where(state, step=s)`` is the uninterrupted run's batch number ``s``;
* ``where(state, positions=(a, b))`` names, for each position, the rank and sample that read it;
* ``locate(state, i)`` inverts it: for every sample of the epoch, the rank, batch and step that
  read it, each read (or padded) position once;

and at 10**9 samples every answer costs a few positions, not the dataset.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_data import ResumableDataLoader
from resumable_data.position import locate, where
from resumable_data.position.where import DROPPED, READ, UNREAD

EPOCHS = 3


class Indices(torch.utils.data.Dataset):
    """Sample ``i`` is ``i``, at any length (10**9 costs nothing)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


def loader(config: dict[str, Any], rank: int, **kwargs: Any) -> ResumableDataLoader:
    return ResumableDataLoader(
        Indices(config["length"]),
        batch_size=config["batch_size"],
        world_size=config["world"],
        rank=rank,
        shuffle=config["shuffle"],
        drop_last=config["drop_last"],
        seed=config["seed"],
        global_rng=None,
        **kwargs,
    )


def run(config: dict[str, Any], rank: int) -> list[tuple[int, list[int]]]:
    """The uninterrupted run of one rank: (epoch, indices) of every batch of EPOCHS epochs."""
    batches = loader(config, rank)
    return [(epoch, batch.tolist()) for epoch in batches.epochs(EPOCHS) for batch in batches]


def state_after(config: dict[str, Any], cut: int) -> dict[str, Any]:
    """The state of a run stopped after ``cut`` batches (every rank's is the same)."""
    batches = loader(config, 0)
    stream = ((epoch, batch) for epoch in batches.epochs(EPOCHS) for batch in batches)
    for _ in itertools.islice(stream, cut):
        pass
    return batches.state_dict()


def resumed(config: dict[str, Any], state: dict[str, Any], rank: int, n: int, workers: int) -> list[list[int]]:
    batches = loader(config, rank, num_workers=workers, timeout=60 if workers else 0)
    batches.load_state_dict(state)
    stream = (batch.tolist() for _ in batches.epochs(EPOCHS + 10) for batch in batches)
    return list(itertools.islice(stream, n))


configs = st.fixed_dictionaries(
    {
        "length": st.integers(1, 40),
        "batch_size": st.integers(1, 5),
        "world": st.integers(1, 3),
        "shuffle": st.booleans(),
        "drop_last": st.booleans(),
        "seed": st.integers(0, 2**32),
    }
)


@settings(max_examples=40)
@given(config=configs, cut_fraction=st.floats(0, 1), n=st.integers(1, 4))
def test_next_previous_and_step_are_the_batches_of_the_loader(
    config: dict[str, Any], cut_fraction: float, n: int
) -> None:
    runs = [run(config, rank) for rank in range(config["world"])]
    total = len(runs[0])
    cut = int(cut_fraction * total)
    state = state_after(config, cut)
    if total == 0:  # drop_last and fewer samples than one global batch: no batch, ever
        assert where(state, next=n).batches == []
        return
    answer = where(state, next=n)
    for rank in range(config["world"]):
        expected = resumed(config, state, rank, n, workers=0)
        assert [b.indices[rank] for b in answer.batches] == expected, f"next {n} batches of rank {rank}"
    assert all(b.status == UNREAD for b in answer.batches)
    # previous: the last n batches before the cut, of the state's epoch
    epoch = state["epoch"]
    before = [i for i, (e, _) in enumerate(runs[0][:cut]) if e == epoch][-n:]
    previous = where(state, previous=n)
    for rank in range(config["world"]):
        assert [b.indices[rank] for b in previous.batches] == [runs[rank][i][1] for i in before], "previous"
    assert all(b.status == READ for b in previous.batches)
    # step s of the run is the uninterrupted run's batch s
    for s in {0, min(cut, total - 1), total - 1}:
        batch = where(state, step=s).batches[0]
        assert [batch.indices[rank] for rank in range(config["world"])] == [r[s][1] for r in runs], f"step {s}"
        assert batch.status == (READ if s < cut else UNREAD)


@settings(max_examples=25)
@given(config=configs, cut_fraction=st.floats(0, 1))
def test_locate_finds_every_sample_of_the_epoch_where_the_loader_reads_it(
    config: dict[str, Any], cut_fraction: float
) -> None:
    world, size = config["world"], config["batch_size"]
    runs = [run(config, rank) for rank in range(world)]
    cut = int(cut_fraction * len(runs[0]))
    state = state_after(config, cut)
    epoch = state["epoch"]
    epoch_batches = [[b for e, b in r if e == epoch] for r in runs]
    first_step = next((i for i, (e, _) in enumerate(runs[0]) if e == epoch), 0)
    seen: list[tuple[int, int]] = []
    for sample in range(config["length"]):
        for found in locate(state, sample).samples:
            assert (found.sample, found.epoch, found.rank) == (sample, epoch, found.position % world)
            offset = found.position // world % size
            if found.status == DROPPED:
                assert found.batch >= len(epoch_batches[found.rank]) or offset >= len(
                    epoch_batches[found.rank][found.batch]
                )
                continue
            assert epoch_batches[found.rank][found.batch][offset] == sample, f"sample {sample} at {found}"
            assert found.step == first_step + found.batch
            assert found.status == (READ if found.position < state["position"] else UNREAD)
            seen.append((found.rank, found.position))
    # Every read position of the epoch, once: what the ranks read is exactly what locate names.
    read = sum(len(b) for r in epoch_batches for b in r)
    assert len(seen) == len(set(seen)) == read


@settings(max_examples=15)
@given(config=configs, cut_fraction=st.floats(0, 1), a=st.integers(0, 60), width=st.integers(1, 20))
def test_positions_name_the_rank_and_sample_that_read_each_position(
    config: dict[str, Any], cut_fraction: float, a: int, width: int
) -> None:
    world, size = config["world"], config["batch_size"]
    runs = [run(config, rank) for rank in range(world)]
    state = state_after(config, int(cut_fraction * len(runs[0])))
    epoch = state["epoch"]
    epoch_batches = [[b for e, b in r if e == epoch] for r in runs]
    end = config["length"] if config["drop_last"] else -(-config["length"] // world) * world  # with the padding
    a = min(a, end - 1)
    for row in where(state, positions=(a, min(end, a + width))).batches:
        ((rank, [sample]),) = row.indices.items()
        assert rank == row.start % world
        batch, offset = row.batch, row.start // world % size
        if batch < len(epoch_batches[rank]) and offset < len(epoch_batches[rank][batch]):
            assert epoch_batches[rank][batch][offset] == sample


def test_a_restore_with_workers_yields_what_where_names() -> None:
    config = {"length": 37, "batch_size": 3, "world": 2, "shuffle": True, "drop_last": False, "seed": 7}
    state = state_after(config, 4)
    answer = where(state, next=5)
    for rank in range(2):
        assert [b.indices[rank] for b in answer.batches] == resumed(config, state, rank, 5, workers=2)


def test_at_a_billion_samples_every_answer_costs_a_few_positions() -> None:
    config = {"length": 10**9, "batch_size": 1024, "world": 8, "shuffle": True, "drop_last": False, "seed": 1}
    position = 900_000_000 - 900_000_000 % (8 * 1024)
    state = loader(config, 0).state_dict() | {"epoch": 2, "position": position}
    started = time.perf_counter()
    nxt = where(state, next=2)
    previous = where(state, previous=2, rank=3)
    step = where(state, step=nxt.batches[0].step)
    sample = nxt.batches[1].indices[5][17]
    found = locate(state, sample).samples
    elapsed = time.perf_counter() - started
    assert elapsed < 5, f"where and locate at 10**9 samples took {elapsed:.2f}s"
    assert step.batches[0].indices == nxt.batches[0].indices
    assert [(f.rank, f.position) for f in found] == [(5, nxt.batches[1].start + 17 * 8 + 5)]
    assert previous.batches[-1].end == position
    # The loader itself, restored at that position, reads what where named.
    restored = loader(config, 5)
    restored.load_state_dict(state)
    batches = iter(restored)
    assert [next(batches).tolist() for _ in range(2)] == [b.indices[5] for b in nxt.batches]
    assert len(np.unique(nxt.batches[0].indices[0])) == 1024
