"""One global data state under real gloo groups, checkpointed with torch.distributed.checkpoint.

A chain of four jobs (real processes, each with a deadline) shares one set of DCP checkpoints:

* **A** (2 ranks) reads 2 batches of a map-style loader and of a stream loader, saves with
  ``dcp.save`` and ``dcp.async_save``, then keeps reading to the end of the next epoch (the
  uninterrupted reference);
* **B** (3 ranks) loads A's checkpoint (2→3), reads 1 batch, saves again, reads on;
* **C** (1 rank) loads A's checkpoint (2→1) and reads on;
* **D** (2 ranks) loads A's checkpoint at the same size (bitwise the reference) and B's (3→2).

The tests below state what each job's records must show.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dist_harness import finish, init_gloo, results, spawn
from resumable_data import ResumableDataLoader, ResumeError, ShardedIterable, StreamLoader
from resumable_data.distributed import DataLoaderState, dcp_errors, global_state
from streams_harness import MemoryShards

LENGTH, BATCH, SEED = 36, 3, 11
SHARD_SIZES = (5, 7, 3, 8, 6, 4, 9, 2)
STREAM_BATCH = 2
SAVED_AFTER = 2  # batches each rank reads in job A before saving
EPOCHS = 2


def make_map() -> ResumableDataLoader:
    return ResumableDataLoader(torch.arange(LENGTH), batch_size=BATCH, seed=SEED)


def make_stream() -> StreamLoader:
    shards = MemoryShards(SHARD_SIZES)
    return StreamLoader(ShardedIterable(shards.names, read_shard=shards, seed=SEED), batch_size=STREAM_BATCH)


def read(loader: Any, *, stop: int | None = None, epochs: int = EPOCHS) -> dict[int, list[int]]:
    """A training loop from the loader's current epoch; ids read per epoch, stopped after ``stop`` batches."""
    out: dict[int, list[int]] = {}
    taken = 0
    # epochs() continues an epoch a previous call broke off (a set_epoch would start it over).
    for epoch in loader.epochs(epochs):
        for batch in loader:
            out.setdefault(epoch, []).extend(batch.tolist())
            taken += 1
            if taken == stop:
                return out
    return out


def app_state(map_loader: Any, stream_loader: Any, **kwargs: Any) -> dict[str, DataLoaderState]:
    return {"map": DataLoaderState(map_loader, **kwargs), "stream": DataLoaderState(stream_loader, **kwargs)}


def _job_a(rank: int, world: int, tmp: str) -> None:
    init_gloo(rank, world, f"{tmp}/init_a")
    loader, stream = make_map(), make_stream()
    head = {"map": read(loader, stop=SAVED_AFTER), "stream": read(stream, stop=SAVED_AFTER)}
    at_save = {"map": global_state(loader), "stream": global_state(stream)}
    dcp.save(app_state(loader, stream), checkpoint_id=f"{tmp}/ckpt_a")
    # A value that differs per rank under one shared key: DCP keeps one rank's copy.
    dcp.save({"value": torch.tensor([100 + rank])}, checkpoint_id=f"{tmp}/ckpt_shared_key")
    # What peers do: one key per rank. It saves, but cannot load at another world size.
    dcp.save({"loader": {f"dp_rank_{rank}": torch.tensor([rank])}}, checkpoint_id=f"{tmp}/ckpt_per_rank")
    # async_save snapshots the state at the call; the loaders move on while it writes.
    ckpt_group = dist.new_group(backend="gloo")
    future = dcp.async_save(
        app_state(loader, stream, group=None), checkpoint_id=f"{tmp}/ckpt_async", process_group=ckpt_group
    )
    rest = {"map": read(loader), "stream": read(stream)}
    future.result()
    fresh_map, fresh_stream = make_map(), make_stream()
    dcp.load(app_state(fresh_map, fresh_stream), checkpoint_id=f"{tmp}/ckpt_async")
    from_async = {"map": global_state(fresh_map), "stream": global_state(fresh_stream)}

    # A rank one batch ahead of the others: its state must be refused on every rank.
    lagging = make_map()
    read(lagging, stop=1 + rank)
    try:
        global_state(lagging)
        refused = None
    except ResumeError as e:
        refused = str(e)
    finish(
        tmp, "a", rank, {"head": head, "rest": rest, "at_save": at_save, "from_async": from_async, "refused": refused}
    )


def _job_resume(rank: int, world: int, tmp: str, name: str, source: str, save_after: int | None) -> None:
    """Load ``source`` at this world size; optionally save again after ``save_after`` map batches."""
    init_gloo(rank, world, f"{tmp}/init_{name}")
    loader, stream = make_map(), make_stream()
    dcp.load(app_state(loader, stream), checkpoint_id=f"{tmp}/{source}")
    result: dict[str, Any] = {}
    if save_after is not None:
        result["middle"] = read(loader, stop=save_after)
        dcp.save({"map": DataLoaderState(loader)}, checkpoint_id=f"{tmp}/ckpt_{name}")
    result["rest"] = {"map": read(loader), "stream": read(stream)}
    strict = make_map()
    try:
        dcp.load({"map": DataLoaderState(strict, allow_world_size_change=False)}, checkpoint_id=f"{tmp}/{source}")
        result["strict"] = None
    except ResumeError as e:
        result["strict"] = str(e)
    try:
        with dcp_errors("load", f"{tmp}/ckpt_per_rank"):
            dcp.load(
                {"loader": {f"dp_rank_{rank}": torch.zeros(1, dtype=torch.long)}}, checkpoint_id=f"{tmp}/ckpt_per_rank"
            )
        result["per_rank_keys"] = None
    except ResumeError as e:
        result["per_rank_keys"] = str(e)
    if name == "d":
        shared = {"value": torch.zeros(1, dtype=torch.long)}
        dcp.load(shared, checkpoint_id=f"{tmp}/ckpt_shared_key")
        result["shared_key"] = shared["value"].item()
    if name == "d":  # 3→2: B's checkpoint, taken one batch after B resumed
        from_b = make_map()
        dcp.load({"map": DataLoaderState(from_b)}, checkpoint_id=f"{tmp}/ckpt_b")
        result["rest_from_b"] = read(from_b)
    finish(tmp, name, rank, result)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    tmp = str(tmp_path_factory.mktemp("dcp_chain"))
    spawn(_job_a, 2, tmp)
    spawn(_job_resume, 3, tmp, "b", "ckpt_a", 1)
    spawn(_job_resume, 1, tmp, "c", "ckpt_a", None)
    spawn(_job_resume, 2, tmp, "d", "ckpt_a", None)
    return {name: results(tmp, name, world) for name, world in (("a", 2), ("b", 3), ("c", 1), ("d", 2))}


def ids(per_rank: list[dict[str, list[int]]], epoch: int) -> collections.Counter[int]:
    """Every id read in ``epoch`` by all ranks together, with multiplicity."""
    return collections.Counter(i for part in per_rank for i in part.get(str(epoch), []))


def assert_exactly_once(
    parts: list[dict[str, list[int]]], everything: set[int], epoch: int, *, padding: int = 0
) -> None:
    """Every id once, plus ``padding`` repeats (DistributedSampler-style padding of an uneven tail)."""
    counts = ids(parts, epoch)
    assert set(counts) == everything, (
        f"missing {sorted(everything - set(counts))}, extra {sorted(set(counts) - everything)}"
    )
    repeated = sorted(i for i, n in counts.items() for _ in range(n - 1))
    assert len(repeated) == padding, f"read more than once: {repeated}, expected {padding} padding repeats"


MAP_IDS = set(range(LENGTH))
STREAM_IDS = set(MemoryShards(SHARD_SIZES).all_records())


def test_ranks_agree_on_one_global_state_and_disagreeing_ranks_are_refused(chain: dict[str, list[Any]]) -> None:
    a = chain["a"]
    assert a[0]["at_save"] == a[1]["at_save"]  # the same global state on every rank
    assert sorted(a[0]["at_save"]["stream"]["slots"]) == ["0", "1"]  # both ranks' slots, merged
    for rank in a:
        assert "ranks [1] differ from rank 0" in rank["refused"]
        assert "position: rank 0 has 6, rank 1 has 12" in rank["refused"]


def test_same_world_size_resume_is_bitwise_identical(chain: dict[str, list[Any]]) -> None:
    # D loaded A's checkpoint on 2 ranks: every rank reads exactly what A read after the save,
    # through the end of the epoch and the whole next epoch.
    for rank in range(2):
        assert chain["d"][rank]["rest"] == chain["a"][rank]["rest"]
        assert list(chain["a"][rank]["rest"]["map"]) == ["0", "1"]  # across the epoch boundary


def test_async_save_keeps_the_position_at_call_time(chain: dict[str, list[Any]]) -> None:
    for rank in chain["a"]:
        assert rank["from_async"] == rank["at_save"]
        assert rank["at_save"]["map"]["position"] == SAVED_AFTER * BATCH * 2


@pytest.mark.parametrize(("job", "kind"), [("b", "map"), ("c", "map"), ("b", "stream"), ("c", "stream")])
def test_world_size_change_reads_the_rest_of_the_epoch_exactly_once(
    chain: dict[str, list[Any]], job: str, kind: str
) -> None:
    """2→3 (B) and 2→1 (C): A's head plus the new ranks' rest cover epoch 0 once; epoch 1 is complete."""
    everything = MAP_IDS if kind == "map" else STREAM_IDS
    head = [r["head"][kind] for r in chain["a"]]
    middle = [r.get("middle", {}) for r in chain[job]] if kind == "map" else []
    rest = [r["rest"][kind] for r in chain[job]]
    assert_exactly_once(head + middle + rest, everything, 0)
    assert_exactly_once(rest, everything, 1)


def test_three_to_two_reads_the_rest_of_the_epoch_exactly_once(chain: dict[str, list[Any]]) -> None:
    head = [r["head"]["map"] for r in chain["a"]]
    middle = [r["middle"] for r in chain["b"]]
    rest = [r["rest_from_b"] for r in chain["d"]]
    # 2 batches on 2 ranks and 1 on 3 leave 36 - 12 - 9 = 15 samples for 2 ranks: one padded repeat.
    assert_exactly_once(head + middle + rest, MAP_IDS, 0, padding=1)
    assert_exactly_once(rest, MAP_IDS, 1)


def test_a_job_that_refuses_a_world_size_change_names_both_sizes(chain: dict[str, list[Any]]) -> None:
    assert chain["d"][0]["strict"] is None  # same size: accepted
    for job, size in (("b", 3), ("c", 1)):
        message = chain[job][0]["strict"]
        assert message.startswith(
            f"world size changed: the checkpoint was written by 2 data-parallel ranks, this job has {size}"
        )


def test_per_rank_keys_fail_at_another_world_size_with_a_clear_error(chain: dict[str, list[Any]]) -> None:
    """Why the state sits under fixed keys: a ``dp_rank_i`` key is missing when a new rank asks for it.

    DCP raises ``CheckpointException`` (a BaseException); ``dcp_errors`` makes it a ResumeError
    that names the action, the path and each failing rank.
    """
    assert chain["d"][0]["per_rank_keys"] is None  # same world size: every key exists
    for rank in chain["b"]:
        assert "torch.distributed.checkpoint could not load" in rank["per_rank_keys"]
        assert "rank 2:" in rank["per_rank_keys"] and "dp_rank_2" in rank["per_rank_keys"]


def test_dcp_keeps_one_ranks_copy_of_a_shared_key_so_values_must_agree(chain: dict[str, list[Any]]) -> None:
    """Why the data state must be the same on every rank: rank 0 saved 100 and rank 1 saved 101
    under one key, and both ranks load the same single value back."""
    values = [rank["shared_key"] for rank in chain["d"]]
    assert values[0] == values[1] and values[0] in (100, 101)
