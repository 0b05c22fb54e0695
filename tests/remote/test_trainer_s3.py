"""Token shards in object storage, from the writer to the trainer, on a real S3 server (conftest.py).

Specification: ``write_token_shards`` to an ``s3://`` folder puts there, through s3fs, the very
index and shards it writes to a local folder; and the trainer on ``--data s3://bucket/tokens/``,
SIGKILLed in a subprocess after a checkpoint and relaunched with ``--resume auto``, ends bitwise
where an uninterrupted run over the same shards read locally ends (every step's loss, the final
model and optimizer). The trainer takes its credentials and endpoint from the environment, as
s3fs does.
"""

from __future__ import annotations

import random
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers.trainer_runs import end_weights, final_checkpoint, losses, tiny
from resumable_data.storage import ShardCache
from resumable_data.streams import ShardIndex, write_token_shards
from resumable_data.testing import assert_same
from script_runner import run_script
from system.killpoints import ENTRY
from system.verify import child_env, config_to_argv
from trainer.checkpointing import MODEL, OPTIMIZER
from trainer.config import TrainConfig
from trainer.metrics import read_metrics

SHARD_TOKENS = 128  # 1,000 byte tokens: 7 training shards and a validation one
# 7 windows of 17 tokens per training shard, 49 in all: with batch 4 an epoch is 12 steps;
# checkpoints at 4, 6 (eval), 8 and 12, so a kill during step 11 replays 9 and 10 and the resumed
# run crosses the epoch boundary. Read by 2 DataLoader workers, forked after the trainer has read
# the bucket (the index, the shards' sizes): what a worker inherits must not stall the trainer.
MAX_STEPS, KILL_AT, RESUMED_FROM, WORKERS = 16, 11, 8, 2
RUN_TIMEOUT_S = 120  # a trainer process: about 4 s here


def corpus_tokens() -> np.ndarray:
    """1,000 bytes of real text as byte tokens (the trainer's vocabulary of 256)."""
    return np.frombuffer(Path(random.__file__).read_bytes()[:1000], dtype=np.uint8)


@pytest.fixture(scope="module")
def tokens_url(s3_server: Any) -> str:
    """The corpus written as uint8 token shards to ``s3://<bucket>/tokens/``."""
    folder = f"s3://{s3_server.bucket()}/tokens"
    index = write_token_shards(
        [corpus_tokens()], folder, shard_tokens=SHARD_TOKENS, dtype=np.uint8, storage_options=s3_server.options()
    )
    assert index == f"{folder}/index.json"
    return folder + "/"


def test_token_shards_written_to_s3_are_the_ones_written_to_a_local_folder(
    s3_server: Any, tokens_url: str, tmp_path: Path
) -> None:
    local = Path(write_token_shards([corpus_tokens()], tmp_path, shard_tokens=SHARD_TOKENS, dtype=np.uint8)).parent
    fs = s3_server.fs(tokens_url)
    remote = {path.rsplit("/", 1)[1]: fs.cat_file(path) for path in fs.ls(tokens_url)}
    assert sorted(remote) == sorted(p.name for p in local.iterdir())
    assert_same({name: (local / name).read_bytes() for name in remote}, remote, "objects in the bucket")
    index = ShardIndex.load(tokens_url, storage_options=s3_server.options())
    assert index.locations == [f"{tokens_url}shard-{i:05d}.bin" for i in range(8)]
    assert index.tokens == len(corpus_tokens()) and index.dtype == "uint8"


def run_trainer(config: TrainConfig, kill_at: int | None = None) -> int:
    """``python -m trainer train`` in a subprocess (SIGKILLed during step ``kill_at``); its exit code."""
    entry = [*ENTRY, "step", str(kill_at)] if kill_at else ["-m", "trainer"]
    command = [sys.executable, *entry, "train", *config_to_argv(config)]
    log = Path(config.run_dir).parent / f"{Path(config.run_dir).name}-{kill_at or 'run'}.log"
    code, output = run_script(command, log, timeout=RUN_TIMEOUT_S, env=child_env())
    assert code in (0, -signal.SIGKILL), output[-3000:]
    return code


@pytest.fixture(scope="module")
def reference(s3_server: Any, tokens_url: str, tmp_path_factory: pytest.TempPathFactory) -> TrainConfig:
    """The uninterrupted run over the bucket's files read locally."""
    bucket_folder = s3_server.root / tokens_url.removeprefix("s3://")  # the same files, read locally
    config = tiny(
        tmp_path_factory.mktemp("reference"), "local", data=bucket_folder, max_steps=MAX_STEPS, num_workers=WORKERS
    )
    assert run_trainer(config) == 0
    return config


@pytest.mark.usefixtures("s3_environment")
# The cached run is the demanding one (evictions below the data's size, restores through the cache);
# without a cache it reads the same URLs by ranged requests, which the stream tests cover: slow only.
# Both are slow since CI's 5 minutes ran out: test_s3_stream_script.py SIGKILLs a user's script over S3.
@pytest.mark.parametrize(
    "cached",
    [pytest.param(False, marks=pytest.mark.slow), pytest.param(True, marks=pytest.mark.slow)],
    ids=["no-cache", "cache-below-the-data"],
)
def test_trainer_on_s3_shards_sigkilled_and_resumed_ends_as_an_uninterrupted_local_run(
    reference: TrainConfig, tokens_url: str, tmp_path: Path, cached: bool
) -> None:
    # --cache-dir (tiny() sets one for text corpora) caches the shards too; --cache-limit: 3 of the 8 shards.
    cache = {"cache_dir": str(tmp_path / "shards"), "cache_limit": 3 * SHARD_TOKENS} if cached else {"cache_dir": None}
    interrupted = replace(reference, run_dir=str(tmp_path / "s3"), data=tokens_url, **cache)
    assert run_trainer(interrupted, kill_at=KILL_AT) == -signal.SIGKILL
    assert run_trainer(interrupted) == 0

    events = read_metrics(interrupted.run_dir)
    assert [e["step"] for e in events if e["event"] == "resume"] == [RESUMED_FROM]
    starts = [e for e in events if e["event"] == "start"]
    assert all(e["data"].startswith(tokens_url) and e["config"]["num_workers"] == WORKERS for e in starts)
    epochs = {e["epoch"] for e in events if e["event"] == "step"}
    assert epochs == {0, 1}, f"the run should cross an epoch boundary: {epochs}"
    assert_same(losses(reference.run_dir), losses(interrupted.run_dir), "every step's loss")
    assert end_weights(reference.run_dir) == end_weights(interrupted.run_dir)
    final_local, final_s3 = final_checkpoint(reference.run_dir), final_checkpoint(interrupted.run_dir)
    for key in (MODEL, OPTIMIZER):
        assert_same(final_local[key], final_s3[key], f"final {key}")
    assert (ShardCache.peak_bytes(tmp_path / "shards") > 0) == cached  # the shards were read through the cache
