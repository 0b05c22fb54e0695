"""StreamLoader: exact resume with workers and ranks, exactly-once across a layout change.

With the checkpoint's layout the resumed batches are bitwise those of the uninterrupted run
(harness.assert_resumes_identically). With another num_workers or world size, the records consumed
before and after the change together are exactly the epoch's records (order may differ).
"""

from __future__ import annotations

import itertools
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_resumes_identically, checkpoint_roundtrip
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, ShuffleBuffer, Stream, StreamLoader, TokenShardReader, mix
from resumable_data.testing import assert_same
from streams_harness import (
    MemoryShards,
    assert_exactly_once_across_layout_change,
    ids,
    write_token_shards,
)

WINDOW = 9  # 8 inputs + 1 target


def augment(window: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token dropout plus noise, drawn only from the record's generator."""
    keep = torch.rand(window.shape, generator=g) > 0.1
    return window * keep, torch.randn(3, generator=g)


@pytest.fixture(scope="module")
def token_paths(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    # Uneven shards (one shorter than a window) so workers and ranks end at different times.
    return write_token_shards(tmp_path_factory.mktemp("tokens"), [97, 160, 5, 130, 64, 121, 88])


def realistic(paths: list[Path]) -> Stream:
    """token shards -> shuffle buffer -> random augmentation (the loader batches)."""
    source = ShardedIterable(paths, read_shard=TokenShardReader(WINDOW), seed=11)
    return source.shuffle_buffer(6, seed=12).map(augment, seed=13)


def epoch_batches(make_loader) -> int:
    return len(list(make_loader()))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_realistic_pipeline_resumes_identically(token_paths: list[Path], num_workers: int) -> None:
    def make() -> StreamLoader:
        return StreamLoader(realistic(token_paths), batch_size=4, num_workers=num_workers)

    n = epoch_batches(make)
    # mid-shard, twice at the same point, the epoch's last batch, inside the next epoch.
    assert_resumes_identically(make, [2, 5, 5, n, n + 3], total=n + 6)


def test_resume_at_a_shard_boundary(tmp_path: Path) -> None:
    paths = write_token_shards(tmp_path, [8 * WINDOW] * 4)

    def make() -> StreamLoader:
        return StreamLoader(
            ShardedIterable(paths, read_shard=TokenShardReader(WINDOW), seed=1, sizes="unknown"), batch_size=4
        )

    loader = make()
    list(itertools.islice(iter(loader), 2))
    assert loader.state_dict()["slots"]["0"]["source"]["remaining"][0][2] == 8  # shard just finished
    assert_resumes_identically(make, [2, 4, 6, 8], total=12)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_rank_resumes_identically(num_workers: int) -> None:
    shards = MemoryShards([7, 3, 9, 4, 6, 5, 8])

    def make() -> StreamLoader:
        stream = ShardedIterable(shards.names, read_shard=shards, seed=2).shuffle_buffer(3)
        return StreamLoader(stream, batch_size=2, rank=1, world_size=2, num_workers=num_workers)

    assert_resumes_identically(make, [1, 2, 4, 9], total=14)


def test_epoch_end_checkpoint_continues_with_the_next_epoch_not_an_empty_one() -> None:
    shards = MemoryShards([4, 4])
    loader = StreamLoader(ShardedIterable(shards.names, read_shard=shards), batch_size=4)
    epoch0 = list(itertools.islice(iter(loader), 2))  # the last batch, before StopIteration
    restored = StreamLoader(ShardedIterable(shards.names, read_shard=shards), batch_size=4)
    restored.load_state_dict(checkpoint_roundtrip(loader.state_dict()))
    epoch1 = list(restored)
    assert restored.epoch == 1 and len(epoch1) == 2
    assert sorted(ids(epoch0)) == sorted(ids(epoch1)) == shards.all_records()


# -- exactly once across a change of num_workers or world size ----------------------------------
@settings(max_examples=30)
@given(
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=7),
    old_world=st.integers(1, 3),
    new_world=st.integers(1, 4),
    buffer=st.integers(1, 5),
    cuts=st.lists(st.integers(0, 6), min_size=3, max_size=3),
)
def test_world_size_change_consumes_every_record_exactly_once(sizes, old_world, new_world, buffer, cuts) -> None:
    shards = MemoryShards(sizes)

    def make() -> Stream:
        return ShardedIterable(shards.names, read_shard=shards, seed=5).shuffle_buffer(buffer, seed=6)

    assert_exactly_once_across_layout_change(
        make, shards.all_records(), (old_world, 0), (new_world, 0), cuts[:old_world]
    )


@pytest.mark.parametrize(("old", "new"), [((1, 2), (1, 0)), ((2, 1), (1, 2))])
def test_num_workers_change_consumes_every_record_exactly_once(old, new) -> None:
    shards = MemoryShards([10, 4, 13, 7, 9])

    def make() -> Stream:
        return ShardedIterable(shards.names, read_shard=shards, seed=5).shuffle_buffer(4, seed=6)

    assert_exactly_once_across_layout_change(make, shards.all_records(), old, new, [5, 3])


def test_mixed_sources_change_world_size_exactly_once() -> None:
    web, books = MemoryShards([6, 9, 4]), MemoryShards([5, 8])
    books.records = {name: [r + 500 for r in records] for name, records in books.records.items()}

    def make() -> Stream:
        sources = [ShardedIterable(s.names, read_shard=s, seed=i) for i, s in enumerate((web, books))]
        return mix(sources, weights=[2, 1], seed=3).shuffle_buffer(4, seed=4)

    every = web.all_records() + books.all_records()
    assert_exactly_once_across_layout_change(make, every, (2, 0), (3, 0), [2, 4])


def test_layout_change_needs_every_ranks_state() -> None:
    shards = MemoryShards([5, 5, 5])
    state = StreamLoader(ShardedIterable(shards.names, read_shard=shards), rank=0, world_size=2).state_dict()
    loader = StreamLoader(ShardedIterable(shards.names, read_shard=shards), world_size=1)
    before = loader.state_dict()
    with pytest.raises(ResumeError, match=r"state lacks slots \[1\]; load StreamLoader.merge_states"):
        loader.load_state_dict(state)
    assert loader.state_dict() == before


def test_take_refuses_a_layout_change() -> None:
    shards = MemoryShards([5, 5, 5])
    state = StreamLoader(ShardedIterable(shards.names, read_shard=shards).take(4), num_workers=0).state_dict()
    loader = StreamLoader(ShardedIterable(shards.names, read_shard=shards).take(4), world_size=2)
    with pytest.raises(ResumeError, match="resume with the checkpoint's num_workers and world_size"):
        loader.load_state_dict(state)


@pytest.mark.parametrize("kwargs", [{"persistent_workers": True}, {"in_order": False}, {"shuffle": True}])
def test_dataloader_options_that_break_exactness_are_refused(kwargs) -> None:
    shards = MemoryShards([3])
    with pytest.raises(ResumeError):
        StreamLoader(ShardedIterable(shards.names, read_shard=shards), **kwargs)


def test_a_0_worker_loader_still_checks_dataloader_keywords_and_pins_through_a_dataloader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With 0 workers the slot's pipeline is iterated in this process without a DataLoader around
    it, yet a keyword a DataLoader refuses without workers is refused as before, and with
    ``pin_memory`` the batches still come through one (which pins them)."""
    shards = MemoryShards([6, 5])

    def loader(**kwargs: Any) -> StreamLoader:
        return StreamLoader(ShardedIterable(shards.names, read_shard=shards, seed=1), batch_size=2, **kwargs)

    with pytest.raises(ValueError, match="prefetch_factor"):
        next(iter(loader(prefetch_factor=2)))
    built: list[bool] = []
    real_iter = torch.utils.data.DataLoader.__iter__

    def counted_iter(self: torch.utils.data.DataLoader) -> Any:
        built.append(self.pin_memory)
        return real_iter(self)

    monkeypatch.setattr(torch.utils.data.DataLoader, "__iter__", counted_iter)
    expected = ids(loader())
    assert built == []  # no DataLoader iterated
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without an accelerator the DataLoader warns that it cannot pin
        assert ids(loader(pin_memory=True)) == expected
    assert built == [True]


def test_loader_state_is_small_and_plain(token_paths: list[Path]) -> None:
    loader = StreamLoader(realistic(token_paths), batch_size=4, world_size=2, rank=0)
    list(itertools.islice(iter(loader), 3))
    state = loader.state_dict()
    assert checkpoint_roundtrip(state) == json.loads(json.dumps(state))
    assert len(json.dumps(state)) < 1500  # 7 shards and 6 buffered keys


# -- a restore validates once, and the loader's own pipeline goes on from where it stands -------
class CheckCountingBuffer(ShuffleBuffer):
    """A shuffle buffer that counts how often a state is validated (``check``) on it."""

    def __init__(self, source: Stream, size: int, *, seed: int = 0) -> None:
        super().__init__(source, size, seed=seed)
        self.checks = 0

    def check(self, state: Any) -> Callable[[], None]:
        self.checks += 1
        return super().check(state)


def test_restore_validates_the_state_once_with_0_workers() -> None:
    shards = MemoryShards([40, 30, 50])

    def make() -> tuple[StreamLoader, CheckCountingBuffer]:
        buffer = CheckCountingBuffer(ShardedIterable(shards.names, read_shard=shards, seed=3), 10, seed=4)
        return StreamLoader(buffer, batch_size=4), buffer

    reference, _ = make()
    expected = ids(itertools.islice(iter(reference), 12))
    loader, _ = make()
    list(itertools.islice(iter(loader), 5))
    restored, buffer = make()
    restored.load_state_dict(checkpoint_roundtrip(loader.state_dict()))
    assert buffer.checks == 1
    got = ids(itertools.islice(iter(restored), 3))
    got += ids(itertools.islice(iter(restored), 4))  # stopped and iterated again: goes on, no reload
    assert buffer.checks == 1
    assert got == expected[5 * 4 :]


def test_a_batch_that_raised_is_produced_again_from_its_start() -> None:
    """With 0 workers an error inside a batch leaves the pipeline mid-batch: the next iter() reloads
    the state after the last batch handed out, so the stream still equals the uninterrupted one."""
    shards = MemoryShards([40, 30, 50])
    failures = {"left": 0, "at": -1}

    def fail_once(record: int) -> int:
        if record == failures["at"] and failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("transient read error")
        return record

    def make() -> StreamLoader:
        stream = ShardedIterable(shards.names, read_shard=shards, seed=3).shuffle_buffer(10, seed=4).map(fail_once)
        return StreamLoader(stream, batch_size=4)

    expected = ids(make())
    failures["at"] = expected[10]  # a record of the third batch
    loader = make()
    got = ids(itertools.islice(iter(loader), 2))
    failures["left"] = 1
    batches = iter(loader)
    with pytest.raises(RuntimeError, match="transient"):
        while True:
            got += ids([next(batches)])
    got += ids(loader)
    assert got == expected


@pytest.mark.parametrize(
    ("rank1_kwargs", "field"),
    [({"seed": 3}, "seed"), ({"buffer": 4}, "size"), ({"names": ["m0", "m1", "m2", "m3", "m5", "m4"]}, "digest")],
)
def test_merge_states_refuses_ranks_whose_pipelines_differ(rank1_kwargs: dict[str, Any], field: str) -> None:
    shards = MemoryShards([4, 4, 4, 4, 4, 4])

    def loader(rank: int, *, seed: int = 2, buffer: int = 3, names: list[str] = shards.names) -> StreamLoader:
        stream = ShardedIterable(names, read_shard=shards, seed=seed).shuffle_buffer(buffer, seed=1)
        return StreamLoader(stream, batch_size=2, rank=rank, world_size=2)

    ranks = [loader(0), loader(1, **rank1_kwargs)]
    for r in ranks:
        list(itertools.islice(iter(r), 2))
    with pytest.raises(ResumeError, match=rf"rank 0 \(slot 0\) and rank 1 \(slot 1\).*{field}"):
        StreamLoader.merge_states([r.state_dict() for r in ranks])
    StreamLoader.merge_states([loader(0).state_dict(), loader(1).state_dict()])  # the same pipelines merge


def _tag_process(record: int) -> tuple[int, bool]:
    return record, torch.utils.data.get_worker_info() is None


@pytest.mark.parametrize("warm_start", [None, False])
def test_warm_start_serves_a_passs_first_batch_from_the_main_process(warm_start: bool | None) -> None:
    shards = MemoryShards([6, 6, 6, 6])

    def make() -> StreamLoader:
        stream = ShardedIterable(shards.names, read_shard=shards, seed=1).map(_tag_process)
        return StreamLoader(stream, batch_size=2, num_workers=2, warm_start=warm_start, timeout=60)

    loader = make()
    batches = list(itertools.islice(iter(loader), 3))
    restored = make()
    restored.load_state_dict(loader.state_dict())
    rest = list(restored)
    in_main = [bool(batch[1].all()) for batch in batches + rest]
    warm = warm_start is None
    assert in_main == [warm, False, False, warm] + [False] * (len(rest) - 1)
    assert sorted(ids([b[0] for b in batches + rest])) == shards.all_records()


class _CountedChecks(ShardedIterable):
    """A source that counts the states it checks in this process (workers count in their copies)."""

    checks = 0

    def check(self, state: Any) -> Callable[[], None]:
        _CountedChecks.checks += 1
        return super().check(state)


@pytest.mark.parametrize("workers_after", [2, 1])
def test_the_warm_batch_after_a_restore_checks_no_state_twice_and_resumes_exactly(workers_after: int) -> None:
    """The restore applies the next slot's state last, so the main process hands out the warm batch
    from it without checking it again: one check per slot state in this process (plus one per old
    slot across a layout change), and the rest of the epoch is the uninterrupted one's."""
    sizes = [6, 5, 7, 4, 6]
    shards = MemoryShards(sizes)

    def make(workers: int) -> StreamLoader:
        stream = _CountedChecks(shards.names, read_shard=shards, seed=1, sizes=sizes).shuffle_window(5, seed=2)
        return StreamLoader(stream, batch_size=2, num_workers=workers, timeout=60)

    loader = make(2)
    iterator = iter(loader)
    before = list(itertools.islice(iterator, 3))
    state = loader.state_dict()
    expected = ids(before + list(iterator)) if workers_after == 2 else None
    restored = make(workers_after)
    _CountedChecks.checks = 0
    restored.load_state_dict(state)
    rest = iter(restored)
    after = [next(rest)]
    assert _CountedChecks.checks == workers_after + (2 if workers_after != 2 else 0)
    after += list(rest)
    if expected is not None:
        assert ids(before + after) == expected
    assert sorted(ids(before + after)) == shards.all_records()


@pytest.mark.parametrize("num_workers", [0, 2])
@settings(max_examples=6, deadline=None)
@given(cut=st.integers(min_value=1, max_value=30))
def test_a_state_without_the_last_batch_handed_out_resumes_at_that_batch(
    token_paths: list[Path], num_workers: int, cut: int
) -> None:
    """``state_dict(unconsumed=1)`` after ``cut`` batches: a caller that fetched one batch ahead
    (Lightning's fetcher over a loader without len) resumes at the batch it did not use, and the
    rest of the run (the next epoch too) is the uninterrupted one's, bitwise."""

    def make() -> StreamLoader:
        return StreamLoader(realistic(token_paths), batch_size=4, num_workers=num_workers)

    n = epoch_batches(make)
    reference = list(itertools.islice(endless_batches(make()), cut + 12))
    loader = make()
    batches = endless_batches(loader)
    list(itertools.islice(batches, cut))
    assert loader.batches_yielded == (cut % n or n)  # at an epoch's end: still that epoch's n
    plain = loader.state_dict()  # Lightning saves this first; the take-back must still work after it
    taken_back = checkpoint_roundtrip(loader.state_dict(unconsumed=1))
    assert plain != taken_back
    resumed = make()
    resumed.load_state_dict(taken_back)
    got = list(itertools.islice(endless_batches(resumed), 13))
    assert_same(reference[cut - 1 : cut + 12], got, "the batches after the restore")


def test_taking_back_more_than_the_last_batch_is_refused(token_paths: list[Path]) -> None:
    loader = StreamLoader(realistic(token_paths), batch_size=4)
    with pytest.raises(ResumeError, match="unconsumed=1"):
        loader.state_dict(unconsumed=1)  # nothing handed out yet
    batches = iter(loader)
    next(batches)
    with pytest.raises(ResumeError, match="unconsumed=2"):
        loader.state_dict(unconsumed=2)
    assert loader.state_dict(unconsumed=1) == StreamLoader(realistic(token_paths), batch_size=4).state_dict()
    next(batches)  # asking for the next batch folds the first in: it can no longer be taken back
    assert loader.batches_yielded == 2
    loader.state_dict(unconsumed=1)  # (the second one can)


def endless_batches(loader: StreamLoader):
    """Every batch of epoch after epoch, as a training loop iterates a loader."""
    while True:
        yield from loader
