"""Fixtures shared by the stream tests: shards in memory and on disk, an instrumented reader, and a
way to read record ids out of batches. (The resume harness, for streams too, is tests/harness.py.)

Record values are chosen so that each one names itself: record ``i`` of shard ``s`` is
``s * 1000 + i`` (in memory), and token ``j`` of shard ``s`` is ``s * 1000 + j`` (on disk), so a
window's first token identifies it.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from resumable_data.streams import ShardedIterable, Stream, StreamLoader, mix


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


class FetchLog:
    """Wraps a stage's ``fetch_many`` to log each grouped re-read (a shuffle buffer's read-ahead pass,
    a pack's carried record) as the list of keys it asked for."""

    def __init__(self, stream: Any) -> None:
        self.calls: list[list[Any]] = []
        self._fetch_many = stream.fetch_many
        stream.fetch_many = self

    def __call__(self, keys: Sequence[Any]) -> list[Any]:
        self.calls.append(list(keys))
        return self._fetch_many(keys)

    @property
    def sizes(self) -> list[int]:
        """Keys asked for per call."""
        return [len(keys) for keys in self.calls]

    @property
    def all_keys(self) -> list[Any]:
        """Every key asked for, in order."""
        return [key for keys in self.calls for key in keys]


def restore_reads(make: Callable[[], Any], cut: int) -> tuple[dict[str, Any], Any, Any, FetchLog]:
    """Stop a stream after ``cut`` items and restore a fresh one from its JSON state, logging what the
    restored stage asks its source to re-read: ``(state, next item of the uninterrupted run, first
    item of the restored one, the log)``. Asserts that nothing is re-read before that first item."""
    stream = make()
    items = iter(stream)
    for _ in itertools.islice(items, cut):
        pass
    state = json.loads(json.dumps(stream.state_dict()))
    following = next(items, None)
    restored = make()
    log = FetchLog(restored.source)
    restored.load_state_dict(state)
    assert log.all_keys == [], "a restore re-read records before the first next()"
    return state, following, next(iter(restored), None), log


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


def ids(batches: Sequence[Any]) -> list[int]:
    """Record ids in a list of batches (tensors of ids, or of token windows: first token)."""
    out: list[int] = []
    for batch in batches:
        tensor = batch[0] if isinstance(batch, (list, tuple)) else batch
        tensor = torch.as_tensor(tensor)
        out += (tensor[..., 0] if tensor.dim() > 1 else tensor.reshape(-1)).tolist()
    return out


def consume_ranks(loaders: list[StreamLoader], batches_per_rank: list[int | None]) -> list[int]:
    """Run each rank's loader for its number of batches (None: to the end of the epoch)."""
    seen: list[int] = []
    for loader, n in zip(loaders, batches_per_rank, strict=False):
        loader.set_epoch(loader.epoch)  # stay in this epoch
        seen += ids(itertools.islice(iter(loader), n))
    return seen


def assert_exactly_once_across_layout_change(make_stream, all_records, old, new, cuts) -> None:
    """``old``/``new``: (world_size, num_workers); ``cuts``: batches each old rank takes."""
    before = [
        StreamLoader(make_stream(), batch_size=3, rank=r, world_size=old[0], num_workers=old[1]) for r in range(old[0])
    ]
    seen = consume_ranks(before, cuts)
    merged = json.loads(json.dumps(StreamLoader.merge_states([loader.state_dict() for loader in before])))
    after = [
        StreamLoader(make_stream(), batch_size=3, rank=r, world_size=new[0], num_workers=new[1]) for r in range(new[0])
    ]
    for loader in after:
        loader.load_state_dict(merged)
    seen += consume_ranks(after, [None] * new[0])
    assert Counter(seen) == Counter(all_records)


class TokenDocs:
    """``read_shard`` over in-memory token documents; shard names are ``"d0"``, ``"d1"``, ...

    Document ``i`` of shard ``s`` has ``lengths[s][i]`` (< 1000) tokens, token ``j`` being
    ``1 + s * 10**6 + i * 1000 + j``: unique, never 0 (free for an eos or a pad id), and naming its
    document. Even shards yield int32 tensors, odd ones lists: pack and batch_by_tokens take both.
    """

    def __init__(self, lengths: Sequence[Sequence[int]]) -> None:
        self.names = [f"d{s}" for s in range(len(lengths))]
        self.sizes = [len(docs) for docs in lengths]
        self.docs = {
            name: [[1 + s * 10**6 + i * 1000 + j for j in range(n)] for i, n in enumerate(docs)]
            for s, (name, docs) in enumerate(zip(self.names, lengths, strict=True))
        }

    def __call__(self, shard: str, start: int) -> Iterator[Any]:
        even = int(shard[1:]) % 2 == 0
        for doc in self.docs[shard][start:]:
            yield torch.tensor(doc, dtype=torch.int32) if even else list(doc)

    def all_tokens(self) -> list[int]:
        return [t for name in self.names for doc in self.docs[name] for t in doc]


def crop(doc: Any, generator: torch.Generator) -> torch.Tensor:
    """A per-record random crop: lengths change, so a re-read must go through the map again."""
    tokens = torch.as_tensor(doc, dtype=torch.int64)
    return tokens[: int(torch.randint(0, len(tokens) + 1, (1,), generator=generator))]


def token_stream(docs: TokenDocs, kind: str, *, known: bool = False) -> Stream:
    """A stream of token records: a sharded source, behind the stage ``kind``."""
    source = ShardedIterable(docs.names, read_shard=docs, seed=1, sizes=docs.sizes if known else None)
    if kind == "map":
        return source.map(crop, seed=2)
    if kind == "shuffle_buffer":
        return source.shuffle_buffer(3, seed=2)
    if kind == "shuffle_window":
        return source.shuffle_window(3, seed=2)
    if kind == "mix":
        reversed_docs = ShardedIterable(docs.names, read_shard=docs, seed=3).map(
            lambda d: torch.as_tensor(d, dtype=torch.int64).flip(0)
        )
        return mix([source, reversed_docs], weights=[1, 2], seed=4)
    return source
