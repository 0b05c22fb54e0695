"""The trainer under torchrun: the process group, decisions made once on rank 0, and elastic plans.

``python -m trainer`` started by ``torchrun`` finds ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in its
environment and joins a process group (gloo on CPU, NCCL on CUDA). Without them it is a single
process and nothing here talks to anyone.

Restarts (``torchrun --max-restarts``). With the c10d rendezvous, torchrun (2.13) hands every
round of workers the *same* TCPStore, hosted by the agent, without a per-round prefix (its comment
says a new store is made for every retry; it is not). A restarted rank then finds the previous
round's keys, among them the dead ranks' gloo addresses: when it reads a peer's key before that
peer has rewritten it, ``init_process_group`` connects to a process that is gone ("Gloo
connectFullMesh failed ... Connection refused" or "Connect timeout", after the whole timeout).
:func:`start` therefore first agrees with the other ranks on a namespace no earlier round used
(:func:`_fresh_namespace`, a handshake with a short timeout: a missing peer is an error in
seconds), and builds the process group in it.

Orphans. A rank whose parent (the torchrun agent) dies is not told: it would train on, holding the
run folder's lock. :func:`start` runs a watchdog thread that polls ``os.getppid()`` and exits the
process when the parent is gone; its DataLoader workers follow within seconds (they watch their
own parent the same way).
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from resumable_data import ResumeError

__all__ = ["ElasticPlan", "Parallel", "elastic_plan", "rank_seed", "start", "stop", "watch_parent"]

T = TypeVar("T")
ELASTIC_POLICIES = ("per-rank-batch", "global-batch", "refuse")
# Long enough for a slow checkpoint write on rank 0 while the others wait, short enough that a
# hung job ends by itself.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# How long the ranks of a new round wait for each other before the process group is built. A peer
# that dies is noticed by torchrun within seconds (it stops the round); this bounds one that hangs,
# and must exceed start-up skew: importing torch took over 60 s on our loaded 2-core machine.
STARTUP_TIMEOUT = datetime.timedelta(seconds=180)
# How often the watchdog looks for its parent, and the exit code of a rank whose parent died.
PARENT_POLL_S = 0.5
EXIT_PARENT_GONE = 3
# Keys of the start-up handshake in torchrun's store (the namespace's own keys live under its token).
_LEADER_KEY = "trainer/round/leader"
_RETRY = datetime.timedelta(milliseconds=500)


@dataclass(frozen=True)
class Parallel:
    """Where this process stands: its rank, the world size, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    distributed: bool

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes checkpoints and metrics."""
        return self.rank == 0

    def decide(self, choose: Callable[[], T]) -> T:
        """Run ``choose`` on rank 0 only and give every rank its result (or its error).

        An error on rank 0 (a ``ResumeError`` or ``ValueError``: a locked run folder, a corrupt
        checkpoint) is raised on every rank, so no rank waits forever for the others.
        """
        if not self.distributed:
            return choose()
        box: list[Any] = [None]
        failure: Exception | None = None
        if self.is_main:
            try:
                box[0] = ("ok", choose())
            except (ResumeError, ValueError) as e:
                failure, box[0] = e, ("error", str(e))
        dist.broadcast_object_list(box, src=0)
        if failure is not None:
            raise failure
        if box[0][0] == "error":
            raise ResumeError(f"rank 0 stopped the job: {box[0][1]}")
        return box[0][1]

    def all_or_none(self, error: Exception | None, what: str) -> None:
        """Stop every rank when any rank failed ``what`` (a collective), naming each failure.

        In a single process the error is raised as it is.
        """
        if not self.distributed:
            if error is not None:
                raise error
            return
        errors: list[str | None] = [None] * self.world_size
        dist.all_gather_object(errors, None if error is None else str(error))
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
        if failed:
            raise ResumeError(
                f"{what} failed on {len(failed)} of {self.world_size} ranks, so the job stops: {'; '.join(failed)}"
            )

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value``, indexed by rank (on every rank)."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def step_sync(self, loss_sum: torch.Tensor, stop: bool) -> tuple[float, bool]:
        """One all-reduce per step: the mean loss over ranks, and whether any rank was told to stop.

        A SIGTERM that reaches only one rank thus stops all of them after the same step, and the
        checkpoint written then holds every rank's state of that step.
        """
        if not self.distributed:
            return loss_sum.item(), stop
        both = torch.stack(
            [loss_sum.detach().double(), torch.tensor(float(stop), dtype=torch.float64, device=loss_sum.device)]
        )
        dist.all_reduce(both)
        return both[0].item() / self.world_size, both[1].item() > 0


def start(device_name: str) -> Parallel:
    """Join torchrun's process group if there is one; pick this rank's device.

    Raises:
        ValueError: CUDA was asked for but is missing, or there are fewer GPUs than local ranks.
    """
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
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
    if under_torchrun and "TORCHELASTIC_RUN_ID" in os.environ:
        watch_parent()
    if under_torchrun and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=_fresh_namespace(rank, world_size),
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
            device_id=device if device.type == "cuda" else None,
        )
    return Parallel(rank, world_size, local_rank, device, under_torchrun)


def _fresh_namespace(rank: int, world_size: int) -> dist.Store:
    """The store of ``MASTER_ADDR:MASTER_PORT`` under a prefix that only this round's ranks know.

    Rank 0 publishes a new random token under a fixed key; every other rank reads it, checks in
    under it with a nonce of its own, and waits for rank 0's answer under that nonce. A token left
    by an earlier round gets no answer (its rank 0 is dead), so the rank reads the key again until
    the new rank 0 has written it. Rank 0 answers only check-ins under its own token, so nobody
    joins a dead round.

    Raises:
        RuntimeError: A rank did not show up within ``STARTUP_TIMEOUT`` (names the ranks).
    """
    # With torchrun's agent store every worker is a client; otherwise rank 0 hosts it, as env:// does.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_store,
        timeout=STARTUP_TIMEOUT,
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(_LEADER_KEY, token)
        for peer in range(1, world_size):
            left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            try:
                store.wait([f"{token}/joined/{peer}"], left)
            except RuntimeError as e:  # the store's timeout error (DistStoreError is a RuntimeError)
                raise RuntimeError(
                    f"rank {peer} did not join within {STARTUP_TIMEOUT.total_seconds():.0f} s of start-up; "
                    "it died or never started (see its log)"
                ) from e
            store.set(f"answer/{store.get(f'{token}/joined/{peer}').decode()}", token)
        return dist.PrefixStore(f"trainer/{token}/", store)
    nonce = uuid.uuid4().hex
    while True:
        try:
            store.wait([_LEADER_KEY], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            store.set(f"{store.get(_LEADER_KEY).decode()}/joined/{rank}", nonce)
            store.wait([f"answer/{nonce}"], _RETRY)
            break
        except RuntimeError:  # the store's timeout error (DistStoreError is a RuntimeError)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank 0 did not answer rank {rank} within {STARTUP_TIMEOUT.total_seconds():.0f} s of start-up; "
                    "it died or never started (see its log)"
                ) from None
    return dist.PrefixStore(f"trainer/{store.get(f'answer/{nonce}').decode()}/", store)


def watch_parent(poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """Exit this process (code ``EXIT_PARENT_GONE``) within ``poll_s`` of its parent's death.

    The portable route to a parent-death signal: a daemon thread compares ``os.getppid()`` with
    the parent at the call (an orphan is re-parented to init or a subreaper). The exit skips
    clean-up on purpose: the peers are being torn down too, and every checkpoint on disk is either
    complete or a ``.tmp-*`` leftover that the next start removes; the kernel drops the run
    folder's lock with the process.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(f"error: the parent process {parent} (the torchrun agent) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_PARENT_GONE)

    thread = threading.Thread(target=watch, name="parent-watchdog", daemon=True)
    thread.start()
    return thread


def stop(parallel: Parallel, *, clean: bool) -> None:
    """Leave the process group so that it is really gone, with its threads, before Python exits.

    A gloo group owns C++ worker threads, and everything that holds it keeps it (and them) alive:
    ``destroy_process_group`` only drops the registry's reference. The DDP reducer holds one, and
    the DDP model outlives the training frame: torch's state-dict helpers (``get_state_dict``,
    called at every checkpoint) leave it in a reference cycle that only the cyclic garbage
    collector frees. Freed at interpreter exit instead, the group joins a worker thread that
    still has to take the GIL to release its last tensors; a finalizing interpreter ends that
    thread with ``pthread_exit``, whose unwinding through C++ ``noexcept`` code aborts the
    process (``terminate called without an active exception``, exit -6) after a run that
    finished. So: collect those cycles first, then destroy every group while the interpreter is
    fully alive; the destroy joins the worker threads.

    Args:
        parallel: this process's place in the job.
        clean: every rank got here normally (training ended or stopped on a signal, on all ranks
            at the same step). Only then do the ranks first wait for each other in a barrier, so
            no rank closes its connections while another is still in a collective; after an
            error the other ranks may be anywhere, and a barrier could wait for them for the
            whole collective timeout.
    """
    if not (parallel.distributed and dist.is_initialized()):
        return
    gc.collect()
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def rank_seed(seed: int, rank: int, step: int | None = None) -> int:
    """A seed for rank ``rank``'s RNGs: different per rank (dropout masks differ across ranks),
    and, for a rank that did not exist when the checkpoint at ``step`` was written, derived from
    ``(seed, step, rank)`` so an elastic resume is still reproducible."""
    text = f"{seed}:{rank}" if step is None else f"{seed}:{step}:{rank}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


@dataclass(frozen=True)
class ElasticPlan:
    """Per-rank batch and gradient accumulation after a resume, and what changed."""

    batch_size: int
    grad_accum: int
    changes: dict[str, list[int]]

    def describe(self) -> str:
        if not self.changes:
            return "same world size: nothing changed"
        return ", ".join(f"{name} {old} -> {new}" for name, (old, new) in self.changes.items())


def elastic_plan(
    *,
    policy: str,
    saved_world: int,
    saved_batch: int,
    saved_accum: int,
    world: int,
    batch: int,
    accum: int,
) -> ElasticPlan:
    """Decide the batch layout for a resume on ``world`` ranks of a checkpoint written on ``saved_world``.

    Policies:
        ``per-rank-batch``: keep ``--batch-size`` and ``--grad-accum``; the global batch scales
            with the number of ranks (so does the data an optimizer step sees).
        ``global-batch``: keep the global batch (``world * batch * grad_accum`` sequences per
            step) by changing gradient accumulation; refused when it does not divide.
        ``refuse``: a different number of ranks is an error naming both.

    Raises:
        ResumeError: an unknown policy, or a global batch that the new ranks cannot split.
    """
    if policy not in ELASTIC_POLICIES:
        raise ResumeError(f"--elastic should be one of {ELASTIC_POLICIES}, but got {policy!r}")
    changes: dict[str, list[int]] = {}
    if world != saved_world:
        if policy == "refuse":
            raise ResumeError(
                f"world size changed: the checkpoint was written by {saved_world} ranks, this job has {world} "
                f"(--elastic refuse); start it with torchrun --nproc_per_node {saved_world}, or allow the change with "
                "--elastic per-rank-batch or --elastic global-batch"
            )
        changes["world_size"] = [saved_world, world]
        if policy == "global-batch":
            total = saved_world * saved_batch * saved_accum
            if total % (world * batch):
                raise ResumeError(
                    f"--elastic global-batch: the checkpoint's global batch of {total} sequences ({saved_world} ranks x "
                    f"--batch-size {saved_batch} x --grad-accum {saved_accum}) cannot be split over {world} ranks of "
                    f"--batch-size {batch}; pick a --batch-size or a number of ranks that divides it, or resume with "
                    "--elastic per-rank-batch (the global batch then becomes "
                    f"{world * batch * accum})"
                )
            accum = total // (world * batch)
    for name, old, new in (("batch_size", saved_batch, batch), ("grad_accum", saved_accum, accum)):
        if old != new:
            changes[name] = [old, new]
    if changes:
        changes["global_batch"] = [saved_world * saved_batch * saved_accum, world * batch * accum]
    return ElasticPlan(batch, accum, changes)
