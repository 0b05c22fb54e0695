"""A shuffle buffer's restore re-reads its records ahead of the draws, grouped by shard, bitwise exact.

Specifications: a restore reads nothing until the first ``next()``, which re-reads the records the
next 64 draws pick (all of a smaller buffer), each shard opened once per read, not once per
record; the second read covers 64 draws again, later ones 256, 1024, ... draws, then the rest, so
every buffered record is read exactly once, within about ``size`` draws; a generic reader is
called once per run of consecutive records; the records come back in their buffer slots, so the
resumed stream equals the uninterrupted one, also when it is checkpointed again before every
record was re-read; a failed re-read changes nothing and names the shard.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_resumes_identically, json_roundtrip
from resumable_data import ResumeError
from resumable_data.streams import (
    ShardedIterable,
    Stream,
    StreamLoader,
    TextLineReader,
    TokenShardReader,
    mix,
    readers,
)
from resumable_data.testing import assert_same
from streams_harness import CountingReader, FetchLog, MemoryShards, write_token_shards

WINDOW = 4  # 250 windows per shard of 1000 tokens


class OpenCountingTokenReader(TokenShardReader):
    """A TokenShardReader that counts how often it maps each shard (every read goes through tokens())
    and logs each re-read (``read_records``) as ``(shard name, offsets)``."""

    def __init__(self, window: int) -> None:
        super().__init__(window)
        self.opens: Counter[str] = Counter()
        self.rereads: list[tuple[str, list[int]]] = []

    def tokens(self, shard: Any) -> np.ndarray:
        self.opens[Path(shard).name] += 1
        return super().tokens(shard)

    def read_records(self, shard: Any, offsets: Sequence[int]) -> list[torch.Tensor]:
        self.rereads.append((Path(shard).name, list(offsets)))
        return super().read_records(shard, offsets)


def buffered_shards(state: dict[str, Any]) -> set[int]:
    return {key[1] for key in state["buffer"]}


def run_starts(keys: list[list[int]], names: list[str]) -> list[tuple[str, int]]:
    """``(shard name, first offset)`` of each run of consecutive offsets among ``(epoch, shard, offset)`` keys."""
    starts = []
    for shard in sorted({key[1] for key in keys}):
        offsets = sorted(key[2] for key in keys if key[1] == shard)
        starts += [
            (names[shard], b) for a, b in zip([None, *offsets[:-1]], offsets, strict=True) if a is None or b != a + 1
        ]
    return starts


def state_and_continuation(make, cut: int, tail: int) -> tuple[dict[str, Any], list[Any]]:
    """The JSON state after ``cut`` items, and the ``tail`` items an uninterrupted run yields next."""
    stream = make()
    iterator = iter(stream)
    for _ in range(cut):
        next(iterator)
    state = json_roundtrip(stream.state_dict())
    return state, list(itertools.islice(iterator, tail))


@pytest.mark.parametrize(
    ("buffer", "cut"),
    # full buffers mid-epoch, one just filled, one small enough to be read at once, draining ones
    [(300, 700), (300, 301), (64, 1100), (500, 1400), (500, 1300), (1000, 1000)],
)
def test_token_buffer_restore_reads_ahead_of_the_draws_grouped_by_shard(tmp_path: Path, buffer: int, cut: int) -> None:
    paths = write_token_shards(tmp_path, [1000] * 6)

    def make(reader: TokenShardReader | None = None) -> Stream:
        return ShardedIterable(paths, read_shard=reader or TokenShardReader(WINDOW), seed=4).shuffle_buffer(
            buffer, seed=5
        )

    state, expected = state_and_continuation(make, cut, 10**6)
    buffered = len(state["buffer"])
    assert buffered == min(buffer, 6 * 1000 // WINDOW - cut)
    counting = OpenCountingTokenReader(WINDOW)
    restored = make(counting)
    passes = FetchLog(restored.source)
    restored.load_state_dict(state)
    assert not counting.opens  # nothing is read before the first next()
    items = iter(restored)
    got = list(itertools.islice(items, 1))
    # The first item re-reads what the next 64 draws pick (all of a buffer of <= 64), never the
    # whole of a larger buffer, with one map per shard, not one per record.
    first_read = sum(len(offsets) for _, offsets in counting.rereads)
    assert (first_read == buffered) if buffered <= 64 else (0 < first_read <= 64)
    assert len(counting.rereads) == len({name for name, _ in counting.rereads})
    # A first batch that needs a little more than 64 draws: the second read covers 64 draws again.
    got += itertools.islice(items, 99)
    assert sum(len(offsets) for _, offsets in counting.rereads) <= 128
    got += items
    assert_same(got, expected)
    # Over the rest of the epoch every buffered record was read exactly once, in a few grouped
    # reads (64, 64, 256, 1024, ... draws, then the rest), each mapping a shard at most once.
    reread = Counter((name, offset) for name, offsets in counting.rereads for offset in offsets)
    assert reread == Counter((paths[key[1]].name, key[2]) for key in state["buffer"])
    assert len(passes.sizes) <= 2 + max(1, buffer // 64).bit_length() // 2
    assert len(counting.rereads) <= len(passes.sizes) * len(buffered_shards(state))


def test_a_checkpoint_taken_before_every_record_was_reread_resumes_identically(tmp_path: Path) -> None:
    paths = write_token_shards(tmp_path, [1000] * 6)

    def make() -> Stream:
        return ShardedIterable(paths, read_shard=TokenShardReader(WINDOW), seed=4).shuffle_buffer(400, seed=5)

    state, expected = state_and_continuation(make, 700, 10**6)
    got: list[Any] = []
    for step in (1, 3, 40, 150):  # resumed four times, each time with records still unread
        restored = make()
        restored.load_state_dict(state)
        items = iter(restored)
        got += itertools.islice(items, step)
        state = json_roundtrip(restored.state_dict())
        assert len(state["buffer"]) == 400
    restored = make()
    restored.load_state_dict(state)
    got += iter(restored)
    assert_same(got, expected)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    buffer=st.integers(1, 50),
    cut=st.integers(0, 150),
    seed=st.integers(0, 2**32),
)
def test_generic_reader_is_called_once_per_run_of_consecutive_records(sizes, buffer, cut, seed) -> None:
    shards = MemoryShards(sizes)

    def make(reader: Any = shards) -> Stream:
        return ShardedIterable(shards.names, read_shard=reader, seed=seed).shuffle_buffer(buffer, seed=seed)

    cut = min(cut, sum(sizes))
    state, expected = state_and_continuation(make, cut, 10**6)
    counting = CountingReader(shards)
    restored = make(counting)
    restored.load_state_dict(state)
    first = list(itertools.islice(iter(restored), 1))
    assert first == expected[:1]
    # One call per run of consecutive buffered records, each record read once; then the source's
    # own reads, each at a saved cursor.
    starts = run_starts(state["buffer"], shards.names)
    assert sorted(counting.calls[: len(starts)]) == sorted(starts)
    assert sorted(counting.offsets_read[: len(state["buffer"])]) == sorted(
        (shards.names[k[1]], k[2]) for k in state["buffer"]
    )
    cursors = {(name, cursor) for _, name, cursor in state["source"]["remaining"]}
    assert set(counting.calls[len(starts) :]) <= cursors
    assert first + list(iter(restored)) == expected


def test_text_buffer_restore_opens_each_file_once_per_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = []
    for s in range(4):
        path = tmp_path / f"part{s}.jsonl"
        path.write_text("".join(json.dumps({"shard": s, "line": i, "text": "x" * (i % 7)}) + "\n" for i in range(120)))
        paths.append(path)

    def make() -> Stream:
        return ShardedIterable(paths, read_shard=TextLineReader(json.loads), seed=2).shuffle_buffer(100, seed=3)

    state, expected = state_and_continuation(make, 250, 150)
    opened: list[str] = []
    real_open = open

    def counting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(Path(file).name)
        return real_open(file, *args, **kwargs)

    restored = make()
    passes = FetchLog(restored.source)
    restored.load_state_dict(state)
    monkeypatch.setattr(readers, "open", counting_open, raising=False)
    got = list(itertools.islice(iter(restored), 150))
    assert got == expected
    # 100 buffered lines: the first read covers 64 draws, the second the rest. Each read opens
    # each file it needs once; the source opens the files it continues reading, twice (once for
    # the shard's identity), and a finished one whose lines are buffered once for its identity.
    assert len(passes.sizes) == 2 and sum(passes.sizes) == 100
    continued = [Path(name).name for _, name, _ in state["source"]["remaining"]]
    finished = Counter(paths[s].name for s in buffered_shards(state)) - Counter(continued)
    rereads = Counter(opened) - Counter(continued + continued) - Counter(finished)
    assert set(rereads) == {paths[s].name for s in buffered_shards(state)}
    assert max(rereads.values()) <= 2


def test_map_and_mix_below_the_buffer_resume_identically(tmp_path: Path) -> None:
    code = write_token_shards(tmp_path, [1000, 1000, 600])
    (tmp_path / "prose").mkdir()
    prose = write_token_shards(tmp_path / "prose", [800, 1000])

    def noisy(window: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        return window * 10 + torch.randint(0, 10, window.shape, generator=g)

    def make() -> Stream:
        sources = [
            ShardedIterable(code, read_shard=TokenShardReader(WINDOW), seed=1).map(noisy, seed=7),
            ShardedIterable(prose, read_shard=TokenShardReader(WINDOW), seed=2),
        ]
        return mix(sources, weights=[2, 1], seed=3).shuffle_buffer(200, seed=4)

    for cut in (0, 1, 199, 200, 650, 1000):
        state, expected = state_and_continuation(make, cut, 10**6)
        restored = make()
        restored.load_state_dict(state)
        assert_same(list(iter(restored)), expected)


def test_failed_reread_changes_nothing_and_succeeds_once_the_shard_is_back(tmp_path: Path) -> None:
    paths = write_token_shards(tmp_path, [1000] * 3)

    def make() -> Stream:
        return ShardedIterable(paths, read_shard=TokenShardReader(WINDOW), seed=0, sizes="unknown").shuffle_buffer(
            100, seed=1
        )

    state, expected = state_and_continuation(make, 400, 10**6)
    # A finished shard that the buffer still holds records of (the source would report its own
    # current shard's truncation itself, at its cursor).
    finished = buffered_shards(state) - {index for index, _, _ in state["source"]["remaining"]}
    shard = max(finished, key=lambda s: max(k[2] for k in state["buffer"] if k[1] == s))
    highest = max(k[2] for k in state["buffer"] if k[1] == shard)
    path = paths[shard]
    backup = path.read_bytes()
    path.write_bytes(backup[: highest * WINDOW * 2])  # the window at `highest` is gone
    restored = make()
    restored.load_state_dict(state)
    items = iter(restored)
    got: list[Any] = []
    # The first read of the changed shard fails (at the latest once every record is read), on its
    # identity saved with the buffered records, and leaves the state after the last item handed out.
    with pytest.raises(
        ResumeError, match=rf"shard {shard} '.*{path.name}' \(read again by key from offset \d+\) changed since"
    ):
        while True:
            got.append(next(items))
            before = json_roundtrip(restored.state_dict())
    assert len(got) <= 100  # a buffer of 100 is read within its first 100 draws
    assert json_roundtrip(restored.state_dict()) == (before if got else state)
    path.write_bytes(backup)
    got += iter(restored)
    assert_same(got, expected)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 200), min_size=1, max_size=5),
    buffer=st.integers(65, 400),
    seed=st.integers(0, 2**32),
    cuts=st.lists(st.integers(0, 1200), min_size=1, max_size=4),
)
def test_buffers_larger_than_one_read_ahead_resume_identically(sizes, buffer, seed, cuts) -> None:
    """Restores whose re-reads span several reads: mid-epoch, while the buffer fills or drains,
    resumed again before every record was re-read, and into the next epoch."""
    shards = MemoryShards(sizes)

    def make() -> Stream:
        source = ShardedIterable(shards.names, read_shard=shards, seed=seed).filter(lambda r: r % 7 != 3)
        return source.shuffle_buffer(buffer, seed=seed).map(lambda r: r * 2)

    run_length = 2 * sum(1 for r in shards.all_records() if r % 7 != 3)  # two epochs
    assert_resumes_identically(make, sorted(min(c, run_length) for c in cuts), epochs=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_with_a_large_buffer_resumes_identically(tmp_path: Path, num_workers: int) -> None:
    paths = write_token_shards(tmp_path, [1000] * 6)

    def make() -> StreamLoader:
        stream = ShardedIterable(paths, read_shard=TokenShardReader(WINDOW), seed=4).shuffle_buffer(300, seed=5)
        return StreamLoader(stream, batch_size=8, num_workers=num_workers)

    # Mid-epoch; again after 1 and 9 batches (records of the restored buffer still unread); while
    # the buffer drains; in the next epoch.
    assert_resumes_identically(make, [40, 41, 50, 170, 200], 230)
