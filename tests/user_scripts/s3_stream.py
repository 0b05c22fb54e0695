"""A user's stream over token shards in object storage, used by tests/remote/test_s3_stream_script.py.

The shards and their index are where ``write_token_shards`` put them (``s3://bucket/tokens/`` or a
local folder); credentials and the endpoint come from the environment, as s3fs takes them. Windows
are shuffled by ``shuffle_window`` and batched by a ``StreamLoader`` with 2 workers, for 2 epochs.
Every few batches the loader's state is saved with ``torch.save`` (to a temporary file, then
renamed: a kill never leaves half a checkpoint); a rerun resumes from it. Each batch's records
(the first token of each window) go to ``batches.jsonl``, so a test can compare a SIGKILLed and
resumed run with an uninterrupted one.

    python s3_stream.py DATA OUT [--kill-at N]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import numpy as np
import torch

from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader

WINDOW = 8
EPOCHS = 2
CHECKPOINT_EVERY = 3  # batches


def save(state: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    with open(tmp, "rb") as file:
        os.fsync(file.fileno())
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data", help="the shards' folder or URL (holding index.json)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at", type=int, default=0, help="SIGKILL this process after that batch (0: never)")
    parser.add_argument("--batches-per-message", type=int, default=1, help="batches a worker sends at once")
    args = parser.parse_args()

    reader = TokenShardReader(WINDOW, dtype=np.uint16)
    windows = ShardedIterable.from_index(args.data, read_shard=reader, seed=7).shuffle_window(10, seed=8)
    loader = StreamLoader(
        windows, batch_size=4, num_workers=2, timeout=60, batches_per_message=args.batches_per_message
    )
    checkpoint = args.out / "checkpoint.pt"
    done = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        loader.load_state_dict(state["loader"])
        done = state["batches"]

    with open(args.out / "batches.jsonl", "a") as log:
        for epoch in loader.epochs(EPOCHS):
            for batch in loader:
                done += 1
                log.write(json.dumps({"batch": done, "epoch": epoch, "records": batch[:, 0].tolist()}) + "\n")
                log.flush()
                if done % CHECKPOINT_EVERY == 0:
                    save({"loader": loader.state_dict(), "batches": done}, checkpoint)
                if done == args.kill_at:
                    os.fsync(log.fileno())
                    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
