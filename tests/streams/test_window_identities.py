"""shuffle_window keeps the identities of the shards its open window holds: a changed one is refused.

Specification: a checkpoint inside a window (read by position with sizes=, or read from its source
without) holds records of shards it reads again on restore; a shard rewritten since (truncated, or
same size other content) is refused with a ResumeError naming it before any record is handed out,
unless ``allow_changed_shards=True``; unchanged shards resume bitwise. The state stays plain.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_shard_identity import RECORDS, parquet_shards, same_size_other_content, text_shards, token_shards, truncate

from harness import json_roundtrip
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, Stream

SOURCES = {
    "token by position": (token_shards, True),
    "parquet by position": (parquet_shards, True),
    "token read": (token_shards, False),
    "text read": (text_shards, False),
}


def windowed(paths: list[Path], reader: Any, known: bool, **options: Any) -> Stream:
    # 1.5 shards per window, shards in list order: the first window holds all of shard 0 (entered at
    # its start, so a window read from its source saves no identity for it) and half of shard 1.
    sizes = [RECORDS] * len(paths) if known else "unknown"
    source = ShardedIterable(paths, read_shard=reader, shuffle=False, sizes=sizes, **options)
    return source.shuffle_window(3 * RECORDS // 2, seed=1)


def values(records: list[Any]) -> list[Any]:
    return [r.tolist() if hasattr(r, "tolist") else r for r in records]


def cut_inside_the_first_window(tmp_path: Path, source: str) -> tuple[list[Path], Any, bool, dict[str, Any], Any]:
    make, known = SOURCES[source]
    paths, reader = make(tmp_path)
    stream = windowed(paths, reader, known)
    records = iter(stream)
    for _ in range(10):
        next(records)
    return paths, reader, known, json_roundtrip(stream.state_dict()), records


@pytest.mark.parametrize("damage", [truncate, same_size_other_content], ids=["truncated", "same size"])
@pytest.mark.parametrize("shard", [0, 1])
@pytest.mark.parametrize("source", list(SOURCES))
def test_a_shard_changed_under_an_open_window_is_refused_naming_it(
    tmp_path: Path, source: str, shard: int, damage: Callable[[Path], None]
) -> None:
    paths, reader, known, state, _ = cut_inside_the_first_window(tmp_path, source)
    damage(paths[shard])
    restored = windowed(paths, reader, known)
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=rf"shard {shard} '.*{paths[shard].name}' .* changed since the checkpoint"):
        next(iter(restored))
    allowed = windowed(paths, reader, known, allow_changed_shards=True)
    allowed.load_state_dict(state)
    if damage is same_size_other_content:  # a truncated shard may lack the records the window holds
        assert len(list(itertools.islice(iter(allowed), 3))) == 3  # read as the shards are now


@pytest.mark.parametrize("source", list(SOURCES))
def test_unchanged_shards_resume_the_open_window_identically(tmp_path: Path, source: str) -> None:
    paths, reader, known, state, records = cut_inside_the_first_window(tmp_path, source)
    assert state["source"]["identities"] or known is False  # by position: the window's shards
    restored = windowed(paths, reader, known)
    restored.load_state_dict(state)
    assert values(list(restored)) == values(list(records))
