"""A user's data-parallel job over token shards in object storage, used by tests/remote/test_torchrun_cache.py.

    python -m torch.distributed.run --nproc_per_node=2 torchrun_stream.py DATA OUT CACHE [--workers N] [--kill-at N]

Every rank joins a gloo group and reads the shards that ``write_token_shards`` put at DATA (a URL
or a folder; credentials and endpoint from the environment, as s3fs takes them) through one
node-local cache folder CACHE, shared by both ranks and all their DataLoader workers. Windows are
shuffled by ``shuffle_window`` and batched by a ``StreamLoader`` that takes its rank and world size
from the group, for 2 epochs. Every few batches each rank saves its loader state under
``OUT/step-N/``; once all ranks have saved (a barrier), rank 0 names that step in ``OUT/latest``,
so a checkpoint is either whole or not used. A relaunch resumes from the latest one. Each rank logs
its batches' records (the first token of each window) to ``OUT/batches.rank<R>.jsonl``.

``--kill-at N``: after its N-th batch rank 0 SIGKILLs the whole job (the other ranks with their
workers, the torchrun agent, then itself), as when the machine is lost.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader

WINDOW = 256
DTYPE = np.uint32
BATCH = 8
EPOCHS = 2
CHECKPOINT_EVERY = 5  # batches


def make_loader(
    data: str, workers: int, cache_dir: str | None = None, *, rank: int | None = None, world_size: int | None = None
) -> StreamLoader:
    """The job's loader (rank and world size from the process group unless given)."""
    reader = TokenShardReader(WINDOW, dtype=DTYPE, cache_dir=cache_dir)
    windows = ShardedIterable.from_index(data, read_shard=reader, seed=7).shuffle_window(10, seed=8)
    return StreamLoader(windows, batch_size=BATCH, num_workers=workers, rank=rank, world_size=world_size, timeout=60)


def save(state: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    with open(tmp, "rb") as file:
        os.fsync(file.fileno())
    os.replace(tmp, path)


def kill_job(pids: list[int]) -> None:
    """SIGKILL every rank's process group (torchrun starts each rank in a session of its own, with its
    DataLoader workers), the agent first, this rank last."""
    os.kill(os.getppid(), signal.SIGKILL)
    for pid in sorted(pids, key=lambda pid: pid == os.getpid()):
        os.killpg(pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data", help="the shards' folder or URL (holding index.json)")
    parser.add_argument("out", type=Path)
    parser.add_argument("cache", help="the node-local shard cache folder")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=0, help="rank 0 SIGKILLs the job after that batch (0: never)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pids: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        (args.out / "pids").write_text(" ".join(map(str, pids)))  # for the test's cleanup

    loader = make_loader(args.data, args.workers, args.cache)
    latest = args.out / "latest"
    done = 0
    if latest.exists():
        done = int(latest.read_text())
        loader.load_state_dict(torch.load(args.out / f"step-{done}" / f"rank{rank}.pt", weights_only=True))

    with open(args.out / f"batches.rank{rank}.jsonl", "a") as log:
        for epoch in loader.epochs(EPOCHS):
            for batch in loader:
                done += 1
                log.write(json.dumps({"batch": done, "epoch": epoch, "records": batch[:, 0].tolist()}) + "\n")
                log.flush()
                if done % CHECKPOINT_EVERY == 0:
                    save(loader.state_dict(), args.out / f"step-{done}" / f"rank{rank}.pt")
                    dist.barrier()  # every rank's state is on disk: the step is whole
                    if rank == 0:
                        (args.out / "latest.tmp").write_text(str(done))
                        os.replace(args.out / "latest.tmp", latest)
                if rank == 0 and done == args.kill_at:
                    os.fsync(log.fileno())
                    kill_job(pids)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
