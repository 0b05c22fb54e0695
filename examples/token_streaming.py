"""Pretraining-style streaming: token shards from two sources, mixed 3:1, through a shuffle buffer,
batched by 2 worker processes, stopped mid-epoch and resumed exactly.

The state saved in the checkpoint is a few cursors per shard plus the *keys* of the records the
shuffle buffer holds (never their tokens); a restore seeks into each shard and re-reads only the
buffered windows.

    python examples/token_streaming.py            # CPU only, under a minute
    python examples/token_streaming.py --smoke    # what the test suite runs
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path

import numpy as np
import torch

from resumable_data import ShardedIterable, StreamLoader, mix
from resumable_data.streams import TokenShardReader

BLOCK = 32  # tokens per training example; each window holds BLOCK + 1 for next-token targets


def write_shards(folder: Path, name: str, num_shards: int, tokens_per_shard: int, seed: int) -> list[Path]:
    """uint16 token shards as a tokenizer would have written them (``name_000.bin``, ...)."""
    rng = np.random.default_rng(seed)
    paths = []
    for k in range(num_shards):
        path = folder / f"{name}_{k:03d}.bin"
        rng.integers(0, 50_000, tokens_per_shard, dtype=np.uint16).tofile(path)
        paths.append(path)
    return paths


def make_loader(web: list[Path], code: list[Path]) -> StreamLoader:
    reader = TokenShardReader(BLOCK + 1)
    sources = [
        ShardedIterable(web, read_shard=reader, seed=0),  # shard order shuffled per epoch
        ShardedIterable(code, read_shard=reader, seed=1),
    ]
    stream = mix(sources, weights=[3, 1], seed=2).shuffle_buffer(256, seed=3)
    return StreamLoader(stream, batch_size=8, num_workers=2)


def batches(loader: StreamLoader, num_epochs: int, stop_after: int | None = None) -> list[torch.Tensor]:
    """The epoch loop of a training job, stopped after ``stop_after`` batches (a preemption)."""
    seen = []
    for epoch in range(loader.epoch, num_epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            inputs, targets = batch[:, :-1], batch[:, 1:]  # what the model step would take
            seen.append(torch.stack([inputs, targets]))
            if len(seen) == stop_after:
                return seen
    return seen


def checkpoint_roundtrip(state: dict) -> dict:
    """What a checkpoint file does to the state: torch.save, then a weights_only load."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a smaller run, for the test suite")
    args = parser.parse_args()
    tokens = 3_000 if args.smoke else 20_000
    num_epochs = 2

    with tempfile.TemporaryDirectory() as folder:
        web = write_shards(Path(folder), "web", 6, tokens, seed=0)
        code = write_shards(Path(folder), "code", 2, tokens, seed=1)

        reference = batches(make_loader(web, code), num_epochs)
        stop = len(reference) // 3  # inside the first epoch, buffer full
        first_leg = make_loader(web, code)
        before = batches(first_leg, num_epochs, stop_after=stop)
        state = checkpoint_roundtrip(first_leg.state_dict())

        resumed_loader = make_loader(web, code)  # a fresh process would build it the same way
        resumed_loader.load_state_dict(state)
        after = batches(resumed_loader, num_epochs)

    resumed = before + after
    print(f"{len(reference)} batches of 8 x {BLOCK} tokens over {num_epochs} epochs; stopped after {stop}")
    print(f"state: {len(str(state))} characters of plain data (cursors and buffered record keys)")
    identical = len(resumed) == len(reference) and all(
        torch.equal(a, b) for a, b in zip(reference, resumed, strict=False)
    )
    print(f"identical: {identical}")
    raise SystemExit(0 if identical else 1)


if __name__ == "__main__":
    main()
