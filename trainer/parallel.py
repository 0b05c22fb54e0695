"""A single process, DDP or FSDP2: what the loop does differently in each, behind :class:`Parallel`.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) the trainer joins a process group,
gloo on CPU or NCCL on CUDA (``resumable_data.torchrun.init_process_group``); the base class is a
single process, where nothing talks to anyone.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from resumable_data import torchrun

T = TypeVar("T")
# Long enough for a slow checkpoint write on rank 0 while the others wait, short enough that a
# hung job ends by itself.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class Parallel:
    """This process's place in the job and what depends on it; this base class is a single process."""

    distributed = False

    def __init__(self, device: torch.device, rank: int = 0, world_size: int = 1) -> None:
        self.device, self.rank, self.world_size = device, rank, world_size

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes checkpoints and metrics."""
        return self.rank == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model as the loop calls it (the plain model is what checkpoints save)."""
        return model

    def gradient_sync(self, wrapped: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-batch's forward and backward: all-reduce gradients only if ``sync`` (the last)."""
        return contextlib.nullcontext()

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """A plain tensor of the whole value (FSDP's gradient norm is a DTensor)."""
        return tensor

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` averaged over the ranks (one all-reduce)."""
        return values

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value``, indexed by rank, on every rank."""
        return [value]

    def close(self, *, clean: bool) -> None:
        """Leave the process group, if any (``clean``: every rank got here normally)."""


class _ProcessGroup(Parallel):
    """A rank of a torchrun job: the collectives of :class:`Parallel` over the default process group."""

    distributed = True

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        values = values.clone()
        dist.all_reduce(values)
        return values / self.world_size

    def gather(self, value: T) -> list[T]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def close(self, *, clean: bool) -> None:
        # A gloo group's C++ threads live as long as anything holds the group, and the DDP model
        # (in a reference cycle torch's state-dict helpers leave) does. Freed at interpreter exit,
        # a thread dies in pthread_exit and aborts a finished run ("terminate called without an
        # active exception"): collect the cycles and destroy the group while Python is alive. The
        # barrier keeps a rank from leaving while another is in a collective; after an error the
        # others may be anywhere, and it would wait for the whole collective timeout.
        if not dist.is_initialized():
            return
        gc.collect()
        if clean:
            dist.barrier()
        dist.destroy_process_group()


class DataParallel(_ProcessGroup):
    """DDP: every rank holds the whole model; gradients are averaged in the backward."""

    def wrap(self, model: nn.Module) -> nn.Module:
        # The model has no buffers, so a DDP forward runs no collective (evaluation uses the bare model).
        return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def gradient_sync(self, wrapped: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if sync else wrapped.no_sync()  # type: ignore[operator]


class FullyShardedParallel(_ProcessGroup):
    """FSDP2 (``fully_shard``): every rank holds a shard of each block's parameters and optimizer state."""

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)  # the embedding, tied to the output head, stays in the root group
        return model

    def gradient_sync(self, wrapped: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        wrapped.set_requires_gradient_sync(sync)  # type: ignore[operator]
        return contextlib.nullcontext()

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def start(device_name: str, fsdp: bool = False) -> Parallel:
    """Join torchrun's process group if there is one; pick this rank's device.

    Raises:
        ValueError: CUDA was asked for but is missing, there are fewer GPUs than local ranks, or
            ``fsdp`` outside torchrun.
    """
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if fsdp and not under_torchrun:
        raise ValueError(
            "--fsdp shards the model over the ranks of a torchrun job; start it with torchrun --nproc_per_node N"
        )
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device_name}: CUDA is not available on this machine")
        if under_torchrun and device.index is None:
            if local_rank >= torch.cuda.device_count():
                raise ValueError(f"local rank {local_rank} has no GPU: this machine has {torch.cuda.device_count()}")
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not under_torchrun:
        return Parallel(device)
    torchrun.init_process_group(rank, world_size, device=device, timeout=COLLECTIVE_TIMEOUT)
    return (FullyShardedParallel if fsdp else DataParallel)(device, rank, world_size)
