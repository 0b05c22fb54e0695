"""A shuffle buffer keeps the identities of the shards it holds records of: a changed one is refused.

Specification: a checkpoint taken while a ``shuffle_buffer`` holds records of a shard its source has
already finished (so the source's own state no longer names that shard) carries that shard's
identity; a restore re-reading those records by key refuses the shard rewritten since (same size
other content, or truncated) with a ResumeError naming it, unless ``allow_changed_shards=True``,
with 0 and 2 workers and through a ``mix``. Unchanged shards resume bitwise, and a state without
those identities (as written before they were kept) still loads and resumes.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_shard_identity import same_size_other_content, truncate

from harness import json_roundtrip
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, Stream, StreamLoader, TextLineReader, TokenShardReader, mix

RECORDS = 200  # per shard: truncate() keeps 3/4 of a shard, dropping the records near its end
BUFFER = 32
CUT = 180  # records a slot hands out before the checkpoint: it has read 212, finishing its first shard


def token_shards(directory: Path, count: int) -> tuple[list[Path], Any]:
    paths = []
    for s in range(count):
        path = directory / f"tok_{s}.bin"
        (s * 1000 + np.arange(RECORDS * 2)).astype(np.uint16).tofile(path)
        paths.append(path)
    return paths, TokenShardReader(2)


def text_shards(directory: Path, count: int) -> tuple[list[Path], Any]:
    paths = []
    for s in range(count):
        path = directory / f"part{s}.txt"
        path.write_text("".join(f"{s:01d}{i:06d}\n" for i in range(RECORDS)))
        paths.append(path)
    return paths, TextLineReader()


KINDS = {"token": token_shards, "text": text_shards}
DAMAGES = {"same size": same_size_other_content, "truncated": truncate}


def buffered(paths: list[Path], reader: Any, **options: Any) -> Stream:
    # Shards in list order: slot s of S reads shards s, s + S, ... so shard s is the first it finishes.
    source = ShardedIterable(paths, read_shard=reader, shuffle=False, sizes="unknown", **options)
    return source.shuffle_buffer(BUFFER, seed=1)


def values(items: list[Any]) -> list[Any]:
    return [v.tolist() if hasattr(v, "tolist") else v for v in items]


def held_but_finished(pipeline_state: dict[str, Any]) -> set[int]:
    """Shards whose records the buffer holds although its source has finished them."""
    while "buffer" not in pipeline_state:  # the stages a loader adds above the buffer
        pipeline_state = pipeline_state["source"]
    source = pipeline_state["source"]
    being_read = {index for index, _, _ in source.get("remaining", [])}
    return {key[1] for key in pipeline_state["buffer"]} - being_read


def checkpoint_holding_a_finished_shard(tmp_path: Path, kind: str) -> tuple[list[Path], Any, Any, dict[str, Any]]:
    """Shards, their reader, the buffered pipeline's rest and its state after ``CUT`` records: the
    buffer then holds records of shard 0, which its source has finished."""
    paths, reader = KINDS[kind](tmp_path, 2)
    stream = buffered(paths, reader)
    records = iter(stream)
    for _ in range(CUT):
        next(records)
    state = json_roundtrip(stream.state_dict())
    assert held_but_finished(state) == {0}  # the checkpoint these tests are about
    return paths, reader, records, state


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_finished_shard_changed_under_the_buffer_is_refused_naming_it(tmp_path: Path, kind: str, damage: str) -> None:
    paths, reader, _, state = checkpoint_holding_a_finished_shard(tmp_path, kind)
    DAMAGES[damage](paths[0])
    restored = buffered(paths, reader)
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=rf"shard 0 '.*{paths[0].name}' \(read again by key .*\) changed since"):
        list(restored)
    allowed = buffered(paths, reader, allow_changed_shards=True)
    allowed.load_state_dict(state)
    if damage == "same size":  # a truncated shard lacks some of the buffered records
        assert len(list(allowed)) == 2 * RECORDS - CUT  # read as the shard is now


@pytest.mark.parametrize("kind", list(KINDS))
def test_unchanged_shards_resume_identically_and_a_state_without_held_identities_still_loads(
    tmp_path: Path, kind: str
) -> None:
    paths, reader, records, state = checkpoint_holding_a_finished_shard(tmp_path, kind)
    expected = values(list(records))
    assert "0" in state["source"]["identities"]
    older = copy.deepcopy(state)  # as written before the buffer kept its shards' identities
    del older["source"]["identities"]["0"]
    for saved in (state, older):
        restored = buffered(paths, reader)
        restored.load_state_dict(saved)
        assert values(list(restored)) == expected


def test_by_default_a_finished_shard_rewritten_under_the_buffer_is_refused_naming_it(tmp_path: Path) -> None:
    # The reader counts, so the source's state is a position; the buffer still carries the identity
    # of the finished shard it holds records of, and a same-count rewrite is refused on re-read.
    paths, reader = token_shards(tmp_path, 2)

    def make(**options: Any) -> Stream:
        return ShardedIterable(paths, read_shard=reader, shuffle=False, **options).shuffle_buffer(BUFFER, seed=1)

    stream = make()
    records = iter(stream)
    for _ in range(CUT):
        next(records)
    state = json_roundtrip(stream.state_dict())
    assert "position" in state["source"] and "0" in state["source"]["identities"]
    expected = values(list(records))
    same_size_other_content(paths[0])
    restored = make()
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=rf"shard 0 '.*{paths[0].name}' \(read again by key .*\) changed since"):
        list(restored)
    allowed = make(allow_changed_shards=True)
    allowed.load_state_dict(state)
    assert len(list(allowed)) == len(expected)  # read as the shard is now


def test_a_finished_shard_of_a_mixed_source_changed_under_the_buffer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    code, reader = token_shards(tmp_path / "a", 2)
    prose, _ = token_shards(tmp_path / "b", 2)

    def make() -> Stream:
        sources = [ShardedIterable(paths, read_shard=reader, shuffle=False, sizes="unknown") for paths in (code, prose)]
        return mix(sources, weights=[3, 1], seed=0).shuffle_buffer(BUFFER, seed=1)

    stream = make()
    records = iter(stream)
    for _ in range(260):  # code has read about 220 records: its shard 0 is finished
        next(records)
    state = json_roundtrip(stream.state_dict())
    code_state = {
        "source": state["source"]["sources"][0],
        "buffer": [k[:1] + k[2:] for k in state["buffer"] if k[1] == 0],
    }
    assert held_but_finished(code_state) == {0}
    same_size_other_content(code[0])
    restored = make()
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=rf"shard 0 '.*a/{code[0].name}' \(read again by key .*\) changed since"):
        list(restored)


LOADER_CASES = [
    pytest.param(
        kind, damage, workers, marks=[pytest.mark.slow] if workers and (kind, damage) != ("token", "same size") else []
    )
    for kind in KINDS
    for damage in DAMAGES
    for workers in (0, 2)
]


@pytest.mark.parametrize(("kind", "damage", "workers"), LOADER_CASES)
def test_a_loader_refuses_a_finished_shard_changed_under_a_worker_buffer(
    tmp_path: Path, kind: str, damage: str, workers: int
) -> None:
    """Each slot's buffer holds records of the first shard it finished (shard = slot); the state
    the loader builds from the workers' per-batch updates carries its identity."""
    paths, reader = KINDS[kind](tmp_path, 4)

    def make(**options: Any) -> StreamLoader:
        timeout = {"timeout": 60} if workers else {}  # a stuck worker fails the test
        return StreamLoader(buffered(paths, reader, **options), batch_size=10, num_workers=workers, **timeout)

    loader = make()
    slots = max(1, workers)
    batches = list(itertools.islice(iter(loader), CUT // 10 * slots))
    state = json_roundtrip(loader.state_dict())
    for slot in range(slots):
        assert held_but_finished(state["slots"][str(slot)]) == {slot}
    expected = sum(len(batch) for batch in make()) - sum(len(batch) for batch in batches)
    DAMAGES[damage](paths[0])
    restored = make()
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=rf"shard 0 '.*{paths[0].name}' \(read again by key .*\) changed since"):
        list(restored)
    allowed = make(allow_changed_shards=True)
    allowed.load_state_dict(state)
    if damage == "same size":
        assert sum(len(batch) for batch in allowed) == expected


def test_the_held_identities_go_with_each_batch_update_exactly(tmp_path: Path) -> None:
    """The per-batch path (state_update / apply_update, what a worker sends): applied in turn, the
    updates give state_dict() at every batch, identities of the finished shards held included."""
    paths, reader = token_shards(tmp_path, 3)
    stream = buffered(paths, reader).batch(7)
    state = copy.deepcopy(stream.state_dict())
    stream.state_update()
    seen: set[str] = set()
    for _ in stream:
        state = stream.apply_update(state, copy.deepcopy(stream.state_update()))
        assert state == stream.state_dict()
        seen |= set(state["source"]["source"]["identities"])
    assert seen == {"0", "1", "2"}


def carried_but_finished(pipeline_state: dict[str, Any]) -> set[int]:
    """Shards of records ``pack`` carries that neither the buffer below it holds nor its source reads."""
    buffer = pipeline_state["source"]
    source = buffer["source"]
    being_read = {index for index, _, _ in source.get("remaining", [])}
    held = {key[1] for key in buffer["buffer"]}
    return {key[1] for key in pipeline_state["carry"]} - held - being_read


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_finished_shard_changed_under_a_record_pack_carries_is_refused_naming_it(tmp_path: Path, damage: str) -> None:
    # pack re-reads its carried record by key on restore. Once the buffer has handed out the last
    # record of a shard its source has finished, the carried record is the only one of that shard
    # left, and (before pack passed it on with with_held) its identity was in no state.
    paths, reader = token_shards(tmp_path, 2)
    stream = buffered(paths, reader).pack(3)
    records = iter(stream)
    for _ in range(2 * RECORDS * 2 // 3 - 1):
        next(records)
        state = json_roundtrip(stream.state_dict())
        shards = carried_but_finished(state)
        if shards:
            break
    else:
        pytest.fail("no checkpoint where pack carries a record of a finished shard nothing else holds")
    (shard,) = shards
    DAMAGES[damage](paths[shard])
    restored = buffered(paths, reader).pack(3)
    restored.load_state_dict(state)
    with pytest.raises(
        ResumeError, match=rf"shard {shard} '.*{paths[shard].name}' \(read again by key .*\) changed since"
    ):
        list(restored)
