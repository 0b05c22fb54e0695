"""Under torch.distributed, ResumableDataLoader takes rank and world size from the process group,
and the ranks of a real 2-process (gloo) group partition the epoch and agree on the state."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from resumable_data import ResumableDataLoader

LENGTH, BATCH = 37, 4


def _rank_main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        loader = ResumableDataLoader(torch.arange(LENGTH), batch_size=BATCH, seed=5)
        iterator = iter(loader)
        head = [next(iterator).tolist() for _ in range(2)]
        state = loader.state_dict()
        # Every rank's state must be the same, so that any of them can be checkpointed.
        states: list[dict] = [{} for _ in range(world_size)]
        dist.all_gather_object(states, state)
        resumed = ResumableDataLoader(torch.arange(LENGTH), batch_size=BATCH, seed=5)
        resumed.load_state_dict(states[(rank + 1) % world_size])  # another rank's state
        tail = [b.tolist() for b in resumed]
        result = {
            "rank": loader.sampler.rank,
            "world_size": loader.sampler.world_size,
            "same_states": all(s == state for s in states),
            "indices": head + tail,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_ranks_come_from_the_process_group_and_partition_the_epoch(tmp_path: Path) -> None:
    world_size = 2
    mp.spawn(_rank_main, args=(world_size, str(tmp_path / "init"), str(tmp_path)), nprocs=world_size, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]
    assert all(r["same_states"] for r in results)
    counts = collections.Counter(i for r in results for batch in r["indices"] for i in batch)
    assert set(counts) == set(range(LENGTH))
    assert sum(counts.values()) == LENGTH + 1  # one padded repeat: 37 samples over 2 ranks


def _shared_data_main(rank: int, world_size: int, tmp: str) -> None:
    """Two ranks that are tensor-parallel peers: each is alone in its data-parallel group."""
    from dist_harness import finish, init_gloo
    from resumable_data import ShardedIterable, StreamLoader
    from resumable_data.distributed import DataLoaderState, global_state
    from streams_harness import MemoryShards

    init_gloo(rank, world_size, f"{tmp}/init_shared")
    dp_group, _ = dist.new_subgroups(group_size=1)
    loader = ResumableDataLoader(torch.arange(LENGTH), batch_size=BATCH, seed=5, group=dp_group)
    shards = MemoryShards((4, 6, 3))
    stream = StreamLoader(ShardedIterable(shards.names, read_shard=shards, seed=5), batch_size=2, group=dp_group)
    batches = [b.tolist() for b in loader]
    records = [b.tolist() for b in stream]
    # The DP group's state: no collective over the peer, and DCP writes it once for both.
    states = [global_state(loader, group=dp_group), DataLoaderState(stream, group=dp_group).state_dict()]
    finish(tmp, "shared", rank, {"batches": batches, "records": records, "states": states})


def test_ranks_that_share_a_data_parallel_rank_get_identical_batches(tmp_path: Path) -> None:
    from dist_harness import results, spawn

    spawn(_shared_data_main, 2, str(tmp_path))
    first, second = results(tmp_path, "shared", 2)
    assert first == second
    assert sorted(i for batch in first["batches"] for i in batch) == list(range(LENGTH))  # one rank's worth: all
    assert first["states"][0]["world_size"] == 1
