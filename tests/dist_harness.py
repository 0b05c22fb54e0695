"""Run a function on W real processes joined in a gloo group, each with a deadline.

A hung collective must fail the test, not the CI job: every run has a timeout after which the
processes are killed, and every group has a collective timeout too.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def spawn(fn: Callable[..., None], world_size: int, *args: Any, timeout: float = 90.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; kill them at ``timeout``.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (the others are terminated).
        TimeoutError: not all ranks finished in time.
    """
    context = mp.start_processes(fn, args=(world_size, *args), nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world_size} ranks did not finish in {timeout:.0f} s")


def init_gloo(rank: int, world_size: int, init_file: str) -> None:
    """Join a gloo group through a rendezvous file (one fresh file per run)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )


def finish(out_dir: str | Path, name: str, rank: int, result: Any) -> None:
    """Write this rank's result as JSON, then leave the group in a clean order (barrier, destroy)."""
    Path(out_dir, f"{name}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def results(out_dir: str | Path, name: str, world_size: int) -> list[Any]:
    """Every rank's result of a run, by rank."""
    return [json.loads(Path(out_dir, f"{name}.rank{r}.json").read_text()) for r in range(world_size)]
