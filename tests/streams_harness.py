"""Helpers shared by the stream tests: shards in memory and on disk, an instrumented reader, and
the resume harness for bare stream pipelines (loaders use harness.assert_resumes_identically).

Record values are chosen so that each one names itself: record ``i`` of shard ``s`` is
``s * 1000 + i`` (in memory), and token ``j`` of shard ``s`` is ``s * 1000 + j`` (on disk), so a
window's first token identifies it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness import assert_batches_equal, checkpoint_roundtrip
from resumable_data.streams import Stream


class MemoryShards:
    """``read_shard`` over in-memory shards of the given sizes; shard names are ``"m0"``, ``"m1"``, ..."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.names = [f"m{s}" for s in range(len(sizes))]
        self.records = {
            name: [s * 1000 + i for i in range(n)] for s, (name, n) in enumerate(zip(self.names, sizes, strict=True))
        }

    def __call__(self, shard: str, start: int) -> Iterator[int]:
        return iter(self.records[shard][start:])

    def all_records(self) -> list[int]:
        return [r for name in self.names for r in self.records[name]]


class CountingReader:
    """Wraps a reader and logs every call and every record offset it hands out (in-process only)."""

    def __init__(self, reader: Callable[[Any, int], Iterator[Any]]) -> None:
        self.reader = reader
        self.calls: list[tuple[str, int]] = []
        self.offsets_read: list[tuple[str, int]] = []

    def __call__(self, shard: Any, start: int) -> Iterator[Any]:
        self.calls.append((str(shard), start))
        for offset, record in enumerate(self.reader(shard, start), start=start):
            self.offsets_read.append((str(shard), offset))
            yield record


def write_token_shards(directory: Path, sizes: Sequence[int], *, suffix: str = ".bin") -> list[Path]:
    """uint16 token shards: token ``j`` of shard ``s`` is ``s * 1000 + j`` (so sizes stay <= 1000)."""
    paths = []
    for s, n in enumerate(sizes):
        tokens = (s * 1000 + np.arange(n)).astype(np.uint16)
        path = directory / f"tok_{s:03d}{suffix}"
        if suffix == ".npy":
            np.save(path, tokens)
        else:
            tokens.tofile(path)
        paths.append(path)
    return paths


def json_roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


def consume(stream: Any, epochs: int, stop: int | None = None, start_epoch: int = 0) -> tuple[list[Any], int]:
    """A training loop ``for epoch: set_epoch(epoch); for item in stream``, stopped after ``stop`` items.

    Returns the items and the epoch it was in when it stopped (what a trainer would save).
    """
    out: list[Any] = []
    for epoch in range(start_epoch, epochs):
        stream.set_epoch(epoch)
        for item in stream:
            out.append(item)
            if len(out) == stop:
                return out, epoch
    return out, epochs


def assert_stream_resumes_identically(make: Callable[[], Stream], cuts: Sequence[int], *, epochs: int = 2) -> None:
    """Stop after each cut (cumulative item counts), restore into a fresh pipeline, compare.

    States alternate between a JSON round-trip and torch.save + ``torch.load(weights_only=True)``.
    """
    reference, _ = consume(make(), epochs)
    resumed: list[Any] = []
    stream, epoch = make(), 0
    for n, cut in enumerate(itertools.chain(cuts, [None])):
        part, epoch = consume(stream, epochs, None if cut is None else cut - len(resumed), start_epoch=epoch)
        resumed += part
        if cut is None:
            break
        roundtrip = json_roundtrip if n % 2 == 0 else checkpoint_roundtrip
        state = roundtrip(stream.state_dict())
        stream = make()
        stream.load_state_dict(state)
    assert_batches_equal(reference, resumed)


def ids(batches: Sequence[Any]) -> list[int]:
    """Record ids in a list of batches (tensors of ids, or of token windows: first token)."""
    out: list[int] = []
    for batch in batches:
        tensor = batch[0] if isinstance(batch, (list, tuple)) else batch
        tensor = torch.as_tensor(tensor)
        out += (tensor[..., 0] if tensor.dim() > 1 else tensor.reshape(-1)).tolist()
    return out
