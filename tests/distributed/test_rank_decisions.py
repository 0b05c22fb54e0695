"""Decisions for a whole job: rank 0 decides once and every rank gets its answer or its failure, a
step that fails on any rank stops every rank naming each failure, and ``torchrun.init_process_group``
joins ranks on a fresh store; without a process group each is a plain call."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from resumable_data import ResumeError, torchrun
from resumable_data.distributed import decide_on_rank_zero, fail_together


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except ResumeError as e:
        return str(e)


def _decisions_main(rank: int, world_size: int, tmp: str, port: int) -> None:
    import torch.distributed as dist

    from dist_harness import finish

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torchrun.init_process_group(rank, world_size, device=torch.device("cpu"), timeout=datetime.timedelta(seconds=60))
    assert dist.get_backend() == "gloo" and dist.get_world_size() == world_size

    def locked() -> str:
        raise ResumeError("run folder is locked by pid 42")

    def unreadable() -> str:
        if rank == 1:
            raise ResumeError("sha256 mismatch")
        return "state"

    outcome = {
        "chosen": decide_on_rank_zero(lambda: f"step-0000000{8 + rank}"),
        "rank0_error": _outcome(lambda: decide_on_rank_zero(locked)),
        "read": fail_together("reading step-8", lambda: f"rank {rank}"),
        "unreadable": _outcome(lambda: fail_together("reading step-8", unreadable)),
    }
    finish(tmp, "decisions", rank, outcome)


def test_rank_zero_decides_once_and_any_rank_that_cannot_read_stops_every_rank(tmp_path: Path) -> None:
    from dist_harness import results, spawn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spawn(_decisions_main, 2, str(tmp_path), port)
    zero, one = results(tmp_path, "decisions", 2)
    assert zero["chosen"] == one["chosen"] == "step-00000008"
    assert zero["rank0_error"] == "run folder is locked by pid 42"
    assert one["rank0_error"] == "rank 0 stopped the job: run folder is locked by pid 42"
    assert [zero["read"], one["read"]] == ["rank 0", "rank 1"]
    for rank in (zero, one):
        assert rank["unreadable"] == "reading step-8 failed on 1 of 2 ranks, so the job stops: rank 1: sha256 mismatch"


def test_without_a_process_group_each_is_a_plain_call() -> None:
    assert decide_on_rank_zero(lambda: 3) == 3
    assert fail_together("reading", lambda: 4) == 4
    with pytest.raises(ValueError, match="bad"):
        fail_together("reading", lambda: int("bad"))
