"""pack: token records concatenated into windows of ``block_size``; the state is a record key and an offset.

Specification: the windows are the records' tokens (each followed by ``eos``) in stream order, cut
every ``block_size`` tokens, the short last one dropped or padded; ``position_ids`` restart at each
window and each document; a resume anywhere (after map, shuffle_buffer, shuffle_window, mix; in
StreamLoader with 0 and 2 workers, on a rank of 2) is bitwise the uninterrupted run; a restore
re-reads at most the records of one window, and nothing before the first ``next()``; a layout
change hands out every token of the epoch exactly once; bad states are refused, naming the field,
and change nothing.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_resumes_identically, consume, json_roundtrip
from resumable_data import ResumeError
from resumable_data.streams import IterableSource, ShardedIterable, Stream, StreamLoader, cu_seqlens
from resumable_data.testing import assert_same
from streams_harness import TokenDocs, restore_reads, token_stream

UPSTREAMS = ["none", "map", "shuffle_buffer", "shuffle_window", "mix"]
LENGTHS = st.lists(st.lists(st.integers(0, 12), max_size=5), min_size=1, max_size=4)


def pipeline(lengths: Sequence[Sequence[int]], kind: str, block: int, **pack: Any) -> Callable[[], Stream]:
    def make() -> Stream:
        return token_stream(TokenDocs(lengths), kind).pack(block, **pack)

    return make


def expected_windows(records: list[Any], block: int, eos: int | None, pad_id: int | None) -> list[dict[str, list]]:
    """The reference packing, written out: the tokens in order, each document's position ids."""
    tokens: list[int] = []
    positions: list[int] = []
    for record in records:
        doc = torch.as_tensor(record).tolist() + ([] if eos is None else [eos])
        tokens += doc
        positions += range(len(doc))
    windows = []
    for start in range(0, len(tokens), block):
        window, where = tokens[start : start + block], positions[start : start + block]
        if len(window) < block:
            if pad_id is None:
                break
            window, where = window + [pad_id] * (block - len(window)), where + [-1] * (block - len(window))
        # Positions restart at the window's start and at each document's (and the padding's) start.
        restarted, previous = [], None
        for k, p in enumerate(where):
            starts = k == 0 or p == 0 or (p == -1 and previous != -1)
            restarted.append(0 if starts else restarted[-1] + 1)
            previous = p
        windows.append({"input_ids": window, "position_ids": restarted})
    return windows


@settings(max_examples=60, deadline=None)
@given(
    lengths=LENGTHS,
    kind=st.sampled_from(UPSTREAMS),
    block=st.integers(1, 9),
    eos=st.sampled_from([None, 0]),
    pad_id=st.sampled_from([None, 7]),
)
def test_windows_are_the_records_tokens_cut_every_block_size(lengths, kind, block, eos, pad_id) -> None:
    records = list(token_stream(TokenDocs(lengths), kind))
    got = list(pipeline(lengths, kind, block, eos=eos, pad_id=pad_id, boundaries=True)())
    expected = expected_windows(records, block, eos, pad_id)
    assert [{k: v.tolist() for k, v in window.items()} for window in got] == expected
    assert all(w["input_ids"].dtype == torch.int64 for w in got)
    plain = list(pipeline(lengths, kind, block, eos=eos, pad_id=pad_id)())
    assert [w.tolist() for w in plain] == [w["input_ids"] for w in expected]


@settings(max_examples=40, deadline=None)
@given(
    lengths=LENGTHS,
    kind=st.sampled_from(UPSTREAMS),
    block=st.integers(1, 9),
    eos=st.sampled_from([None, 0]),
    boundaries=st.booleans(),
    pad_id=st.sampled_from([None, 7]),
    cuts=st.lists(st.integers(0, 60), min_size=1, max_size=3),
)
def test_resumes_identically_anywhere(lengths, kind, block, eos, boundaries, pad_id, cuts) -> None:
    make = pipeline(lengths, kind, block, eos=eos, boundaries=boundaries, pad_id=pad_id)
    total = len(consume(make(), epochs=2))
    assert_resumes_identically(make, sorted(min(c, total) for c in cuts), epochs=2)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6), min_size=1, max_size=3),
    block=st.integers(1, 16),
    cut=st.integers(0, 30),
)
def test_a_restore_rereads_at_most_the_records_of_one_window(lengths, block, cut) -> None:
    make = pipeline(lengths, "none", block)
    state, following, resumed, counter = restore_reads(make, cut)
    assert_same(following, resumed)
    # Re-read: only the record the last window ended in, whose rest starts the next window.
    assert len(counter.all_keys) <= 1
    assert [list(key) for key in counter.all_keys] == state["carry"]
    for _, shard, doc in counter.all_keys:  # (unless that rest was the epoch's short last window)
        assert following is None or (int(following[0]) - 1) // 1000 == shard * 1000 + doc


@pytest.mark.parametrize(
    ("num_workers", "rank", "world_size", "kind"),
    [(0, 0, 1, "shuffle_buffer"), (2, 0, 1, "map"), (2, 1, 2, "shuffle_buffer"), (0, 1, 2, "mix")],
)
def test_stream_loader_resumes_identically(num_workers: int, rank: int, world_size: int, kind: str) -> None:
    lengths = [[5, 17, 3, 9, 1, 30], [12, 4, 8], [7, 7, 7, 2], [25, 3]]

    def make() -> StreamLoader:
        stream = pipeline(lengths, kind, 6, eos=0, boundaries=True)()
        return StreamLoader(stream, batch_size=2, num_workers=num_workers, rank=rank, world_size=world_size)

    assert_resumes_identically(make, [1, 4, 5], total=14)


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.lists(st.integers(0, 20), max_size=6), min_size=1, max_size=6),
    block=st.integers(1, 8),
    kind=st.sampled_from(UPSTREAMS),
    known=st.booleans(),
    worlds=st.lists(st.integers(1, 4), min_size=2, max_size=3),
    cut=st.integers(0, 4),
)
def test_a_layout_change_hands_out_every_token_exactly_once(lengths, block, kind, known, worlds, cut) -> None:
    """Ranks without workers here (processes are the next test's): a layout change is the states' arithmetic.
    (A shuffle window splits over a new layout only when read by position: with known sizes.)"""
    docs = TokenDocs(lengths)
    known = known or kind == "shuffle_window"
    seen: list[int] = []
    merged: dict[str, Any] | None = None
    for i, world in enumerate(worlds):
        ranks = [
            StreamLoader(
                token_stream(docs, kind, known=known).pack(block, pad_id=0), batch_size=2, rank=r, world_size=world
            )
            for r in range(world)
        ]
        for each in ranks:
            if merged is not None:
                each.load_state_dict(merged)
        seen += consume_ranks_tokens(ranks, None if i == len(worlds) - 1 else cut, 0)
        merged = json.loads(json.dumps(StreamLoader.merge_states([each.state_dict() for each in ranks])))
    assert Counter(seen) == Counter(t for r in token_stream(docs, kind) for t in torch.as_tensor(r).tolist())


def consume_ranks_tokens(loaders: list[StreamLoader], batches: int | None, pad: int) -> list[int]:
    seen: list[int] = []
    for each in loaders:
        each.set_epoch(each.epoch)
        seen += [t for batch in itertools.islice(iter(each), batches) for t in batch.reshape(-1).tolist() if t != pad]
    return seen


def test_a_layout_change_with_workers_hands_out_every_token_exactly_once() -> None:
    lengths = [[5, 17, 3, 9, 1, 30], [12, 4, 8], [7, 7, 7, 2], [25, 3], [40]]
    docs = TokenDocs(lengths)

    def make(world: int, workers: int, rank: int) -> StreamLoader:
        stream = token_stream(docs, "shuffle_buffer").pack(6, eos=None, pad_id=0)
        return StreamLoader(stream, batch_size=2, rank=rank, world_size=world, num_workers=workers)

    before = [make(1, 2, 0)]
    seen = consume_ranks_tokens(before, 3, 0)
    merged = json.loads(json.dumps(StreamLoader.merge_states([b.state_dict() for b in before])))
    assert sum(len(slot["source"]["carry"]) for slot in merged["slots"].values()) >= 1  # carried records to deal
    after = [make(3, 0, r) for r in range(3)]
    for each in after:
        each.load_state_dict(merged)
    seen += consume_ranks_tokens(after, None, 0)
    assert Counter(seen) == Counter(docs.all_tokens())


def state_after(make: Callable[[], Stream], n: int) -> tuple[Stream, dict[str, Any]]:
    stream = make()
    items = iter(stream)
    for _ in range(n):
        next(items)
    return stream, json_roundtrip(stream.state_dict())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("carry_offsets", [-1], "carry_offsets"),
        ("carry_offsets", [], "carry_offsets"),
        ("carry", [[0, 0]], "record key"),
        ("carry", [[0, 0, 10**6]], "not read yet"),
        ("carry", "x", "carry"),
        ("block_size", 5, "block_size"),
        ("eos", None, "eos"),
        ("boundaries", 1, "boundaries"),
    ],
)
def test_a_bad_state_is_refused_naming_the_field_and_changes_nothing(field: str, value: Any, message: str) -> None:
    make = pipeline([[30, 4, 9], [30, 6]], "none", 4, eos=0)
    _, state = state_after(make, 3)
    assert len(state["carry"]) == 1
    target, before = state_after(make, 2)
    bad = dict(state, **{field: value})
    with pytest.raises(ResumeError, match=message):
        target.load_state_dict(bad)
    assert json_roundtrip(target.state_dict()) == before
    assert_same(list(itertools.islice(target, 3)), list(itertools.islice(iter(make()), 2, 5)))


def test_a_carried_record_that_shrank_is_reported_as_changed_data() -> None:
    make = pipeline([[30, 4, 9]], "none", 4, eos=0)
    _, state = state_after(make, 3)  # 12 tokens of the 31-token first record handed out
    shorter = token_stream(TokenDocs([[10, 4, 9]]), "none").pack(4, eos=0)
    shorter.load_state_dict(state)
    with pytest.raises(ResumeError, match="the data changed"):
        next(iter(shorter))


def test_pack_needs_keyed_rereadable_token_records() -> None:
    docs = TokenDocs([[3, 4]])
    source = ShardedIterable(docs.names, read_shard=docs)
    with pytest.raises(TypeError, match="before batch"):
        source.batch(2).pack(4)
    with pytest.raises(TypeError, match="re-read"):
        IterableSource(lambda: iter([[1, 2]])).pack(4)
    with pytest.raises(TypeError, match="a token record must"):
        list(source.map(lambda d: torch.as_tensor(d, dtype=torch.float32)).pack(4))
    with pytest.raises(TypeError, match="re-read"):
        source.pack(4).shuffle_buffer(2)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=8), min_size=1, max_size=5),
    kind=st.sampled_from(["none", "shuffle_buffer", "shuffle_window", "mix"]),  # (map may crop all to 0)
    block=st.integers(1, 12),
    num_workers=st.sampled_from([0, 2]),
    boundaries=st.booleans(),
    cuts=st.lists(st.integers(0, 30), min_size=1, max_size=3),
)
def test_stream_loader_resumes_identically_anywhere(lengths, kind, block, num_workers, boundaries, cuts) -> None:
    def make() -> StreamLoader:
        stream = pipeline(lengths, kind, block, eos=0, boundaries=boundaries, pad_id=9)()
        return StreamLoader(stream, batch_size=3, num_workers=num_workers)

    epoch = len(list(make()))
    total = 2 * epoch + 1
    assert_resumes_identically(make, sorted(min(c, total) for c in cuts), total=total)


@pytest.mark.parametrize(
    "compose",
    [
        lambda docs: token_stream(docs, "shuffle_buffer").repeat(2).pack(7, eos=0),
        lambda docs: token_stream(docs, "shuffle_buffer").pack(7, eos=0).repeat(2),
        lambda docs: token_stream(docs, "none").filter(lambda d: len(d) % 2).pack(3, boundaries=True),
        lambda docs: (
            token_stream(docs, "map").pack(5).map(lambda w, g: w + torch.randint(0, 2, w.shape, generator=g), seed=1)
        ),
    ],
    ids=["repeat then pack", "pack then repeat", "filter then pack", "pack then map(seed=)"],
)
def test_pack_composes_with_repeat_filter_and_a_seeded_map(compose: Callable[[TokenDocs], Stream]) -> None:
    def make() -> Stream:
        return compose(TokenDocs([[5, 17, 3, 9, 1, 30], [12, 4, 8]]))

    total = len(consume(make(), epochs=2))
    for cut in range(0, total, 4):
        assert_resumes_identically(make, [cut], epochs=2)


def test_cu_seqlens_are_where_documents_and_windows_start() -> None:
    docs = TokenDocs([[3, 6, 2], [5]])
    batch = torch.stack([w["position_ids"] for w in token_stream(docs, "none").pack(4, boundaries=True)])
    seqlens = cu_seqlens(batch)
    assert seqlens.dtype == torch.int32
    lengths = (seqlens[1:] - seqlens[:-1]).tolist()
    # 16 tokens of documents 3, 6, 2, 5 (in the epoch's shard order) cut into windows of 4.
    assert sum(lengths) == batch.numel() == 16
    starts = {0, 4, 8, 12} | set(itertools.accumulate([len(d) for d in token_stream(docs, "none")][:-1]))
    assert seqlens[:-1].tolist() == sorted(starts)
