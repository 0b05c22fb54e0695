"""A shuffle buffer's restore re-reads its records grouped by shard, and stays bitwise exact.

Specifications: restoring a buffer of B records opens each shard it draws from once (plus the
source's current shard, which it continues reading), not once per record; a generic reader is
called once per run of consecutive records; the records come back in their buffer slots, so the
resumed stream equals the uninterrupted one; a failed re-read changes nothing.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import json_roundtrip
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, Stream, TextLineReader, TokenShardReader, mix, readers
from streams_harness import CountingReader, MemoryShards, write_token_shards

WINDOW = 4  # 250 windows per shard of 1000 tokens


class OpenCountingTokenReader(TokenShardReader):
    """A TokenShardReader that counts how often it maps each shard (every read goes through tokens())."""

    def __init__(self, window: int) -> None:
        super().__init__(window)
        self.opens: Counter[str] = Counter()

    def tokens(self, shard: Any) -> np.ndarray:
        self.opens[Path(shard).name] += 1
        return super().tokens(shard)


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


def assert_same(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert a == b


@pytest.mark.parametrize(("buffer", "cut"), [(300, 700), (300, 301), (64, 1100), (500, 1400)])
def test_token_buffer_restore_maps_each_shard_once(tmp_path: Path, buffer: int, cut: int) -> None:
    paths = write_token_shards(tmp_path, [1000] * 6)

    def make(reader: TokenShardReader | None = None) -> Stream:
        return ShardedIterable(paths, read_shard=reader or TokenShardReader(WINDOW), seed=4).shuffle_buffer(
            buffer, seed=5
        )

    state, expected = state_and_continuation(make, cut, 200)
    counting = OpenCountingTokenReader(WINDOW)
    restored = make(counting)
    restored.load_state_dict(state)
    assert not counting.opens  # lazy: nothing is read before the first next()
    assert_same(list(itertools.islice(iter(restored), 1)), expected[:1])
    # One map per buffered shard, never one per record; then the source's own reads from its
    # cursor (the next shard too when the current one was read to its end).
    remaining = state["source"]["remaining"]
    continued = remaining[:2] if remaining and remaining[0][2] == 1000 // WINDOW else remaining[:1]
    assert counting.opens == Counter(paths[s].name for s in buffered_shards(state)) + Counter(
        Path(name).name for _, name, _ in continued
    )
    assert len(state["buffer"]) == min(buffer, 6 * 1000 // WINDOW - cut)
    assert_same(list(itertools.islice(iter(restored), 199)), expected[1:])


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


def test_text_buffer_restore_opens_each_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
    restored.load_state_dict(state)
    monkeypatch.setattr(readers, "open", counting_open, raising=False)
    got = list(itertools.islice(iter(restored), 150))
    assert got == expected
    assert Counter(opened) - Counter(Path(name).name for _, name, _ in state["source"]["remaining"]) == Counter(
        paths[s].name for s in buffered_shards(state)
    )


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
        return ShardedIterable(paths, read_shard=TokenShardReader(WINDOW), seed=0).shuffle_buffer(100, seed=1)

    state, expected = state_and_continuation(make, 400, 50)
    shard = max(buffered_shards(state), key=lambda s: max(k[2] for k in state["buffer"] if k[1] == s))
    highest = max(k[2] for k in state["buffer"] if k[1] == shard)
    path = paths[shard]
    backup = path.read_bytes()
    path.write_bytes(backup[: highest * WINDOW * 2])  # the window at `highest` is gone
    restored = make()
    restored.load_state_dict(state)
    with pytest.raises(
        ResumeError, match=rf"{path.name}' has {highest} windows but the checkpoint needs the one at offset {highest}"
    ):
        next(iter(restored))
    assert restored.state_dict() == state
    path.write_bytes(backup)
    assert_same(list(itertools.islice(iter(restored), 50)), expected)
