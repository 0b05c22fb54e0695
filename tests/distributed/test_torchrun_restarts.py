"""torchrun restarts that always work, and no orphans.

- A restarted round of ranks finds the previous round's keys in torchrun's store (its agent keeps
  one store for every round, with no per-round prefix); the trainer's start-up must join in a fresh
  namespace instead of connecting to the dead ranks' gloo addresses.
- ``torchrun --max-restarts 2 --rdzv-backend c10d`` with rank 1 SIGKILLed mid-run restarts, resumes
  from the newest valid checkpoint and ends bitwise equal to an uninterrupted run.
- Killing the torchrun agent takes its ranks and their DataLoader workers down within seconds, and
  with them the run folder's lock.
- Two "nodes" (``--nnodes 2``) on one machine: one killed, both relaunched, bitwise equal.

Every job runs with its own timeout. Only the first test is in the default suite.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from helpers.trainer_runs import end_weights, losses, tiny
from resumable_data import CheckpointManager
from system.chaos_distributed import alive, children
from system.verify import config_to_argv
from trainer.config import TrainConfig
from trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT = 240


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def torchrun(config: TrainConfig, *launcher: str, log: str = "torchrun.log") -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher,
        "-m",
        "trainer",
        "train",
        *config_to_argv(config),
    ]
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(config.run_dir) / log, "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env())


RESTARTING = ("--nproc_per_node=2", "--max-restarts=2", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0")


def finish(process: subprocess.Popen[bytes], timeout: float = JOB_TIMEOUT) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


def events(run_dir: str) -> list[dict[str, Any]]:
    return read_metrics(run_dir) if (Path(run_dir) / "metrics.jsonl").is_file() else []


def wait_for_step(run_dir: str, step: int, starts: int = 1, timeout: float = JOB_TIMEOUT) -> list[int]:
    """Wait until the ``starts``-th launch logged ``step``; return that launch's rank pids."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = events(run_dir)
        begun = [i for i, e in enumerate(log) if e["event"] == "start"]
        if len(begun) >= starts and any(e["event"] == "step" and e["step"] >= step for e in log[begun[starts - 1] :]):
            return list(log[begun[starts - 1]]["pids"])
        time.sleep(0.05)
    raise TimeoutError(f"{run_dir}: step {step} of launch {starts} not logged within {timeout} s")


STALE_ROUND = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    from trainer import parallel
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "1" and os.environ["RANK"] == "1":
        time.sleep(3)  # the new rank 0 reads the store first
    ranks = parallel.start("cpu")
    dist.barrier()
    print("joined", ranks.rank, flush=True)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and ranks.rank == 1:
        os._exit(9)  # dies without a word, as a SIGKILLed rank does
    time.sleep(2)
    ranks.close(clean=False)
    """
)


def test_the_start_up_handshake_ignores_a_dead_rounds_leader_and_agrees_on_a_fresh_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two ranks as threads on a store that holds a dead round's keys: rank 1 arrives first and
    reads the dead leader's token; it must wait for the new rank 0 and land in its namespace."""
    import threading

    import torch.distributed as dist

    from resumable_data import torchrun

    agent_store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(agent_store.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    agent_store.set("resumable_data/round/leader", "dead-round")
    agent_store.set("dead-round/joined/1", "whoever")
    stores: dict[int, Any] = {}

    def rank(r: int, delay: float) -> None:
        time.sleep(delay)
        stores[r] = torchrun.fresh_store(r, 2)

    threads = [threading.Thread(target=rank, args=(1, 0.0)), threading.Thread(target=rank, args=(0, 1.0))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert set(stores) == {0, 1}
    stores[0].set("hello", "from rank 0")
    assert stores[1].get("hello") == b"from rank 0"
    assert not agent_store.check(["hello"])  # not in the bare store, where a dead round's keys live


def test_a_rank_exits_within_a_second_once_its_parent_is_gone() -> None:
    """The watchdog of ``resumable_data.torchrun.watch_parent``: a forked grandchild (the "rank")
    watches its parent (the "agent"); it lives while the parent lives and follows it when it exits."""
    from resumable_data import torchrun

    from_rank, to_test = os.pipe()
    from_test, to_agent = os.pipe()
    agent = os.fork()
    if agent == 0:  # never returns into pytest, whatever happens
        try:
            rank = os.fork()
            if rank == 0:
                try:
                    torchrun.watch_parent(poll_s=0.05)
                    os.write(to_test, str(os.getpid()).encode())
                    time.sleep(30)
                finally:
                    os._exit(0)
            os.read(from_test, 1)  # exit when the test says so
        finally:
            os._exit(0)
    os.close(to_test)
    rank = int(os.read(from_rank, 32) or b"-1")
    assert rank > 0, "the rank could not start its watchdog"
    time.sleep(0.3)
    assert alive(rank)  # its parent lives: it is left alone
    os.write(to_agent, b"x")
    os.waitpid(agent, 0)
    deadline = time.monotonic() + 5
    while alive(rank) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(rank)
    for fd in (from_rank, from_test, to_agent):
        os.close(fd)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun's gloo on Linux")
def test_a_restarted_round_joins_although_the_store_holds_the_dead_rounds_keys() -> None:
    """torchrun's agent store, as a restart finds it: round 0's ranks joined (and rank 1 died);
    round 1's rank 0 starts 3 s before rank 1 and must not connect to round 0's dead rank 1.
    On main this failed every time ("Gloo connectFullMesh failed ... Connect timeout")."""
    import torch.distributed as dist

    agent_store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    base = {**env(), "MASTER_ADDR": "localhost", "MASTER_PORT": str(agent_store.port), "WORLD_SIZE": "2"}
    base.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID="test", LOCAL_WORLD_SIZE="2")
    for attempt, expected in ((0, {0: 0, 1: 9}), (1, {0: 0, 1: 0})):
        processes = {
            rank: subprocess.Popen(
                [sys.executable, "-c", STALE_ROUND],
                env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": str(attempt)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for rank in (0, 1)
        }
        codes = {}
        for rank, process in processes.items():
            try:
                codes[rank] = process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                for other in processes.values():
                    other.kill()
                pytest.fail(f"round {attempt}: rank {rank} did not join within 60 s (stale gloo address?)")
        outputs = {rank: p.stdout.read().decode() if p.stdout else "" for rank, p in processes.items()}
        assert codes == expected, outputs
        assert all(f"joined {rank}" in outputs[rank] for rank in (0, 1)), outputs


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> TrainConfig:
    """The uninterrupted 2-rank run every restarted run must equal."""
    base = tmp_path_factory.mktemp("restarts")
    config = tiny(base, "reference")
    assert finish(torchrun(config, "--standalone", "--nproc_per_node=2")) == 0
    return config


@pytest.mark.slow
def test_torchrun_restarts_a_job_whose_rank_1_was_sigkilled_and_it_ends_bitwise_equal(
    reference: TrainConfig, tmp_path: Path
) -> None:
    config = replace(reference, run_dir=str(tmp_path / "killed"), resume="auto")
    process = torchrun(config, *RESTARTING)
    try:
        pids = wait_for_step(config.run_dir, 10)  # after the checkpoint of step 8
        os.kill(pids[1], signal.SIGKILL)
        assert finish(process) == 0, (Path(config.run_dir) / "torchrun.log").read_text()[-3000:]
    finally:
        process.kill()
    log = read_metrics(config.run_dir)
    resumed = [e for e in log if e["event"] == "resume"]
    assert len([e for e in log if e["event"] == "start"]) == 2 and resumed and resumed[0]["step"] >= 8
    assert losses(config.run_dir) == losses(reference.run_dir)
    assert end_weights(config.run_dir) == end_weights(reference.run_dir)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds child processes through /proc (Linux)")
def test_killing_the_torchrun_agent_takes_every_rank_and_dataloader_worker_down_and_frees_the_lock(
    tmp_path: Path,
) -> None:
    config = tiny(tmp_path, "orphans", max_steps=100_000, checkpoint_every=5, eval_every=100_000, num_workers=2)
    process = torchrun(config, "--standalone", "--nproc_per_node=2")
    try:
        ranks = wait_for_step(config.run_dir, 6)
        # 2 DataLoader workers per rank (plus any helper): they start with each pass over the data
        # (and warm start serves a pass's first batch before they exist), so wait until they are up.
        deadline = time.monotonic() + 60
        workers = [child for rank in ranks for child in children(rank)]
        while len(workers) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
            workers = [child for rank in ranks for child in children(rank)]
        assert len(workers) >= 4, workers
        process.send_signal(signal.SIGKILL)  # the agent: no chance to stop its workers
        process.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(pid) for pid in ranks + workers):
            time.sleep(0.1)
        assert [pid for pid in ranks + workers if alive(pid)] == []
    finally:
        process.kill()
        for pid in [p for p in locals().get("ranks", []) + locals().get("workers", []) if alive(p)]:
            os.kill(pid, signal.SIGKILL)
    with CheckpointManager(Path(config.run_dir) / "checkpoints"):  # the lock is free: a relaunch proceeds
        pass


@pytest.mark.slow
def test_two_nodes_on_one_machine_one_killed_both_relaunched_end_bitwise_equal(
    reference: TrainConfig, tmp_path: Path
) -> None:
    """``--nnodes 2`` as two torchrun launches (one rank each) sharing a c10d rendezvous: node 1's
    agent is SIGKILLed mid-run (its rank follows it), node 0's job fails; both relaunched with
    ``--resume auto`` end bitwise equal to the uninterrupted 2-rank run."""
    config = replace(reference, run_dir=str(tmp_path / "nodes"), resume="auto")

    def launch(node: int, endpoint: str) -> subprocess.Popen[bytes]:
        return torchrun(
            config, "--nnodes=2", "--nproc_per_node=1", f"--node-rank={node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", "--rdzv-id=nodes", log=f"node{node}.log",
        )  # fmt: skip

    endpoint = f"localhost:{free_port()}"
    nodes = [launch(0, endpoint), launch(1, endpoint)]
    try:
        wait_for_step(config.run_dir, 10)
        nodes[1].send_signal(signal.SIGKILL)
        assert finish(nodes[0], 120) != 0  # its peer is gone
        nodes[1].wait(timeout=10)
        endpoint = f"localhost:{free_port()}"
        nodes = [launch(0, endpoint), launch(1, endpoint)]
        assert [finish(node) for node in nodes] == [0, 0]
    finally:
        for node in nodes:
            node.kill()
    resumed = [e for e in read_metrics(config.run_dir) if e["event"] == "resume"]
    assert resumed and resumed[-1]["step"] >= 8
    assert losses(config.run_dir) == losses(reference.run_dir)
    assert end_weights(config.run_dir) == end_weights(reference.run_dir)
