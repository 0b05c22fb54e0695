"""What the loaders record under ``RESUMABLE_DATA_AUDIT``, and what ``audit.log`` writes: a line per
batch with its exact place, indices and bytes; exact float bits; nothing at all without the variable;
every line kept through a SIGKILL; a file per process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from resumable_data import ResumableDataLoader, audit
from resumable_data.audit.records import AUDIT_ENV, LOG, digest, loader_id, recorder
from resumable_data.audit.tail import Watch
from resumable_data.streams import ShardedIterable, StreamLoader
from streams_harness import MemoryShards


def lines(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines()]


def test_without_the_variable_nothing_is_recorded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(AUDIT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert recorder(0, 0) is None and loader_id() is None
    loader = ResumableDataLoader(torch.arange(10), batch_size=4, seed=0)
    iterator = iter(loader)
    assert iterator._audit is None  # decided once per iterator: no per-batch check or cost
    list(iterator)
    audit.log(1, loss=torch.tensor(0.5))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_map_loader_records_each_batch_it_hands_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, num_workers: int
) -> None:
    monkeypatch.setenv(AUDIT_ENV, str(tmp_path))
    loader = ResumableDataLoader(torch.arange(22) * 10, batch_size=4, seed=3, num_workers=num_workers)
    batches = [b for _ in loader.epochs(2) for b in loader]
    records = lines(tmp_path)
    assert [r["kind"] for r in records] == ["batch"] * len(batches)
    assert [r["epoch"] for r in records] == [0] * 6 + [1] * 6
    assert [r["position"] for r in records] == [0, 4, 8, 12, 16, 20] * 2
    assert [r["indices"] for r in records] == [(b // 10).tolist() for b in batches]
    assert [r["digest"] for r in records] == [digest(b) for b in batches]
    assert {r["loader"] for r in records} == {records[0]["loader"]} and {r["rank"] for r in records} == {0}


def test_a_restored_loader_records_what_the_uninterrupted_one_recorded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    data = torch.randn(30, 3, generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv(AUDIT_ENV, str(tmp_path / "reference"))
    list(ResumableDataLoader(data, batch_size=4, seed=1))
    monkeypatch.setenv(AUDIT_ENV, str(tmp_path / "interrupted"))
    first = ResumableDataLoader(data, batch_size=4, seed=1)
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    resumed = ResumableDataLoader(data, batch_size=4, seed=1, num_workers=2)
    resumed.load_state_dict(first.state_dict())
    list(resumed)

    def places(folder: str) -> list[tuple[Any, ...]]:
        return [(r["epoch"], r["position"], r["indices"], r["digest"]) for r in lines(tmp_path / folder)]

    assert places("interrupted") == places("reference")
    assert [r["position"] for r in lines(tmp_path / "reference")] == [0, 4, 8, 12, 16, 20, 24, 28]


def test_a_stream_loader_records_slot_and_count_as_each_batch_position(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(AUDIT_ENV, str(tmp_path))
    shards = MemoryShards([5, 7, 4])
    loader = StreamLoader(ShardedIterable(shards.names, read_shard=shards), batch_size=3, num_workers=2)
    batches = list(loader)
    records = lines(tmp_path)
    assert [r["digest"] for r in records] == [digest(b) for b in batches]
    positions = [tuple(r["position"]) for r in records]
    assert len(set(positions)) == len(positions) and {slot for slot, _ in positions} == {0, 1}


def test_log_keeps_the_exact_float_bits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(AUDIT_ENV, str(tmp_path))
    loss = torch.tensor(1.0, dtype=torch.float32) / 3
    audit.log(7, loss=loss, lr=3e-4, tag="warmup", tokens=np.int64(4096))
    (record,) = lines(tmp_path)
    assert record["kind"] == "log" and record["step"] == 7
    assert float.fromhex(record["values"]["loss"]["hex"]) == loss.item()
    assert record["values"]["lr"] == {"hex": (3e-4).hex()}
    assert record["values"]["tag"] == "warmup" and record["values"]["tokens"] == 4096


def test_digest_covers_bytes_dtype_shape_and_structure() -> None:
    x = torch.arange(6, dtype=torch.float32)
    assert digest({"a": x, "b": [1, "s"]}) == digest({"b": [1, "s"], "a": x.clone()})
    assert digest(x) != digest(x.to(torch.float64))
    assert digest(x) != digest(x.reshape(2, 3))
    assert digest(x) != digest(x + 1e-6)
    assert digest(x.to(torch.bfloat16)) == digest(x.to(torch.bfloat16).clone())
    assert digest(np.arange(3)) != digest(np.arange(3).astype(np.int32))
    assert digest((x, x)) != digest([x])


SCRIPT = """
import os, signal, sys
from resumable_data import audit
for step in range(1, 6):
    audit.log(step, loss=float(step))
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_every_line_survives_a_sigkill_and_each_process_has_its_own_file(tmp_path: Path) -> None:
    env = {**__import__("os").environ, AUDIT_ENV: str(tmp_path)}
    runs = [("kill", "0"), ("kill", "0"), ("end", "1")]  # a relaunch of rank 0, and a rank 1
    for how, rank in runs:
        done = subprocess.run([sys.executable, "-c", SCRIPT, how], env={**env, "RANK": rank}, timeout=120, check=False)
        assert done.returncode == (-9 if how == "kill" else 0)
    files = sorted(tmp_path.glob("*.jsonl"))
    assert len(files) == 3 and sum(f.name.startswith("rank1-") for f in files) == 1
    for path in files:
        steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
        assert steps == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("global_rng", ["batch", "sample"])
def test_recording_a_batch_leaves_the_training_loops_random_numbers_as_they_were(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, global_rng: str
) -> None:
    # Audited or not, a run must train the same: the record of a batch read its indices by iterating
    # them in the main process, which seeds the global RNGs for a fetch there (num_workers=0), so the
    # loop's dropout drew other numbers from the first batch on (found by the chaos harness under
    # torchrun: every audited run's losses differed from the unaudited ones).
    def draws() -> list[tuple[list[int], float]]:
        loader = ResumableDataLoader(list(range(20)), batch_size=4, seed=0, global_rng=global_rng)
        torch.manual_seed(0)
        return [(batch.tolist(), torch.rand(1).item()) for batch in loader]

    monkeypatch.delenv(AUDIT_ENV, raising=False)
    plain = draws()
    monkeypatch.setenv(AUDIT_ENV, str(tmp_path / "records"))
    assert draws() == plain
    assert len([line for line in lines(tmp_path / "records") if line["kind"] == "batch"]) == 5


def test_a_watch_reports_the_step_a_kill_landed_after_not_the_one_it_was_aimed_at(tmp_path: Path) -> None:
    """Found in CI on a loaded machine: the launch ran on past its kill point while the kill was sent, and
    the report said "killed after step 26" of a launch whose audit went on to step 28."""
    points = [(LOG, step) for step in range(10)]
    watch = Watch(tmp_path, points, target=3)
    log = tmp_path / "rank0-1.jsonl"
    with open(log, "w") as out:
        for step in range(5):
            out.write(json.dumps({"kind": LOG, "rank": 0, "step": step}) + "\n")
        out.flush()
        assert watch.reached_target()  # the kill is sent here...
        out.write(json.dumps({"kind": LOG, "rank": 0, "step": 5}) + "\n")  # ...and lands a step later,
        out.write('{"kind": "log", "rank": 0, "st')  # inside the next line
    watch.finish()
    assert watch.reached == "step 6"
