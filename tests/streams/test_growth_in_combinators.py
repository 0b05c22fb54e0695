"""Growth inside every combinator: sources grown since the checkpoint, behind mix, shuffles, pack, buckets.

The specification of ``growth=`` (see ``resumable_data.core.growth`` and tests/streams/
test_stream_growth.py), for any pipeline over sources that grew since the checkpoint:

* ``"append"``: the rest of the restored epoch hands out every token of the old data not handed
  out before the checkpoint and every token of the appended shards, exactly once (also when the
  pipeline had found the grown source exhausted, and from inside an epoch's last short window);
  the next epoch every token once;
* ``"next_epoch"``: the rest of the restored epoch is bitwise the uninterrupted run's over the
  checkpoint's data; the next epoch every token once;
* either way a checkpoint taken after the growth resumes bitwise.
* where that cannot hold, the load is refused, naming the alternative, and changes nothing: a
  window re-read from its start (``shuffle_window``, ``batch_by_tokens(bucket=)``) through a stage
  that reacts to where a grown source ended (mix, a shuffle) would read other records.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_resumes_identically, consume
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, Stream, StreamLoader, mix
from resumable_data.testing import assert_same
from streams_harness import MemoryShards, TokenDocs

PAD = 0  # TokenDocs never uses token 0


@dataclass(frozen=True)
class Recipe:
    """A pipeline: one or two sources (each grown or not), a shuffle, then records, pack or buckets."""

    old: tuple[tuple[tuple[int, ...], ...], ...]  # per source: the documents' lengths of each old shard
    new: tuple[tuple[tuple[int, ...], ...], ...]  # per source: those of the shards appended since
    growth: tuple[str, ...]  # per source
    known: bool
    shuffle: str  # "none", "buffer", "window"
    terminal: str  # "records", "pack", "bucket"

    def docs(self) -> TokenDocs:
        return TokenDocs([list(shard) for old, new in zip(self.old, self.new, strict=True) for shard in old + new])

    def build(self, docs: TokenDocs, *, grown: bool) -> Stream:
        sources: list[Stream] = []
        first = 0
        for i, (old, new) in enumerate(zip(self.old, self.new, strict=True)):
            count = len(old) + (len(new) if grown else 0)
            names = docs.names[first : first + count]
            sizes = docs.sizes[first : first + count] if self.known else None
            growth = self.growth[i] if grown else "error"
            sources.append(ShardedIterable(names, read_shard=docs, seed=10 + i, sizes=sizes, growth=growth))
            first += len(old) + len(new)
        stream = sources[0] if len(sources) == 1 else mix(sources, weights=[1, 2], seed=3)
        if self.shuffle == "buffer":
            stream = stream.shuffle_buffer(3, seed=4)
        elif self.shuffle == "window":
            stream = stream.shuffle_window(3, seed=4)
        if self.terminal == "pack":
            return stream.pack(5, pad_id=PAD)
        if self.terminal == "bucket":
            return stream.batch_by_tokens(12, bucket=3, seed=5, oversized="alone")
        return stream

    def tokens(self, docs: TokenDocs, *, grown: bool) -> Counter[int]:
        """Every token of an epoch over the old data (or the grown data)."""
        out: Counter[int] = Counter()
        first = 0
        for old, new in zip(self.old, self.new, strict=True):
            count = len(old) + (len(new) if grown else 0)
            out.update(t for name in docs.names[first : first + count] for doc in docs.docs[name] for t in doc)
            first += len(old) + len(new)
        return out

    def appended(self, docs: TokenDocs) -> Counter[int]:
        """The tokens of the shards appended to the sources built with growth="append"."""
        out: Counter[int] = Counter()
        first = 0
        for old, new, growth in zip(self.old, self.new, self.growth, strict=True):
            if growth == "append":
                names = docs.names[first + len(old) : first + len(old) + len(new)]
                out.update(t for name in names for doc in docs.docs[name] for t in doc)
            first += len(old) + len(new)
        return out


def tokens_of(items: list[Any]) -> Counter[int]:
    """The tokens handed out in ``items`` (records, pack windows, buckets), padding left out."""
    out: Counter[int] = Counter()
    for item in items:
        if isinstance(item, list) and item and not isinstance(item[0], int):
            out.update(tokens_of(item))
        else:
            out.update(t for t in torch.as_tensor(item).reshape(-1).tolist() if t != PAD)
    return out


def _open_reread_window(state: dict[str, Any], recipe: Recipe) -> bool:
    """Whether a restore re-reads an open window from its start through a stage that reacts to where
    a grown source ended (a mix, a shuffle under the buckets): what the specification refuses."""
    if not any(g == "append" and new for g, new in zip(recipe.growth, recipe.new, strict=True)):
        return False
    mixed = len(recipe.old) > 1
    if recipe.terminal == "bucket" and state["count"]:
        return mixed or recipe.shuffle != "none"
    window = state["source"] if recipe.terminal != "records" else state
    return recipe.shuffle == "window" and bool(window["count"]) and not window["positional"] and mixed


def _check_growth(recipe: Recipe, cut: int, later: int) -> None:
    docs = recipe.docs()
    stream = recipe.build(docs, grown=False)
    stream.set_epoch(0)
    items = iter(stream)
    before = [item for _, item in zip(range(cut), items, strict=False)]
    state = json.loads(json.dumps(stream.state_dict()))
    grown = recipe.build(docs, grown=True)
    fresh = grown.state_dict()
    if _open_reread_window(state, recipe):
        with pytest.raises(ResumeError, match="growth='next_epoch'"):
            grown.load_state_dict(state)
        assert grown.state_dict() == fresh  # a failed load changes nothing
        return
    grown.load_state_dict(state)
    rest = list(grown)
    if any(g == "append" for g in recipe.growth):
        assert tokens_of(before) + tokens_of(rest) == recipe.tokens(docs, grown=False) + recipe.appended(docs)
    else:  # the uninterrupted run over the checkpoint's data, bitwise
        assert_same(list(items), rest, "rest of the restored epoch")
    grown.set_epoch(1)
    assert tokens_of(list(grown)) == recipe.tokens(docs, grown=True)

    def restored() -> Stream:
        again = recipe.build(docs, grown=True)
        again.load_state_dict(state)
        return again

    total = len(consume(restored(), 2))
    assert_resumes_identically(
        restored, [min(later, total)], epochs=2, make_resumed=lambda: recipe.build(docs, grown=True)
    )


_docs = st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple)
_shards = st.lists(_docs, min_size=1, max_size=3).map(tuple)


@st.composite
def recipes(draw: st.DrawFn) -> Recipe:
    sources = draw(st.integers(1, 2))
    return Recipe(
        old=tuple(draw(_shards) for _ in range(sources)),
        new=tuple(draw(st.lists(_docs, min_size=0, max_size=2).map(tuple)) for _ in range(sources)),
        growth=tuple(draw(st.sampled_from(["append", "next_epoch"])) for _ in range(sources)),
        known=draw(st.booleans()),
        shuffle=draw(st.sampled_from(["none", "buffer", "window"])),
        terminal=draw(st.sampled_from(["records", "pack", "bucket"])),
    )


_CASES = {"recipe": recipes(), "cut": st.integers(0, 40), "later": st.integers(0, 60)}


@settings(max_examples=40, deadline=None)
@given(**_CASES)
def test_growth_inside_every_combinator_reads_each_token_once_or_is_refused(
    recipe: Recipe, cut: int, later: int
) -> None:
    _check_growth(recipe, cut, later)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None)
@given(**_CASES)
def test_growth_inside_every_combinator_wide(recipe: Recipe, cut: int, later: int) -> None:
    _check_growth(recipe, cut, later)


def _mix_of(shards: MemoryShards, first: int, *, growth: str = "error") -> Stream:
    """A mix of source A (shards m0.. up to ``first``) and source B (the last shard)."""
    a = ShardedIterable(shards.names[:first], read_shard=shards, seed=1, growth=growth)
    b = ShardedIterable(shards.names[-1:], read_shard=shards, seed=2)
    return mix([a, b], weights=[1, 1], seed=3)


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_a_mix_that_found_a_source_exhausted_reads_the_shards_appended_to_it(extra: int) -> None:
    shards = MemoryShards([2, 3, 8])  # A: m0, grown by m1; B: m2
    stream = _mix_of(shards, 1)
    records = stream.iter_keyed()
    seen = []
    while not stream.state_dict()["exhausted"][0]:
        seen.append(next(records)[1])
    seen += [next(records)[1] for _ in range(extra)]  # (B has records left after A ran out)
    state = json.loads(json.dumps(stream.state_dict()))
    grown = _mix_of(shards, 2, growth="append")
    grown.load_state_dict(state)
    assert Counter(seen + list(grown)) == Counter(shards.all_records())
    assert grown.state_dict()["exhausted"] == [True, True]


def test_a_stream_loader_over_a_mix_checkpointed_at_the_epochs_end_reads_the_appended_shards_in_that_epoch() -> None:
    shards = MemoryShards([2, 3, 4])
    loader = StreamLoader(_mix_of(shards, 1), batch_size=2)
    batches = len(list(StreamLoader(_mix_of(shards, 1), batch_size=2)))
    seen = [r for batch in itertools.islice(iter(loader), batches) for r in batch.tolist()]
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["epoch_done"] is False  # the loader has not asked for the batch after the last yet
    grown = StreamLoader(_mix_of(shards, 2, growth="append"), batch_size=2)
    grown.load_state_dict(state)
    rest = [r for batch in grown for r in batch.tolist()]
    assert grown.epoch == 0 and sorted(rest) == shards.records["m1"]
    assert sorted(seen + rest) == sorted(shards.all_records())


def _buckets(docs: TokenDocs, count: int, *, growth: str = "error") -> Stream:
    source = ShardedIterable(docs.names[:count], read_shard=docs, seed=1, growth=growth)
    return source.batch_by_tokens(8, bucket=4, seed=2)


@pytest.mark.parametrize("lengths", [[[3, 5, 2], [4, 1, 6, 2], [2, 2, 7]], [[1, 1, 1, 1, 1], [6, 6], [1, 7, 7]]])
def test_buckets_restored_inside_the_epochs_last_short_window_read_each_token_once_over_appended_shards(
    lengths: list[list[int]],
) -> None:
    docs = TokenDocs(lengths)
    batches = list(_buckets(docs, 2))
    for cut in range(len(batches) + 1):
        stream = _buckets(docs, 2)
        items = iter(stream)
        seen = [next(items) for _ in range(cut)]
        state = json.loads(json.dumps(stream.state_dict()))
        grown = _buckets(docs, 3, growth="append")
        grown.load_state_dict(state)
        assert tokens_of(seen + list(grown)) == Counter(docs.all_tokens()), f"cut {cut} of {len(batches)}"


def test_a_bucket_state_without_its_record_count_loads_and_is_refused_only_over_appended_shards() -> None:
    docs = TokenDocs([[3, 5, 2], [4, 1, 6, 2], [2, 2, 7]])
    stream = _buckets(docs, 2)
    items = iter(stream)
    next(items)
    state = json.loads(json.dumps(stream.state_dict()))
    assert state["count"] and state["records"] == 4  # a full window open
    del state["records"]  # as an earlier release wrote it
    same = _buckets(docs, 2)
    same.load_state_dict(state)
    assert_same(list(items), list(same), "an earlier release's state over the same data")
    grown = _buckets(docs, 3, growth="append")
    before = grown.state_dict()
    with pytest.raises(ResumeError, match=r"earlier release.*'records'.*growth='next_epoch'"):
        grown.load_state_dict(state)
    assert grown.state_dict() == before
