"""Run a function on W real processes joined in a gloo group, each with a deadline.

A hung collective must fail the test, not the CI job: every run has a timeout after which the
processes are killed, and every group has a collective timeout too.
"""

from __future__ import annotations

import datetime
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from trainer.config import TrainConfig

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


# The trainer's smallest run, for the trainer's tests (in one process, and under torchrun in
# tests/trainer/test_ddp_trainer.py and tests/distributed/test_torchrun_restarts.py): one layer,
# 20 steps, a checkpoint every 4.
TINY = dict(
    n_layer=1,
    n_head=2,
    n_embd=16,
    block_size=16,
    dropout=0.1,
    batch_size=4,
    max_steps=20,
    lr=1e-2,
    min_lr=1e-3,
    warmup_steps=3,
    eval_every=6,
    eval_batches=1,
    checkpoint_every=4,
    progress=False,
)


def tiny(base: Path, name: str, **overrides: Any) -> TrainConfig:
    """The TINY run in ``base/name``, training on 2,000 bytes of python source (``base/text.txt``)."""
    from trainer.config import TrainConfig  # here, so the library's own distributed tests need no trainer

    corpus = base / "text.txt"
    if not corpus.exists():
        corpus.write_bytes(Path(random.__file__).read_bytes()[:2000])
    return TrainConfig(
        run_dir=str(base / name), data=str(corpus), cache_dir=str(base / "cache"), **{**TINY, **overrides}
    )
