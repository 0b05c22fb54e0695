"""A user's script streaming token shards from S3 survives SIGKILL: tests/user_scripts/s3_stream.py.

Specification: the script (``from_index`` over ``s3://`` shards, ``shuffle_window``, a
``StreamLoader`` with 2 workers, 2 epochs, the loader's state saved with ``torch.save`` every 3
batches), SIGKILLed at a batch drawn at random and launched again, yields over both launches
exactly the batches of one uninterrupted launch over the same shards read locally, also when the
launches over S3 have the workers send 3 batches to a message and the local one 1: the batches
after the last checkpoint come again and are the same, and each epoch reads every record once.
"""

from __future__ import annotations

import json
import random
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resumable_data.streams import write_token_shards
from resumable_data.testing import assert_same
from script_runner import run_script

SCRIPT = Path(__file__).parents[1] / "user_scripts" / "s3_stream.py"
# 576 uint16 tokens 0..575 in 6 shards: 72 windows of 8 whose first token names them; on 2
# workers an epoch is 18 batches of 4, 36 over the script's 2 epochs.
TOKENS, SHARD_TOKENS, WINDOW, BATCHES = 576, 96, 8, 36
KILL_AT = random.Random(32).randint(4, BATCHES - 1)  # after the first checkpoint, before the end
SCRIPT_TIMEOUT_S = 120  # a launch: about 4 s here


def launch(data: str, out: Path, kill_at: int = 0, per_message: int = 1) -> int:
    command = [sys.executable, str(SCRIPT), data, str(out), "--kill-at", str(kill_at)]
    command += ["--batches-per-message", str(per_message)]
    code, output = run_script(command, out / f"launch-{kill_at}.log", timeout=SCRIPT_TIMEOUT_S)
    assert code in (0, -signal.SIGKILL), output[-3000:]
    return code


def logged(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "batches.jsonl").read_text().splitlines()]


@pytest.mark.usefixtures("s3_environment")
def test_a_sigkilled_script_over_s3_shards_resumes_as_an_uninterrupted_local_run(
    s3_server: Any, tmp_path: Path
) -> None:
    url = f"s3://{s3_server.bucket()}/tokens/"
    write_token_shards([np.arange(TOKENS)], url, shard_tokens=SHARD_TOKENS, dtype=np.uint16)
    local = str(s3_server.root / url.removeprefix("s3://"))  # the same files, as the server holds them
    assert launch(local, tmp_path / "local") == 0
    assert launch(url, tmp_path / "s3", kill_at=KILL_AT, per_message=3) == -signal.SIGKILL
    assert launch(url, tmp_path / "s3", per_message=3) == 0

    reference = {entry["batch"]: entry for entry in logged(tmp_path / "local")}
    assert sorted(reference) == list(range(1, BATCHES + 1))
    both = logged(tmp_path / "s3")
    replayed = [entry["batch"] for entry in both[KILL_AT:]][: KILL_AT % 3]
    assert replayed == list(range(KILL_AT - KILL_AT % 3 + 1, KILL_AT + 1)), "the relaunch starts at the checkpoint"
    for entry in both:  # the killed launch's batches and the relaunch's, replayed ones too
        assert_same(reference[entry["batch"]], entry, f"batch {entry['batch']}")
    assert {entry["batch"] for entry in both} == set(reference)
    for epoch in range(2):
        records = [r for entry in reference.values() if entry["epoch"] == epoch for r in entry["records"]]
        assert sorted(records) == list(range(0, TOKENS, WINDOW)), f"epoch {epoch} reads each record once"
