"""States at the edges of what a stream stage holds: the end of a text file, counters near their bound.

Specifications:

* a text shard whose last line has no newline resumes from every point of the epoch, including
  right after that last line (its cursor is then the file's size), alone and behind a shuffle
  buffer that re-reads it; a cursor inside a line is still refused, also at the end of a file that
  grew since;
* a ``draws`` counter anywhere up to its bound (``2**63 - 1``) loads and iterates: the draws
  continue the hash sequence ``hash_ints(seed, epoch, d)`` the module docstrings define; a state
  beyond the bound is refused naming the field and the bound, and the failed load changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from harness import assert_resumes_identically, json_roundtrip
from resumable_data import ResumeError
from resumable_data.core.hash import hash_ints
from resumable_data.streams import ShardedIterable, Stream, TextLineReader, mix
from streams_harness import MemoryShards

MAX_COUNT = 2**63 - 1


def _unterminated_jsonl(tmp_path: Path) -> list[Path]:
    """Two JSONL shards whose last lines have no newline (as many editors and exporters write them)."""
    paths = []
    for s, count in enumerate((3, 4)):
        path = tmp_path / f"part{s}.jsonl"
        path.write_text("\n".join(json.dumps({"id": s * 100 + i}) for i in range(count)))
        paths.append(path)
    return paths


@pytest.mark.parametrize("stage", ["none", "shuffle_buffer"])
def test_a_text_shard_without_a_final_newline_resumes_from_every_point(tmp_path: Path, stage: str) -> None:
    paths = _unterminated_jsonl(tmp_path)

    def make() -> Stream:
        stream: Stream = ShardedIterable(paths, read_shard=TextLineReader(json.loads), seed=4)
        return stream.shuffle_buffer(3, seed=5) if stage == "shuffle_buffer" else stream

    total = 2 * 7
    for cut in range(total + 1):  # every point of two epochs, each end of a shard among them
        assert_resumes_identically(make, [cut], epochs=2)


def test_a_cursor_at_the_end_of_a_file_without_a_final_newline_is_its_size(tmp_path: Path) -> None:
    path = _unterminated_jsonl(tmp_path)[0]
    stream = ShardedIterable([path], read_shard=TextLineReader(json.loads), shuffle=False)
    records = iter(stream)
    assert [next(records)["id"] for _ in range(3)] == [0, 1, 2]
    state = json_roundtrip(stream.state_dict())
    assert state["remaining"] == [[0, str(path), path.stat().st_size]]
    restored = ShardedIterable([path], read_shard=TextLineReader(json.loads), shuffle=False)
    restored.load_state_dict(state)
    assert list(restored) == []
    # The last line continued since the checkpoint: the cursor now lies inside a line.
    path.write_text(path.read_text() + "5}\n")
    grown = ShardedIterable([path], read_shard=TextLineReader(), shuffle=False, allow_changed_shards=True)
    grown.load_state_dict(state)
    with pytest.raises(ResumeError, match=r"byte offset \d+ is not at the start of a line"):
        next(iter(grown))


def _buffer(shards: MemoryShards) -> Stream:
    return ShardedIterable(shards.names, read_shard=shards, seed=1).shuffle_buffer(4, seed=2)


def _mix(shards: MemoryShards) -> Stream:
    sources = [ShardedIterable([name], read_shard=shards, seed=1) for name in shards.names]
    return mix(sources, seed=3)


def _drained_buffer(shards: MemoryShards, state: dict, draws: int) -> list[int]:
    """What a shuffle buffer whose source has ended yields from ``state``, by its definition: draw
    ``d`` takes slot ``hash_ints(seed, epoch, d) % len(buffer)``, which the last record fills."""
    buffer = list(state["buffer"])
    out = []
    for d in range(draws, draws + len(buffer)):
        slot = hash_ints(2, state["epoch"], d) % len(buffer)
        out.append(buffer[slot])
        buffer[slot] = buffer[-1]
        buffer.pop()
    return [shards.records[shards.names[shard]][offset] for _, shard, offset in out]


def _mixed(shards: MemoryShards, state: dict, draws: int) -> list[int]:
    """What a mix of equal weights over unread sources yields from draw ``draws`` on, by its
    definition: draw ``d`` picks among the running sources with ``hash_ints(seed, epoch, d) / 2**64``;
    a pick of a source that has ended drops it."""
    left = [list(shards.records[name]) for name in shards.names]
    running = list(range(len(left)))
    out = []
    d = draws
    while running:
        u = hash_ints(3, state["epoch"], d) / 2.0**64 * len(running)
        source = running[min(int(u), len(running) - 1)]
        d += 1
        if left[source]:
            out.append(left[source].pop(0))
        else:
            running.remove(source)
    return out


@pytest.mark.parametrize("draws", [MAX_COUNT, MAX_COUNT - 1, MAX_COUNT - 300])
@pytest.mark.parametrize(
    ("make", "expected", "skip"), [(_buffer, _drained_buffer, 2), (_mix, _mixed, 0)], ids=["shuffle_buffer", "mix"]
)
def test_draws_near_their_bound_load_and_continue_the_hash_sequence(
    make: Callable[[MemoryShards], Stream],
    expected: Callable[[MemoryShards, dict, int], list[int]],
    skip: int,
    draws: int,
) -> None:
    shards = MemoryShards([2, 2])
    stream = make(shards)
    records = iter(stream)
    for _ in range(skip):  # a shuffle buffer of 4: filled with every record, then draining
        next(records)
    state = json_roundtrip(stream.state_dict())
    state["draws"] = draws
    restored = make(shards)
    restored.load_state_dict(state)
    assert list(restored) == expected(shards, state, draws)


@pytest.mark.parametrize("make", [_buffer, _mix], ids=["shuffle_buffer", "mix"])
def test_draws_beyond_their_bound_are_refused_and_change_nothing(make: Callable[[MemoryShards], Stream]) -> None:
    shards = MemoryShards([2, 2])
    stream = make(shards)
    before = stream.state_dict()
    state = json_roundtrip(before)
    state["draws"] = MAX_COUNT + 1
    with pytest.raises(ResumeError, match=r"field 'draws' must be at most 2\*\*63 - 1"):
        stream.load_state_dict(state)
    assert stream.state_dict() == before
