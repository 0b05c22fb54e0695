"""The trainer under torchrun: data-parallel on 2 gloo ranks, resumed bitwise, and elastic.

Every job is a real ``torchrun`` with a timeout. One ``verify-resume --nproc 2`` run (uninterrupted,
SIGKILLed, resumed; then elastic 2→1 and 2→3) is the reference the other tests compare with: the
checkpoint format does not change training, so a DCP run must produce the very same losses.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.trainer_runs import end_weights, losses, tiny
from resumable_data import CheckpointManager, ResumeError
from resumable_data.testing import assert_same
from system import index_log
from system.killpoints import ENTRY as KILLPOINTS_ENTRY
from system.verify import child_env, config_to_argv, verify_resume
from trainer.checkpointing import CHECKPOINT_FOLDER, DCP_FOLDER
from trainer.config import TrainConfig
from trainer.metrics import read_metrics
from trainer.train_state import elastic_plan

JOB_TIMEOUT = 120
KILL_AT = 15


def torchrun(
    config: TrainConfig, nproc: int, *, wait: bool = True, log_indices: bool = False
) -> subprocess.Popen[bytes] | int:
    """``torchrun -m trainer train``; with ``log_indices`` every rank logs its batch indices to
    RUN_DIR (``system.index_log``, installed from outside the trainer by ``system.killpoints``)."""
    entry = KILLPOINTS_ENTRY if log_indices else ("-m", "trainer")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *entry,
        "train",
        *config_to_argv(config),
    ]
    env = child_env()
    if log_indices:
        env[index_log.ENV] = config.run_dir
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(config.run_dir) / f"torchrun-{nproc}.log", "ab") as log:  # the child keeps its own copy
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if not wait:
        return process
    try:
        return process.wait(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


@pytest.fixture(scope="module")
def verified(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bool]:
    base = tmp_path_factory.mktemp("ddp")
    ok = verify_resume(tiny(base, "verify"), KILL_AT, nproc=2)
    return base, ok


# Five torchrun jobs (72 s of one test process on CI's 2 cores, where the suite reached 309 s): slow.
# The default suite keeps the library's DCP state on 2 torchrun ranks (test_distributed_dcp.py), DDP
# teardown on 2 gloo ranks and the single-process trainer killed and resumed (test_trainer.py).
@pytest.mark.slow
def test_torchrun_two_ranks_killed_and_resumed_equals_uninterrupted_and_elastic_reads_exactly_once(
    verified: tuple[Path, bool], capsys: pytest.CaptureFixture[str]
) -> None:
    """``verify-resume --nproc 2``: the same-size resume is bitwise (every step's loss, final model
    and optimizer, both ranks' weights) across the epoch boundary (14 steps per epoch), and the
    elastic resumes on 1 and 3 ranks read the rest of the epoch exactly once."""
    base, ok = verified
    out = capsys.readouterr().out
    assert ok, out
    straight = base / "verify" / "uninterrupted"
    weights = end_weights(str(straight))
    assert len(weights) == 2 and weights[0] == weights[1]  # DDP ranks end with identical weights
    assert {e["epoch"] for e in read_metrics(straight) if e["event"] == "step"} == {0, 1}
    # The log says what changed.
    one = [e for e in read_metrics(base / "verify" / "elastic-1") if e["event"] == "resume"][-1]
    assert one["changes"] == {"world_size": [2, 1], "grad_accum": [1, 2], "global_batch": [8, 8]}
    three = [e for e in read_metrics(base / "verify" / "elastic-3") if e["event"] == "resume"][-1]
    assert three["changes"] == {"world_size": [2, 3], "global_batch": [8, 12]}
    assert three["rng"] == "ranks 2..2 seeded from (seed, step, rank)"


@pytest.mark.slow  # 3 more torchrun jobs; the default suite has DCP at the library level (test_distributed_dcp.py)
def test_dcp_checkpoints_resume_bitwise_at_the_same_size_and_load_at_another(verified: tuple[Path, bool]) -> None:
    """``--checkpoint-format dcp-async`` on 2 ranks: stopped at step 9 and resumed equals the
    file-format reference exactly; the same DCP checkpoint resumes on 1 rank (exactly once)."""
    base, _ = verified
    reference = base / "verify" / "uninterrupted"
    config = tiny(base, "dcp", checkpoint_format="dcp-async")
    assert torchrun(replace(config, stop_at=9), 2, log_indices=True) == 0
    assert (Path(config.run_dir) / DCP_FOLDER / "step-00000009" / ".metadata").is_file()
    shutil.copytree(config.run_dir, base / "dcp-1")
    assert torchrun(config, 2) == 0
    assert losses(config.run_dir) == losses(str(reference))
    assert end_weights(config.run_dir) == end_weights(str(reference))

    one = replace(config, run_dir=str(base / "dcp-1"))
    assert torchrun(one, 1, log_indices=True) == 0
    resume = [e for e in read_metrics(one.run_dir) if e["event"] == "resume"][-1]
    assert resume["step"] == 9 and resume["changes"] == {"world_size": [2, 1], "global_batch": [8, 4]}
    epoch0: collections.Counter[int] = collections.Counter()
    for path in Path(one.run_dir).glob("indices.rank*.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            if record["epoch"] == 0 and (record["step"] <= 9) == (record["world_size"] == 2):
                epoch0.update(record["indices"])
    assert max(epoch0.values()) == 1 and len(epoch0) == 112  # 1,801 bytes / 16: every window once


@pytest.mark.slow  # one more torchrun job: the multi-process tests must stay under 3 minutes together
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path: Path) -> None:
    config = tiny(tmp_path, "term", max_steps=100_000, checkpoint_every=100_000, eval_every=100_000)
    process = torchrun(config, 2, wait=False)
    assert isinstance(process, subprocess.Popen)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while time.monotonic() < deadline:
            events = read_metrics(config.run_dir) if (Path(config.run_dir) / "metrics.jsonl").exists() else []
            if any(e["event"] == "step" and e["step"] >= 2 for e in events):
                break
            time.sleep(0.05)
        pids = next(e for e in events if e["event"] == "start")["pids"]
        os.kill(pids[1], signal.SIGTERM)  # rank 1 only, as a preempted node would get
        assert process.wait(timeout=JOB_TIMEOUT) == 0
    finally:
        process.kill()
    events = read_metrics(config.run_dir)
    stop = [e for e in events if e["event"] == "stop"][-1]
    assert stop["reason"] == "a signal to another rank"  # rank 0 was not signalled itself
    saved = [e for e in events if e["event"] == "checkpoint"][-1]
    assert saved["step"] == stop["step"]


def test_elastic_policies_keep_the_per_rank_or_the_global_batch() -> None:
    same = elastic_plan(policy="global-batch", saved_world=2, saved_batch=4, saved_accum=1, world=2, batch=4, accum=1)
    assert (same.grad_accum, same.changes) == (1, {})
    per_rank = elastic_plan(
        policy="per-rank-batch", saved_world=2, saved_batch=4, saved_accum=3, world=3, batch=4, accum=3
    )
    assert (per_rank.grad_accum, per_rank.changes) == (3, {"world_size": [2, 3], "global_batch": [24, 36]})
    keep = elastic_plan(policy="global-batch", saved_world=4, saved_batch=4, saved_accum=3, world=2, batch=4, accum=3)
    assert (keep.grad_accum, keep.changes["global_batch"]) == (6, [48, 48])
    with pytest.raises(
        ResumeError,
        match=r"global batch of 8 sequences \(2 ranks x --batch-size 4 x --grad-accum 1\) cannot be split over 3 ranks",
    ):
        elastic_plan(policy="global-batch", saved_world=2, saved_batch=4, saved_accum=1, world=3, batch=4, accum=1)
    assert (
        elastic_plan(policy="refuse", saved_world=2, saved_batch=4, saved_accum=1, world=2, batch=4, accum=1).changes
        == {}
    )
    with pytest.raises(ResumeError, match=r"world size changed: the checkpoint was written by 2 ranks, this job has 3"):
        elastic_plan(policy="refuse", saved_world=2, saved_batch=4, saved_accum=1, world=3, batch=4, accum=1)


@pytest.mark.slow
def test_fsdp2_with_dcp_on_cpu_resumes_bitwise_and_reshards_to_one_rank(tmp_path: Path) -> None:
    """FSDP2 (``fully_shard``) runs on gloo too: each rank saves its shards with DCP; the stopped
    run resumes bitwise on 2 ranks, and the same checkpoint resharded onto 1 rank runs to the end."""
    config = tiny(tmp_path, "straight", fsdp=True, checkpoint_format="dcp")
    assert torchrun(config, 2) == 0
    weights = end_weights(config.run_dir)
    assert len(set(weights)) == 1
    stopped = replace(config, run_dir=str(tmp_path / "stopped"))
    assert torchrun(replace(stopped, stop_at=9), 2) == 0
    shutil.copytree(stopped.run_dir, tmp_path / "one")
    assert torchrun(stopped, 2) == 0
    assert losses(stopped.run_dir) == losses(config.run_dir)
    assert end_weights(stopped.run_dir) == weights
    one = replace(config, run_dir=str(tmp_path / "one"))
    assert torchrun(one, 1) == 0
    assert [e for e in read_metrics(one.run_dir) if e["event"] == "resume"][-1]["changes"]["world_size"] == [2, 1]


def _c_threads() -> list[str]:
    """The names of this process's OS threads (gloo's are ``gloo_tcp_loop`` and ``pt_gloo_runloop``)."""
    return sorted(Path(task, "comm").read_text().strip() for task in Path("/proc/self/task").iterdir())


def _teardown_main(rank: int, world_size: int, tmp: str, config: TrainConfig) -> None:
    import gc

    from torch.nn.parallel import DistributedDataParallel

    from dist_harness import init_gloo
    from trainer.train import train

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    outcome: dict[str, Any] = {}

    def left_behind() -> dict[str, Any]:
        # No gc.collect() here: what the trainer left for the collector is what the interpreter
        # would have to free at exit.
        alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
        return {"ddp_models": alive, "gloo_threads": [t for t in _c_threads() if "gloo" in t]}

    init_gloo(rank, world_size, f"{tmp}/init-clean")
    train(config)  # to the end, with checkpoints: the clean path (barrier, then destroy)
    outcome["clean"] = left_behind()
    init_gloo(rank, world_size, f"{tmp}/init-error")
    try:  # a changed --seed stops the resume on every rank, after DDP is built: the error path
        train(replace(config, seed=config.seed + 1))
        outcome["error"] = "no error"
    except ResumeError as e:
        outcome["error"] = str(e)
    outcome["after_error"] = left_behind()
    Path(tmp, f"teardown.rank{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.slow  # 12 s of CI's 2 cores (a spawned 2-rank group); CI's default suite holds 5 minutes
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through /proc (Linux)")
def test_a_finished_or_failed_ddp_run_leaves_no_model_and_no_gloo_thread_for_interpreter_exit(tmp_path: Path) -> None:
    """After ``train()`` returns (or raises) under a process group, the DDP model is freed and the
    gloo group's C++ threads are joined. A group freed only at interpreter exit aborted a rank
    now and then after a run that had finished (``terminate called without an active
    exception``, exit -6, so torchrun failed the job)."""
    from dist_harness import results, spawn

    config = tiny(tmp_path, "run", max_steps=6, checkpoint_every=3, eval_every=3)
    spawn(_teardown_main, 2, str(tmp_path), config, timeout=JOB_TIMEOUT)  # an aborted rank fails spawn too
    for rank in results(tmp_path, "teardown", 2):
        assert rank["clean"] == {"ddp_models": 0, "gloo_threads": []}
        assert rank["error"].startswith("seed changed: checkpoint has 1337")
        assert rank["after_error"] == {"ddp_models": 0, "gloo_threads": []}


def test_dcp_format_in_a_single_process_resumes_bitwise(tmp_path: Path) -> None:
    """The DCP store without torchrun (DCP runs without a process group): stopped at step 9 and
    resumed equals the straight run, across the epoch boundary at step 14 (no processes spawned)."""
    from trainer.train import train

    straight = train(tiny(tmp_path, "straight", checkpoint_format="dcp"))
    config = tiny(tmp_path, "stopped", checkpoint_format="dcp")
    train(replace(config, stop_at=9))
    assert (Path(config.run_dir) / DCP_FOLDER / "step-00000009" / "trainer.pt").is_file()
    resumed = train(config)
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "step-00000009"
    assert losses(config.run_dir) == straight.losses
    assert end_weights(config.run_dir) == end_weights(straight.run_dir)


def _sigterm_main(rank: int, world_size: int, tmp: str, config: TrainConfig) -> None:
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from dist_harness import init_gloo
    from trainer.train import train

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    all_reduces: list[int] = []
    real_all_reduce = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: all_reduces.append(1) or real_all_reduce(*args, **kwargs)
    steps_begun = [0]

    def sigterm_rank_1_before_its_third_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        steps_begun[0] += 1
        if rank == 1 and steps_begun[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as a preempted node would get it

    outcome: dict[str, Any] = {}
    for leg, run_dir in (("reference", "reference"), ("signalled", "run"), ("resumed", "run")):
        all_reduces.clear()
        hook = register_optimizer_step_pre_hook(sigterm_rank_1_before_its_third_step) if leg == "signalled" else None
        init_gloo(rank, world_size, f"{tmp}/init-{leg}")
        result = train(replace(config, run_dir=f"{tmp}/{run_dir}"))
        if hook is not None:
            hook.remove()
        losses = {str(step): loss for step, loss in result.losses.items()}
        outcome[leg] = {
            "step": result.step,
            "stopped_by": result.stopped_by,
            "all_reduces": len(all_reduces),
            "losses": losses,
        }
    Path(tmp, f"sigterm.rank{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.slow  # 3 runs on 2 spawned ranks (52 s on the shared machine); so is verify --nproc 2 (above)
def test_a_sigterm_to_one_rank_stops_both_at_the_next_sync_and_the_resume_is_exact(tmp_path: Path) -> None:
    """2 gloo ranks, 12 steps, --sync-every 5, no checkpoint before the end: the ranks all-reduce at
    steps 5, 10 and 12 only (plus the data state's check at the save), not at every step. Rank 1 is
    sent SIGTERM during step 3: both ranks finish step 5, save it and stop; resumed, the run ends
    with every step's loss and the final checkpoint bitwise equal to the uninterrupted run's."""
    from dist_harness import results, spawn

    config = tiny(tmp_path, "unused", max_steps=12, sync_every=5, eval_every=100, checkpoint_every=100)
    spawn(_sigterm_main, 2, str(tmp_path), config, timeout=JOB_TIMEOUT)
    zero, one = results(tmp_path, "sigterm", 2)
    # Syncs at 5, 10 and 12, and the save's one all-reduce of the data state (global_state).
    assert zero["reference"]["all_reduces"] == one["reference"]["all_reduces"] == 3 + 1
    assert (zero["signalled"]["step"], one["signalled"]["step"]) == (5, 5)
    assert (zero["signalled"]["stopped_by"], one["signalled"]["stopped_by"]) == ("a signal to another rank", "SIGTERM")
    assert zero["signalled"]["all_reduces"] == 1 + 1  # the sync at 5 and the save
    assert zero["reference"]["losses"] == {**zero["signalled"]["losses"], **zero["resumed"]["losses"]}
    with (
        CheckpointManager(tmp_path / "reference" / CHECKPOINT_FOLDER, lock=False) as reference,
        CheckpointManager(tmp_path / "run" / CHECKPOINT_FOLDER, lock=False) as resumed,
    ):
        assert_same(reference.load(), resumed.load(), "final checkpoint")
