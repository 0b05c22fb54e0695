"""Two torchrun ranks on one machine share one shard cache: tests/user_scripts/torchrun_stream.py.

Specification: a data-parallel job (``python -m torch.distributed.run --nproc_per_node=2``, gloo),
each rank a ``StreamLoader`` (0 or 2 DataLoader workers) over token shards on the S3 server read
through the counting proxy, with one ``cache_dir`` for the machine:

- each shard object is downloaded whole exactly once by both ranks and all their workers together,
  over both epochs, and the bytes at the proxy are about the dataset's size;
- each rank's batches are those of a reference run over the same files read locally, and both
  ranks' records together are each record exactly once per epoch;
- the job SIGKILLed mid-epoch (every rank, its workers and the agent at once) and launched again
  resumes from its last whole checkpoint and yields exactly the batches of the uninterrupted job.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from user_scripts.torchrun_stream import BATCH, CHECKPOINT_EVERY, DTYPE, EPOCHS, WINDOW, make_loader

from proxy import FaultProxy
from resumable_data.streams import write_token_shards
from resumable_data.testing import assert_same
from script_runner import run_script

SCRIPT = Path(__file__).parents[1] / "user_scripts" / "torchrun_stream.py"
RANKS, SHARDS, SHARD_TOKENS = 2, 8, 32768  # 8 shards of 128 KiB: the bytes are the shards, not headers
DATASET_BYTES = SHARDS * SHARD_TOKENS * np.dtype(DTYPE).itemsize
RECORDS = SHARDS * SHARD_TOKENS // WINDOW
BATCHES = RECORDS // RANKS // BATCH * EPOCHS  # per rank, over the job's epochs: 128
KILL_AT = BATCHES // EPOCHS // 2 + 3  # rank 0's 35th batch: mid-epoch, 5 after its last checkpoint
JOB_TIMEOUT_S = 180  # a launch takes about 5 s here


@pytest.fixture
def shards(s3_server: Any, proxy: FaultProxy, s3_environment: None, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """The shards at an s3:// URL (written to the server directly) and the same files as the server
    holds them; the jobs reach the server through ``proxy``."""
    url = f"s3://{s3_server.bucket()}/tokens/"
    write_token_shards([np.arange(SHARDS * SHARD_TOKENS)], url, shard_tokens=SHARD_TOKENS, dtype=DTYPE)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    return url, str(s3_server.root / url.removeprefix("s3://"))


def launch(url: str, out: Path, cache: Path, workers: int, kill_at: int = 0) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}"]
    command += [str(SCRIPT), url, str(out), str(cache), "--workers", str(workers), "--kill-at", str(kill_at)]
    code: int | None = None
    try:
        code, output = run_script(command, out / f"launch-{kill_at}.log", timeout=JOB_TIMEOUT_S)
        assert code in (0, -signal.SIGKILL), output[-3000:]
        return code
    finally:
        if code not in (0, -signal.SIGKILL) and (out / "pids").exists():  # ranks run in sessions of their own
            for pid in map(int, (out / "pids").read_text().split()):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)


def logged(out: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"batches.rank{rank}.jsonl").read_text().splitlines()]


def reference(local: str, workers: int) -> list[dict[int, dict[str, Any]]]:
    """Each rank's batches of the job over the local files, by batch number (no process group: the
    rank and world size are given)."""
    runs = []
    for rank in range(RANKS):
        loader, entries, done = make_loader(local, workers, rank=rank, world_size=RANKS), {}, 0
        for epoch in loader.epochs(EPOCHS):
            for batch in loader:
                done += 1
                entries[done] = {"batch": done, "epoch": epoch, "records": batch[:, 0].tolist()}
        assert sorted(entries) == list(range(1, BATCHES + 1))
        runs.append(entries)
    for epoch in range(EPOCHS):
        records = [r for run in runs for entry in run.values() if entry["epoch"] == epoch for r in entry["records"]]
        assert sorted(records) == list(range(0, SHARDS * SHARD_TOKENS, WINDOW)), f"epoch {epoch}: each record once"
    return runs


def shard_reads(proxy: FaultProxy, local: str) -> tuple[Counter[str], int]:
    """Per shard file, the GETs of the whole object (a download asks for its first byte to the end of
    a block larger than the shard); and the bytes of the ranged GETs of parts of shards (records read
    by key before their shard is cached: a shuffle window's, a restore's)."""
    sizes = {name: os.path.getsize(os.path.join(local, name)) for name in os.listdir(local) if name.endswith(".bin")}
    whole: Counter[str] = Counter(dict.fromkeys(sizes, 0))
    ranged = 0
    for method, path, byte_range in proxy.log:
        name = path.rsplit("/", 1)[-1]
        if method == "GET" and name in sizes:
            first, _, last = (byte_range or "bytes=0-").removeprefix("bytes=").partition("-")
            if first == "0" and (not last or int(last) >= sizes[name] - 1):
                whole[name] += 1
            else:
                ranged += int(last) + 1 - int(first)
    return whole, ranged


@pytest.mark.slow  # 11 s of 2 ranks x 2 workers; tests/storage/test_cache.py shares a cache between processes by default
@pytest.mark.parametrize("workers", [0, 2])
def test_two_ranks_download_each_shard_once_and_read_each_record_once_per_epoch(
    shards: tuple[str, str], proxy: FaultProxy, tmp_path: Path, workers: int
) -> None:
    url, local = shards
    assert launch(url, tmp_path / "job", tmp_path / "cache", workers) == 0

    whole, ranged = shard_reads(proxy, local)
    assert dict(whole) == dict.fromkeys(whole, 1), "each shard downloaded once by the machine"
    # The bytes at the proxy: the dataset once, the few records the shuffle window read by key
    # before their shard was cached (about 5 % here; 11 % once on a machine loaded 4x over, where
    # downloads land later), and the responses' headers (about 1 KiB each).
    assert ranged < 0.25 * DATASET_BYTES, f"{ranged} bytes of ranged reads"
    overhead = proxy.bytes_down - DATASET_BYTES - ranged
    assert 0 <= overhead <= 2048 * proxy.requests, f"{proxy.bytes_down} bytes at the proxy, {ranged} ranged"
    for rank, expected in enumerate(reference(local, workers)):
        assert_same(list(expected.values()), logged(tmp_path / "job", rank), f"rank {rank}")


@pytest.mark.slow  # 10 s of CI's 2 cores; test_trainer_s3.py SIGKILLs a run over S3 in the default suite
def test_a_sigkilled_torchrun_job_resumes_exactly_from_its_last_checkpoint(
    shards: tuple[str, str], proxy: FaultProxy, tmp_path: Path
) -> None:
    url, local = shards
    out, cache = tmp_path / "job", tmp_path / "cache"
    assert launch(url, out, cache, 2, kill_at=KILL_AT) == -signal.SIGKILL
    killed = [len(logged(out, rank)) for rank in range(RANKS)]
    before, _ = shard_reads(proxy, local)
    proxy.reset_counters()
    assert launch(url, out, cache, 2) == 0
    after, _ = shard_reads(proxy, local)

    checkpoint = KILL_AT - KILL_AT % CHECKPOINT_EVERY
    for rank, expected in enumerate(reference(local, 2)):
        both = logged(out, rank)  # the killed launch's batches, then the relaunch's from the checkpoint
        assert killed[rank] >= checkpoint, f"rank {rank} had logged {killed[rank]} batches at the kill"
        assert [entry["batch"] for entry in both[killed[rank] :]] == list(range(checkpoint + 1, BATCHES + 1))
        for entry in both:
            assert_same(expected[entry["batch"]], entry, f"rank {rank}, batch {entry['batch']}")
    # The relaunch reuses the cache: it downloads again at most the shards whose download the kill
    # cut (one per slot in flight; none in the runs here, where every shard was downloaded once).
    assert max(before.values()) <= 1 and max(after.values()) <= 1, "a shard is downloaded once per launch"
    assert (before + after).total() <= SHARDS + RANKS * 2, f"downloads: {dict(before)}, then {dict(after)}"
