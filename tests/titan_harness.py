"""What the torchtitan tests share: token shards whose every token is known, a TitanLoader over them, a
training step's view of a batch, and the exactly-once check.

Used by tests/integrations/test_torchtitan.py (no torchtitan needed) and by
tests/integrations/torchtitan_checks.py (run inside torchtitan's own environment).
"""

from __future__ import annotations

import collections
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from resumable_data.integrations.torchtitan import TitanLoader
from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader, mix, write_token_shards

SEED = 7
WINDOW = 9  # 8 input tokens and their 8 next-token labels per record
TOKENS = 432  # token t is t, so every token of the epoch is known: 48 records of WINDOW tokens
BATCH = 2
PAD = 65535  # pack's padding of a slot's last window (no token is PAD)


def write_data(folder: Path) -> str:
    """One index of 6 shards for "shards"; for "mix", two sources of half the tokens each."""
    write_token_shards([np.arange(TOKENS // 2)], folder / "mix-a", shard_tokens=36)
    write_token_shards([np.arange(TOKENS // 2, TOKENS)], folder / "mix-b", shard_tokens=36)
    return write_token_shards([np.arange(TOKENS)], folder / "tokens", shard_tokens=8 * WINDOW)


def titan_loader(folder: str | Path, kind: str = "shards", *, rank: int = 0, world_size: int = 1) -> TitanLoader:
    """A loader over token shards, shuffled through a buffer; or over a mix of two sets of shards of
    6-token records, packed into windows of WINDOW tokens (a window ends inside a record)."""
    if kind == "shards":
        reader = TokenShardReader(WINDOW)
        stream = ShardedIterable.from_index(f"{folder}/tokens", read_shard=reader, seed=SEED).shuffle_buffer(4)
    else:
        sources = [
            ShardedIterable.from_index(f"{folder}/mix-{s}", read_shard=TokenShardReader(6), seed=SEED) for s in "ab"
        ]
        stream = mix(sources, weights=[1, 2], seed=SEED).pack(WINDOW, pad_id=PAD)
    loader = StreamLoader(stream, batch_size=BATCH, rank=rank, world_size=world_size)
    return TitanLoader(loader, seed=SEED, infinite=False)


def seen_by_step(batch: tuple[dict[str, torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """What a training step sees: the batch's tokens, and the global RNGs' next draws (dropout, say)."""
    inputs, labels = batch
    assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])  # labels are the inputs shifted by one
    return {
        "tokens": torch.cat([inputs["input"], labels[:, -1:]], dim=1).tolist(),
        "rng": [torch.rand(1).item(), random.random(), float(np.random.rand())],
    }


def assert_each_token_once(*runs: list[dict[str, Any]]) -> None:
    seen = collections.Counter(t for steps in runs for step in steps for row in step["tokens"] for t in row if t != PAD)
    assert sorted(seen) == list(range(TOKENS)) and set(seen.values()) == {1}, seen
