"""``where_stream`` against the StreamLoader itself: the records it names are the ones a restored loader yields.

The specification: for a StreamLoader state over a positional pipeline (a ShardedIterable with known
sizes, optionally behind ``map`` and ``shuffle_window``), any shard sizes, batch size, window size,
drop_last, 0 or 2 workers, 1 or 2 ranks, any interruption point (also across epochs, and after a
resume into another layout, whose slots read pending records first),

* ``where_stream(state, pipeline, next=n)`` is, rank by rank, the ``(shard, record)`` of every record
  of the next ``n`` batches of a loader restored from the state (each record carries its own key);
* it reads no record: at 10**7 records, deep in the epoch, the reader is never called;
* the capability under it, ``Stream.upcoming_keys(n)``, is on a live pipeline (mid-iteration, also in
  a window of pending records) the keys its iteration yields next, reading nothing;
* a pipeline whose next records depend on the records it reads (shuffle_buffer, filter, mix, pack,
  take) or a source that reads by cursors is refused, the error naming the stage and what works.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from resumable_data import ResumeError
from resumable_data.position import where_stream
from resumable_data.streams import ShardedIterable, Stream, StreamLoader, mix
from resumable_data.streams.batch import Batch


class Reader:
    """Shard ``s{i}`` holds ``sizes[i]`` records, record ``r`` being ``[i, r]``; counts its calls."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.calls = 0

    def __call__(self, shard: str, start: int) -> Iterator[torch.Tensor]:
        self.calls += 1
        index = int(shard[1:])
        return (torch.tensor([index, r]) for r in range(start, self.sizes[index]))


def shifted(record: torch.Tensor) -> torch.Tensor:
    """A map that keeps the record's key readable: ``[i, r]`` -> ``[i, r + 10**6]``."""
    return record + torch.tensor([0, 10**6])


def build(config: dict[str, Any], reader: Reader | None = None) -> Stream:
    sizes = config["sizes"]
    stream: Stream = ShardedIterable(
        [f"s{i}" for i in range(len(sizes))], read_shard=reader or Reader(sizes), seed=config["seed"], sizes=sizes
    )
    if config["map"] == "below":
        stream = stream.map(shifted)
    if config["window"]:
        stream = stream.shuffle_window(config["window"], seed=config["seed"] + 1)
    if config["map"] == "above":
        stream = stream.map(shifted)
    return stream


def loader(config: dict[str, Any], rank: int, world: int, workers: int) -> StreamLoader:
    return StreamLoader(
        build(config),
        batch_size=config["batch_size"],
        drop_last=config["drop_last"],
        num_workers=workers,
        rank=rank,
        world_size=world,
        **({"timeout": 60} if workers else {}),  # a stuck worker fails the test instead of hanging it
    )


def run(loader: StreamLoader) -> Iterator[torch.Tensor]:
    """The loader's batches epoch after epoch, as a training loop reads them; ends at an epoch without one."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            return


def keys_of(batch: torch.Tensor, config: dict[str, Any]) -> list[tuple[str, int]]:
    offset = 10**6 if config["map"] is not None else 0
    return [(f"s{int(i)}", int(r) - offset) for i, r in batch.tolist()]


def states_after(config: dict[str, Any], world: int, workers: int, steps: int) -> list[dict[str, Any]]:
    """Every rank's state after ``steps`` batches each (ranks' epochs may end at different batches)."""
    loaders = [loader(config, r, world, workers) for r in range(world)]
    for each in loaders:
        for _ in itertools.islice(run(each), steps):
            pass
    return [each.state_dict() for each in loaders]


def check_against_loader(config: dict[str, Any], state: dict[str, Any], n: int, rank: int | None = None) -> None:
    """``where_stream``'s next ``n`` batches of each rank the state holds (or of ``rank``) are the
    restored loader's."""
    pipeline = build(config)
    report = where_stream(
        state, pipeline, batch_size=config["batch_size"], drop_last=config["drop_last"], next=n, rank=rank
    )
    world, workers = state["world_size"], state["num_workers"]
    for r in range(world) if rank is None else [rank]:
        restored = loader(config, r, world, workers)
        restored.load_state_dict(state)
        expected = [keys_of(b, config) for b in itertools.islice(run(restored), n)]
        named = [b.records for b in report.batches if b.rank == r]
        assert named == expected, (r, named, expected)


CONFIGS = st.fixed_dictionaries(
    {
        "sizes": st.lists(st.integers(1, 9), min_size=1, max_size=6),
        "batch_size": st.integers(1, 4),
        "window": st.sampled_from([None, 1, 3, 5, 16]),
        "map": st.sampled_from([None, "below", "above"]),  # a map below or above the window
        "drop_last": st.booleans(),
        "seed": st.integers(0, 2**16),
    }
)


def check_each_rank(config: dict[str, Any], world: int, workers: int, steps: int, n: int) -> None:
    states = states_after(config, world, workers, steps)
    for rank, state in enumerate(states):
        check_against_loader(config, state, n, rank)
    if len({state["epoch"] for state in states}) == 1:  # a training run's ranks stay in step
        check_against_loader(config, StreamLoader.merge_states(states), n)


@settings(max_examples=100, deadline=None)
@given(config=CONFIGS, world=st.sampled_from([1, 2]), steps=st.integers(0, 30), n=st.integers(1, 6))
def test_where_names_the_records_the_restored_loader_yields(config, world, steps, n):
    check_each_rank(config, world, 0, steps, n)


@pytest.mark.slow  # worker processes; the default suite has the deterministic cases below
@settings(max_examples=30, deadline=None)
@given(config=CONFIGS, world=st.sampled_from([1, 2]), steps=st.integers(0, 12), n=st.integers(1, 5))
def test_where_names_the_records_with_two_workers(config, world, steps, n):
    check_each_rank(config, world, 2, steps, n)


@settings(max_examples=15, deadline=None)
@given(
    config=CONFIGS,
    old=st.sampled_from([(1, 2), (2, 0), (2, 2)]),
    new_world=st.sampled_from([1, 2]),
    steps=st.integers(0, 8),
    more=st.integers(0, 6),
    n=st.integers(1, 6),
)
def test_where_after_a_layout_change_names_the_pending_records_first(config, old, new_world, steps, more, n):
    # Resumed into another layout, each slot first reads the records the old slots held (pending),
    # a shuffle window of them at a time; the state is taken some batches into that.
    states = states_after(config, *old, steps)
    assume(len({state["epoch"] for state in states}) == 1)
    loaders = [loader(config, r, new_world, 0) for r in range(new_world)]
    for each in loaders:
        each.load_state_dict(StreamLoader.merge_states(states))
        for _ in itertools.islice(run(each), more):
            pass
    for rank, each in enumerate(loaders):
        check_against_loader(config, each.state_dict(), n, rank)


WIDE = {"sizes": [9, 9, 9, 9, 7], "batch_size": 2, "window": 5, "map": None, "drop_last": False, "seed": 0}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_two_workers_deal_round_robin_from_the_slot_the_state_names_next(world, steps):
    # The cases hypothesis may not draw: the next batch comes from worker 1, then 0, then 1...
    check_each_rank(WIDE, world, 2, steps, 5)


@pytest.mark.parametrize("window", [3, 5])
@pytest.mark.parametrize("more", [0, 1, 2])
def test_a_resume_into_fewer_slots_reads_the_held_records_first(window, more):
    # 4 old slots each hold an open window; resumed into 1 slot they are its pending records, read
    # as windows of their own (more than one with window=3): a state before any (more=0), inside
    # the first (1) and later (2).
    config = {**WIDE, "window": window}
    merged = StreamLoader.merge_states(states_after(config, 2, 2, 1))
    resumed = loader(config, 0, 1, 0)
    resumed.load_state_dict(merged)
    for _ in itertools.islice(run(resumed), more):
        pass
    state = resumed.state_dict()
    assert state["slots"]["0"]["source"]["source"]["pending"] or more  # the case is the pending one
    check_against_loader(config, state, 8, 0)


def test_one_ranks_own_state_answers_for_that_rank():
    config = {"sizes": [5, 7, 3], "batch_size": 2, "window": 3, "map": None, "drop_last": False, "seed": 1}
    ranks = [loader(config, r, 2, 0) for r in range(2)]
    for each in ranks:
        next(iter(each))
    report = where_stream(ranks[1].state_dict(), build(config), batch_size=2, next=2)
    assert {b.rank for b in report.batches} == {1}
    assert report.batches[0].batch == 1
    assert [b.records for b in report.batches] == [keys_of(b, config) for b in itertools.islice(run(ranks[1]), 2)]
    with pytest.raises(ResumeError, match=r"rank should be one whose slots the state holds \(\[1\]"):
        where_stream(ranks[1].state_dict(), build(config), batch_size=2, rank=0)


def test_a_pipeline_ending_in_batch_gives_the_batch_size():
    config = {"sizes": [4, 6], "batch_size": 3, "window": 2, "map": "below", "drop_last": True, "seed": 5}
    plain = StreamLoader(build(config).batch(3, drop_last=True))
    next(iter(plain))
    report = where_stream(plain.state_dict(), build(config).batch(3, drop_last=True), next=3)
    assert [b.records for b in report.batches] == [keys_of(b, config) for b in itertools.islice(run(plain), 3)]
    with pytest.raises(ResumeError, match="batch_size is 2, but the pipeline batches by 3"):
        where_stream(plain.state_dict(), build(config).batch(3), batch_size=2)


def test_a_state_deep_in_an_epoch_of_ten_million_records_is_answered_without_reading():
    sizes = [1_000_000] * 10
    config = {"sizes": sizes, "batch_size": 64, "window": 10_000, "map": "below", "drop_last": False, "seed": 3}
    reader = Reader(sizes)
    pipeline = build(config, reader)
    # Move the source 7,654,321 records into its epoch (seek reads nothing), then take 5 records of the
    # window opened there: a state as deep as a run's 119,598th batch.
    pipeline.source.positional().seek(7_654_321)
    records = iter(pipeline)
    for _ in range(5):
        next(records)
    fresh = StreamLoader(build(config), batch_size=64)
    state = {**fresh.state_dict(), "slots": {"0": Batch(pipeline, 64).state_dict()}}
    counted = Reader(sizes)
    began = time.perf_counter()
    report = where_stream(state, build(config, counted), batch_size=64, next=4)
    elapsed = time.perf_counter() - began
    assert counted.calls == 0
    assert elapsed < 2.0, f"{elapsed:.2f} s: the answer must not grow with the position"
    restored = StreamLoader(build(config), batch_size=64)
    restored.load_state_dict(state)
    assert [b.records for b in report.batches] == [keys_of(b, config) for b in itertools.islice(run(restored), 4)]


REFUSED: dict[str, tuple[str, Callable[[Stream], Stream]]] = {
    "shuffle_buffer": ("ShuffleBuffer", lambda s: s.shuffle_buffer(4, seed=0)),
    "filter": ("Filter", lambda s: s.filter(lambda r: int(r[1]) % 2 == 0)),
    "take": ("Take", lambda s: s.take(5)),
    "mix": ("Mix", lambda s: mix([s, build(SMALL)], seed=0)),
    "window over a filter": ("Filter", lambda s: s.filter(lambda r: True).shuffle_window(3)),
}
SMALL = {"sizes": [5, 4, 6], "batch_size": 2, "window": None, "map": None, "drop_last": False, "seed": 0}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_stage_whose_records_depend_on_the_data_is_refused_by_name(name):
    stage, wrap = REFUSED[name]
    streamed = StreamLoader(wrap(build(SMALL)), batch_size=2)
    next(iter(streamed))
    with pytest.raises(
        ResumeError,
        match=rf"where: {stage} decides its next records by the records it reads.*"
        r"ShardedIterable with known sizes.*a replay",
    ):
        where_stream(streamed.state_dict(), wrap(build(SMALL)), batch_size=2)


def test_pack_is_refused_by_name():
    def tokens() -> Stream:
        return ShardedIterable(["a", "b"], read_shard=lambda s, start: iter([[1, 2, 3]] * (4 - start)), sizes=[4, 4])

    streamed = StreamLoader(tokens().pack(4), batch_size=1)
    next(iter(streamed))
    with pytest.raises(ResumeError, match="where: Pack decides its next records by the records it reads"):
        where_stream(streamed.state_dict(), tokens().pack(4), batch_size=1)


def test_a_source_read_by_cursors_is_refused():
    def cursors() -> Stream:
        return ShardedIterable(["s0", "s1"], read_shard=Reader([3, 4]), seed=0).shuffle_window(2)

    streamed = StreamLoader(cursors(), batch_size=2)
    next(iter(streamed))
    with pytest.raises(ResumeError, match="where: ShardedIterable reads by per-shard cursors"):
        where_stream(streamed.state_dict(), cursors(), batch_size=2)


def test_bad_arguments_are_named():
    streamed = StreamLoader(build(SMALL), batch_size=2)
    state = streamed.state_dict()
    with pytest.raises(ResumeError, match="batch_size: the state does not hold"):
        where_stream(state, build(SMALL))
    with pytest.raises(ResumeError, match="pipeline: expected the Stream of records"):
        where_stream(state, [1, 2], batch_size=2)  # type: ignore[arg-type]
    with pytest.raises(ResumeError, match="next"):
        where_stream(state, build(SMALL), batch_size=2, next=0)
    with pytest.raises(ResumeError, match="sizes"):  # another shard list than the checkpoint's
        where_stream(state, build({**SMALL, "sizes": [5, 4, 7]}), batch_size=2)


PIPELINE_MODULE = """
from resumable_data.streams import ShardedIterable


def read(shard, start):
    return iter([[int(shard[1:]), r] for r in range(start, 6)])


def build():
    return ShardedIterable(["s0", "s1", "s2"], read_shard=read, seed=4, sizes=[6, 6, 6]).shuffle_window(4, seed=1)
"""


def test_the_command_imports_the_pipeline_and_reads_a_checkpoint(tmp_path, monkeypatch, capsys):
    from resumable_data.__main__ import main
    from resumable_data.checkpoint import CheckpointManager

    (tmp_path / "where_stream_pipeline.py").write_text(PIPELINE_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import where_stream_pipeline  # the module the command imports, here to build the run

    streamed = StreamLoader(where_stream_pipeline.build(), batch_size=2, collate_fn=list)
    batches = iter(streamed)
    next(batches)
    CheckpointManager(tmp_path / "run").save(1, {"dataloader": streamed.state_dict()})
    argv = ["where", str(tmp_path / "run" / "step-00000001"), "--pipeline", "where_stream_pipeline:build"]
    assert main([*argv, "--batch-size", "2", "--next", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    expected = [" ".join(f"s{i}[{r}]" for i, r in next(batches)) for _ in range(2)]
    assert out[0].startswith("stream state /dataloader: epoch 0, world size 1, num_workers 0")
    assert [line.split(": ", 1)[1] for line in out[1:]] == expected
    for extra, fragment in [
        ([], "batch_size: the state does not hold"),
        (["--batch-size", "2", "--sample", "3"], "--sample: not with --pipeline"),
        (["--batch-size", "x"], "--batch-size: expected an integer"),
    ]:
        assert main([*argv, *extra]) == 1
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and fragment in err, err
    assert main([*argv[:3], "nowhere:build", "--batch-size", "2"]) == 1
    assert "--pipeline: cannot import 'nowhere'" in capsys.readouterr().err


@pytest.mark.parametrize("window", [None, 3, 5])
@pytest.mark.parametrize("taken", [0, 1, 4, 9])
def test_upcoming_keys_of_a_live_pipeline_are_the_keys_it_yields_next(window, taken):
    # Stream.upcoming_keys mid-iteration (where_stream asks freshly loaded pipelines): a slot resumed
    # into fewer slots, its pending records (held windows of the old slots) then its own positions.
    config = {**WIDE, "window": window}
    resumed = loader(config, 0, 1, 0)
    resumed.load_state_dict(StreamLoader.merge_states(states_after(config, 2, 2, 1)))
    reader = Reader(config["sizes"])
    pipeline = build(config, reader)
    Batch(pipeline, 1).load_state_dict(resumed.state_dict()["slots"]["0"])
    records = pipeline.iter_keyed()
    for _ in range(taken):
        next(records)
    calls = reader.calls
    upcoming = pipeline.upcoming_keys(12)
    assert reader.calls == calls
    assert upcoming == [key for key, _ in itertools.islice(records, 12)]
