"""torchrun restarts that work, and ranks that do not outlive their agent.

Restarts (``torchrun --max-restarts``). With the c10d rendezvous, torchrun (2.13) hands every
round of workers the *same* TCPStore, hosted by the agent, without a per-round prefix. A restarted
rank then finds the previous round's keys, among them the dead ranks' gloo addresses: when it reads
a peer's key before that peer has rewritten it, ``init_process_group`` connects to a process that
is gone ("Gloo connectFullMesh failed ... Connection refused", or a hang for the whole timeout).
:func:`fresh_store` first agrees with the other ranks on a namespace no earlier round used (a
handshake with its own short timeout, so a missing peer is an error in minutes at most, not after
the collective timeout) and returns the store under it, for ``init_process_group(store=...)``.

Orphans. A rank whose parent (the torchrun agent) dies is not told: it would train on, holding the
run folder's lock. :func:`watch_parent` runs a watchdog thread that polls ``os.getppid()`` and exits
the process when the parent is gone (the portable route: a parent-death signal needs ``prctl``,
which the standard library does not expose). DataLoader workers already watch their own parent the same way.

:func:`init_process_group` does both for a rank of a torchrun job: it starts the watchdog under an
elastic agent and joins the default process group on a fresh store.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
import uuid

import torch
import torch.distributed as dist

__all__ = ["EXIT_PARENT_GONE", "STARTUP_TIMEOUT", "fresh_store", "init_process_group", "watch_parent"]

STARTUP_TIMEOUT = datetime.timedelta(seconds=180)
"""How long the ranks of a new round wait for each other. A peer that dies is noticed by torchrun
within seconds (it stops the round); this bounds one that hangs, and must exceed the start-up skew
of importing torch on a busy machine."""
# How often the watchdog looks for its parent.
PARENT_POLL_S = 0.5
EXIT_PARENT_GONE = 3
"""The exit code of a rank whose parent (the torchrun agent) died."""
# Keys of the start-up handshake in torchrun's store (the namespace's own keys live under its token).
_LEADER_KEY = "resumable_data/round/leader"
_RETRY = datetime.timedelta(milliseconds=500)
_PREFIX = "resumable_data"


def fresh_store(rank: int, world_size: int, *, timeout: datetime.timedelta = STARTUP_TIMEOUT) -> dist.Store:
    """The store of ``MASTER_ADDR:MASTER_PORT`` under a prefix that only this round's ranks know.

    Rank 0 publishes a new random token under a fixed key; every other rank reads it, checks in
    under it with a nonce of its own, and waits for rank 0's answer under that nonce. A token left
    by an earlier round gets no answer (its rank 0 is dead), so the rank reads the key again until
    the new rank 0 has written it. Rank 0 answers only check-ins under its own token, so nobody
    joins a dead round.

    Use it as ``init_process_group(backend, store=fresh_store(rank, world_size), rank=rank,
    world_size=world_size)`` in a script started by torchrun.

    Raises:
        RuntimeError: A rank did not show up within ``timeout`` (names the rank).
    """
    # With torchrun's agent store every worker is a client; otherwise rank 0 hosts it, as env:// does.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_store,
        timeout=timeout,
    )
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(_LEADER_KEY, token)
        for peer in range(1, world_size):
            left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            try:
                store.wait([f"{token}/joined/{peer}"], left)
            except RuntimeError as e:  # the store's timeout error (DistStoreError is a RuntimeError)
                raise RuntimeError(
                    f"rank {peer} did not join within {timeout.total_seconds():.0f} s of start-up; "
                    "it died or never started (see its log)"
                ) from e
            store.set(f"answer/{store.get(f'{token}/joined/{peer}').decode()}", token)
        return dist.PrefixStore(f"{_PREFIX}/{token}/", store)
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
                    f"rank 0 did not answer rank {rank} within {timeout.total_seconds():.0f} s of start-up; "
                    "it died or never started (see its log)"
                ) from None
    return dist.PrefixStore(f"{_PREFIX}/{store.get(f'answer/{nonce}').decode()}/", store)


def watch_parent(poll_s: float = PARENT_POLL_S, exit_code: int = EXIT_PARENT_GONE) -> threading.Thread:
    """Exit this process (code ``exit_code``) within ``poll_s`` of its parent's death.

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
        os._exit(exit_code)

    thread = threading.Thread(target=watch, name="parent-watchdog", daemon=True)
    thread.start()
    return thread


def init_process_group(rank: int, world_size: int, *, device: torch.device, timeout: datetime.timedelta) -> None:
    """Join the default process group of a torchrun job: gloo on CPU, NCCL on CUDA, on :func:`fresh_store`.

    Under torchrun's elastic agent (``TORCHELASTIC_RUN_ID`` set) it first starts :func:`watch_parent`,
    so a rank does not train on, holding the run folder's lock, after its agent died. Nothing is done
    when the default group already exists.

    Args:
        rank: this process's rank (torchrun's ``RANK``).
        world_size: the number of ranks (torchrun's ``WORLD_SIZE``).
        device: this rank's device; a CUDA device selects NCCL and binds the group to it.
        timeout: the collectives' timeout.

    Raises:
        RuntimeError: a rank did not show up at start-up (see :func:`fresh_store`).

    Example::

        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_process_group(rank, world_size, device=torch.device("cpu"), timeout=datetime.timedelta(minutes=10))
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        watch_parent()
    if dist.is_initialized():
        return
    cuda = device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=fresh_store(rank, world_size),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if cuda else None,
    )
