"""batch_by_tokens: batches of consecutive records within a token budget; the state is one record key.

Specification: the batches are the records in stream order, each costing at most ``max_tokens``
(the sum of lengths, or ``len * longest`` when padded), each as large as the budget allows (the
next batch's first record would not fit); a record over the budget is an error naming it, or a
batch of its own; a resume anywhere (after map, shuffle_buffer, shuffle_window, mix; in
StreamLoader with 0 and 2 workers, on a rank of 2) is bitwise the uninterrupted run; a restore
re-reads at most the one record carried into the next batch, and nothing before the first
``next()``; a layout change batches every record exactly once; bad states are refused, naming the
field, and change nothing.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_resumes_identically, consume, json_roundtrip
from resumable_data import ResumeError
from resumable_data.streams import IterableSource, ShardedIterable, Stream, StreamLoader
from resumable_data.testing import assert_same
from streams_harness import TokenDocs, restore_reads, token_stream

KINDS = ["none", "map", "shuffle_buffer", "shuffle_window", "mix"]
LENGTHS = st.lists(st.lists(st.integers(0, 12), max_size=6), min_size=1, max_size=4)


def cost(lengths: list[int], padded: bool) -> int:
    return len(lengths) * max(lengths, default=0) if padded else sum(lengths)


def pipeline(lengths: list[list[int]], kind: str, max_tokens: int, **options: Any) -> Callable[[], Stream]:
    def make() -> Stream:
        return token_stream(TokenDocs(lengths), kind).batch_by_tokens(max_tokens, **options)

    return make


def as_lists(batches: list[list[Any]]) -> list[list[list[int]]]:
    return [[torch.as_tensor(record).tolist() for record in batch] for batch in batches]


@settings(max_examples=60, deadline=None)
@given(lengths=LENGTHS, kind=st.sampled_from(KINDS), max_tokens=st.integers(1, 30), padded=st.booleans())
def test_batches_are_the_records_in_order_each_as_large_as_the_budget_allows(lengths, kind, max_tokens, padded) -> None:
    records = [torch.as_tensor(r).tolist() for r in token_stream(TokenDocs(lengths), kind)]
    batches = as_lists(list(pipeline(lengths, kind, max_tokens, padded=padded, oversized="alone")()))
    assert [record for batch in batches for record in batch] == records
    sizes = [[len(record) for record in batch] for batch in batches]
    for batch, following in zip(sizes, [*sizes[1:], None], strict=False):
        assert batch
        assert cost(batch, padded) <= max_tokens or len(batch) == 1  # only an oversized record stands alone
        if following is not None:
            assert cost([*batch, following[0]], padded) > max_tokens  # greedy: the next record did not fit


def test_a_record_over_the_budget_is_an_error_naming_it_or_a_batch_of_its_own() -> None:
    lengths = [[3, 9, 2, 2]]
    with pytest.raises(ValueError, match=r"record \[0, 0, 1\] has 9 tokens, more than max_tokens=5"):
        list(pipeline(lengths, "none", 5)())
    alone = as_lists(list(pipeline(lengths, "none", 5, oversized="alone")()))
    assert [[len(r) for r in batch] for batch in alone] == [[3], [9], [2, 2]]


@settings(max_examples=40, deadline=None)
@given(
    lengths=LENGTHS,
    kind=st.sampled_from(KINDS),
    max_tokens=st.integers(1, 30),
    padded=st.booleans(),
    cuts=st.lists(st.integers(0, 30), min_size=1, max_size=3),
)
def test_resumes_identically_anywhere(lengths, kind, max_tokens, padded, cuts) -> None:
    make = pipeline(lengths, kind, max_tokens, padded=padded, oversized="alone")
    total = len(consume(make(), epochs=2))
    assert_resumes_identically(make, sorted(min(c, total) for c in cuts), epochs=2)


@settings(max_examples=40, deadline=None)
@given(lengths=LENGTHS, max_tokens=st.integers(12, 40), cut=st.integers(0, 10))
def test_a_restore_rereads_at_most_the_record_carried_into_the_next_batch(lengths, max_tokens, cut) -> None:
    make = pipeline(lengths, "shuffle_buffer", max_tokens)
    state, following, resumed, log = restore_reads(make, cut)
    assert_same(following, resumed)
    assert len(state["carry"]) <= 1
    assert [list(key) for key in log.all_keys] == state["carry"]


def collate(batch: list[Any]) -> torch.Tensor:
    """Pad to the longest record: what a training step takes."""
    longest = max(len(record) for record in batch)
    return torch.stack(
        [torch.nn.functional.pad(torch.as_tensor(r, dtype=torch.int64), (0, longest - len(r))) for r in batch]
    )


@pytest.mark.parametrize(
    ("num_workers", "rank", "world_size", "kind"),
    [(0, 0, 1, "shuffle_buffer"), (2, 0, 1, "map"), (2, 1, 2, "shuffle_window"), (0, 1, 2, "mix")],
)
def test_stream_loader_resumes_identically(num_workers: int, rank: int, world_size: int, kind: str) -> None:
    lengths = [[5, 17, 3, 9, 1, 30], [12, 4, 8], [7, 7, 7, 2], [25, 3]]

    def make() -> StreamLoader:
        stream = pipeline(lengths, kind, 32, padded=True, collate_fn=collate)()
        return StreamLoader(stream, num_workers=num_workers, rank=rank, world_size=world_size)

    assert_resumes_identically(make, [1, 3, 4], total=12)


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.lists(st.integers(1, 12), max_size=6), min_size=1, max_size=6),
    kind=st.sampled_from(KINDS),
    max_tokens=st.integers(12, 30),
    worlds=st.lists(st.integers(1, 4), min_size=2, max_size=3),
    cut=st.integers(0, 3),
)
def test_a_layout_change_batches_every_record_exactly_once(lengths, kind, max_tokens, worlds, cut) -> None:
    docs = TokenDocs(lengths)
    seen: list[int] = []
    merged: dict[str, Any] | None = None
    for i, world in enumerate(worlds):
        ranks = [
            StreamLoader(
                token_stream(docs, kind, known=kind == "shuffle_window").batch_by_tokens(max_tokens),
                rank=r,
                world_size=world,
            )
            for r in range(world)
        ]
        for each in ranks:
            if merged is not None:
                each.load_state_dict(merged)
        for each in ranks:
            each.set_epoch(each.epoch)
            batches = itertools.islice(iter(each), None if i == len(worlds) - 1 else cut)
            seen += [t for batch in batches for record in batch for t in torch.as_tensor(record).tolist()]
        merged = json.loads(json.dumps(StreamLoader.merge_states([each.state_dict() for each in ranks])))
    assert Counter(seen) == Counter(t for r in token_stream(docs, kind) for t in torch.as_tensor(r).tolist())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("carry", [[0, 0, 1], [0, 0, 2]], "at most one"),
        ("carry", [[0, 0]], "record key"),
        ("carry", [[0, 0, 10**6]], "not read yet"),
        ("carry", None, "carry"),
        ("max_tokens", 11, "max_tokens"),
        ("padded", 0, "padded"),
        ("oversized", "alone", "oversized"),
    ],
)
def test_a_bad_state_is_refused_naming_the_field_and_changes_nothing(field: str, value: Any, message: str) -> None:
    make = pipeline([[5, 4, 9, 3, 3], [6, 6, 6]], "none", 10)

    def after(n: int) -> tuple[Stream, dict[str, Any]]:
        stream = make()
        list(itertools.islice(iter(stream), n))
        return stream, json_roundtrip(stream.state_dict())

    _, state = after(2)
    assert len(state["carry"]) == 1
    target, before = after(1)
    with pytest.raises(ResumeError, match=message):
        target.load_state_dict(dict(state, **{field: value}))
    assert json_roundtrip(target.state_dict()) == before
    assert_same(list(target), list(itertools.islice(iter(make()), 1, None)))


def test_batch_by_tokens_needs_rereadable_records() -> None:
    docs = TokenDocs([[3, 4]])
    with pytest.raises(TypeError, match="re-read"):
        IterableSource([[1, 2]]).batch_by_tokens(4)
    with pytest.raises(TypeError, match="re-read"):
        ShardedIterable(docs.names, read_shard=docs).batch(2).batch_by_tokens(4)
    with pytest.raises(ValueError, match="oversized"):
        ShardedIterable(docs.names, read_shard=docs).batch_by_tokens(4, oversized="truncate")


# -- bucket=n: batches of similar lengths within windows of n records ------------------------------
@settings(max_examples=40, deadline=None)
@given(
    lengths=LENGTHS,
    kind=st.sampled_from(KINDS),
    max_tokens=st.integers(12, 40),
    padded=st.booleans(),
    bucket=st.integers(1, 8),
)
def test_bucketed_batches_cut_each_window_sorted_by_length(lengths, kind, max_tokens, padded, bucket) -> None:
    records = [torch.as_tensor(r).tolist() for r in token_stream(TokenDocs(lengths), kind)]
    batches = as_lists(list(pipeline(lengths, kind, max_tokens, padded=padded, bucket=bucket, seed=3)()))
    got = iter(batches)
    for start in range(0, len(records), bucket):
        window = records[start : start + bucket]
        mine, count = [], 0
        while count < len(window):
            batch = next(got)
            mine.append(batch)
            count += len(batch)
        assert sorted(r for batch in mine for r in batch) == sorted(window)  # the window's records, once
        for batch in mine:
            assert cost([len(r) for r in batch], padded) <= max_tokens
        # Cut from the window sorted by length: ordered by their shortest record, the batches'
        # lengths run through the sorted lengths.
        ordered = sorted(mine, key=lambda b: (min(map(len, b)), max(map(len, b))))
        assert [len(r) for batch in ordered for r in sorted(batch, key=len)] == sorted(map(len, window))
    assert next(got, None) is None


@settings(max_examples=30, deadline=None)
@given(
    lengths=LENGTHS,
    kind=st.sampled_from(KINDS),
    max_tokens=st.integers(12, 40),
    bucket=st.integers(1, 8),
    cuts=st.lists(st.integers(0, 30), min_size=1, max_size=3),
)
def test_bucketed_batches_resume_identically_anywhere(lengths, kind, max_tokens, bucket, cuts) -> None:
    make = pipeline(lengths, kind, max_tokens, padded=True, bucket=bucket, seed=1)
    total = len(consume(make(), epochs=2))
    assert_resumes_identically(make, sorted(min(c, total) for c in cuts), epochs=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bucketed_batches_resume_identically_in_stream_loader(num_workers: int) -> None:
    lengths = [[5, 17, 3, 9, 1, 30], [12, 4, 8], [7, 7, 7, 2], [25, 3]]

    def make() -> StreamLoader:
        stream = pipeline(lengths, "shuffle_buffer", 32, padded=True, collate_fn=collate, bucket=5)()
        return StreamLoader(stream, num_workers=num_workers)

    assert_resumes_identically(make, [1, 3, 4], total=12)


def test_a_bucketed_layout_change_is_refused_inside_a_window_and_exact_between_windows() -> None:
    docs = TokenDocs([[5, 17, 3, 9, 1, 30], [12, 4, 8], [7, 7, 7, 2], [25, 3]])

    def loader(rank: int, world: int) -> StreamLoader:
        return StreamLoader(token_stream(docs, "none").batch_by_tokens(30, bucket=4), rank=rank, world_size=world)

    def tokens(each: StreamLoader, n: int | None) -> list[int]:
        # No set_epoch: it would start the epoch over; a new iter() goes on where the loader stopped.
        return [t for batch in itertools.islice(each, n) for r in batch for t in torch.as_tensor(r).tolist()]

    def merged(ranks: list[StreamLoader]) -> dict[str, Any]:
        return json.loads(json.dumps(StreamLoader.merge_states([each.state_dict() for each in ranks])))

    ranks = [loader(r, 2) for r in range(2)]
    seen = [t for each in ranks for t in tokens(each, 1)]
    inside = merged(ranks)
    assert any(slot["count"] for slot in inside["slots"].values())  # a window partly handed out
    with pytest.raises(ResumeError, match=r"'count'.*between windows"):
        loader(0, 3).load_state_dict(inside)
    for r, each in enumerate(ranks):  # on to the end of each slot's open window
        while each.state_dict()["slots"][str(r)]["count"]:
            seen += tokens(each, 1)
    after = [loader(r, 3) for r in range(3)]
    between = merged(ranks)
    for each in after:
        each.load_state_dict(between)
        each.set_epoch(each.epoch)  # keeps the restored position; the pass ends with the epoch
        seen += tokens(each, None)
    assert Counter(seen) == Counter(docs.all_tokens())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("count", 99, "batches taken"), ("taken", 5, "batches taken"), ("bucket", 3, "bucket"), ("seed", 1, "seed")],
)
def test_a_bad_bucketed_state_is_refused_naming_the_field(field: str, value: Any, message: str) -> None:
    make = pipeline([[5, 4, 9, 3, 3], [6, 6, 6]], "none", 10, bucket=4)
    stream = make()
    next(iter(stream))
    state = json_roundtrip(stream.state_dict())
    assert state["count"] >= 2
    with pytest.raises(ResumeError, match=message):
        make().load_state_dict(dict(state, **{field: value}))
