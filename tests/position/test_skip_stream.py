"""``skip`` for a StreamLoader state: moved past whole batches of every rank, exactly accounted.

The specification, for a StreamLoader over a positional pipeline (a ShardedIterable with known sizes,
behind ``map`` and ``shuffle_window``), any shard sizes, batch and window sizes, drop_last, 0 or 2
workers, 1 or 2 ranks and interruption point:

* the moved state is the state the uninterrupted loader has after the skipped batches (each slot's
  position, the shards' identities, the batch counts that seed the global RNGs, the next worker),
  plus the record of what was skipped;
* a loader restored from it yields the uninterrupted run's batches after the skipped ones, bitwise,
  also with a ``map`` drawing from the global RNGs;
* the record (version 2, ``"skipped"``: each rank's skipped batch numbers) lasts the epoch through
  the loader's own ``state_dict()`` and ``merge_states``, and ``where`` reports those batches as
  ``skipped``; the next epoch, and a resume into another layout, drop it;
* ``skip CHECKPOINT --pipeline M:F`` publishes ``step-(N+1)`` and leaves ``step-N`` byte for byte;
* refused, naming what to do: a skip past a rank's end of the epoch, an epoch already over, a shuffle
  buffer (its records follow from the records read), an epoch whose layout changed at a resume.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_where_stream import CONFIGS, WIDE, build, keys_of, loader, states_after

from resumable_data import CheckpointManager, ResumeError
from resumable_data.__main__ import main
from resumable_data.position import skip_stream_state, where_stream
from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader


def done_of(state: dict[str, Any], rank: int) -> int:
    local = max(1, state["num_workers"])
    return sum(state["batches"][str(g)] for g in range(rank * local, (rank + 1) * local))


def without_record(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in state.items() if key not in ("version", "skipped")}


def check_skip(config: dict[str, Any], world: int, workers: int, steps: int, n: int) -> None:
    states = states_after(config, world, workers, steps)
    if len({state["epoch"] for state in states}) != 1:
        return  # a training run's ranks stay in step (the per-rank case below covers a rank alone)
    merged = StreamLoader.merge_states(states)
    epoch = merged["epoch"]
    # Each rank's uninterrupted batches, epoch by epoch, to the epoch after the next.
    runs = []
    for r in range(world):
        uninterrupted = loader(config, r, world, workers)
        runs.append([[keys_of(b, config) for b in uninterrupted] for _ in range(epoch + 3)])
    left = min(len(runs[r][epoch]) - done_of(merged, r) for r in range(world))
    kwargs = {"batch_size": config["batch_size"], "drop_last": config["drop_last"]}
    if merged["epoch_done"] or n > left:
        with pytest.raises(ResumeError, match=r"past the end of epoch|already over"):
            skip_stream_state(merged, build(config), batches=n, **kwargs)
        assert merged == StreamLoader.merge_states(states)  # the state given is not changed
        return
    moved = skip_stream_state(merged, build(config), batches=n, **kwargs)
    reference = StreamLoader.merge_states(states_after(config, world, workers, steps + n))
    assert without_record(moved) == without_record(reference)
    assert moved["version"] == 2
    assert moved["skipped"] == {str(r): [[done_of(merged, r), done_of(merged, r) + n]] for r in range(world)}
    for r in range(world):
        resumed = loader(config, r, world, workers)
        resumed.load_state_dict(moved)
        # Two passes: the epoch's rest and the next epoch (a rest with no batch left goes straight on
        # with the next epoch, as a restored loader does).
        after = [keys_of(b, config) for _ in range(2) for b in resumed]
        rest = runs[r][epoch][done_of(merged, r) + n :]
        assert after == (rest + runs[r][epoch + 1] if rest else runs[r][epoch + 1] + runs[r][epoch + 2])


@settings(max_examples=100, deadline=None)
@given(config=CONFIGS, world=st.sampled_from([1, 2]), steps=st.integers(0, 12), n=st.integers(1, 8))
def test_a_skipped_state_is_the_uninterrupted_state_after_the_skipped_batches(config, world, steps, n):
    check_skip(config, world, 0, steps, n)


@pytest.mark.slow  # worker processes; the default suite has the deterministic cases below
@settings(max_examples=20, deadline=None)
@given(config=CONFIGS, world=st.sampled_from([1, 2]), steps=st.integers(0, 8), n=st.integers(1, 5))
def test_a_skipped_state_with_two_workers(config, world, steps, n):
    check_skip(config, world, 2, steps, n)


@pytest.mark.parametrize(("steps", "n"), [(0, 1), (1, 2), (3, 3)])
def test_two_workers_skip_round_robin_from_the_slot_the_state_names_next(steps, n):
    check_skip(WIDE, 2, 2, steps, n)


def noisy(record: torch.Tensor) -> torch.Tensor:
    """An augmentation drawing from the global RNG, as users write them."""
    return torch.cat([record, torch.randint(0, 10**6, (1,))])


def test_batches_after_a_skip_draw_the_uninterrupted_runs_global_random_numbers():
    config = {**WIDE, "map": None}

    def pipeline():
        return build(config).map(noisy)

    def make(workers: int) -> StreamLoader:
        return StreamLoader(pipeline(), batch_size=2, num_workers=workers, **({"timeout": 60} if workers else {}))

    for workers in (0, 2):
        reference = [b for b in make(workers)]
        first = make(workers)
        for _ in itertools.islice(first, 2):
            pass
        moved = skip_stream_state(first.state_dict(), pipeline(), batches=3, batch_size=2)
        resumed = make(workers)
        resumed.load_state_dict(moved)
        after = list(resumed)
        assert len(after) == len(reference) - 5
        assert all(torch.equal(a, b) for a, b in zip(after, reference[5:], strict=True)), workers


def test_the_record_lasts_the_epoch_and_where_reports_the_skipped_batches():
    config = {**WIDE, "drop_last": True}
    ranks = [loader(config, r, 2, 0) for r in range(2)]
    for each in ranks:
        for _ in itertools.islice(each, 2):
            pass
    moved = skip_stream_state(
        StreamLoader.merge_states([each.state_dict() for each in ranks]),
        build(config),
        batches=3,
        batch_size=2,
        drop_last=True,
    )
    resumed = [loader(config, r, 2, 0) for r in range(2)]
    for each in resumed:
        each.load_state_dict(moved)
        for _ in itertools.islice(each, 1):
            pass
    later = StreamLoader.merge_states([each.state_dict() for each in resumed])
    assert later["version"] == 2 and later["skipped"] == {"0": [[2, 5]], "1": [[2, 5]]}
    report = where_stream(later, build(config), batch_size=2, drop_last=True, previous=5, rank=0)
    assert [(b.batch, b.status) for b in report.batches] == [
        (1, "read"),
        (2, "skipped"),
        (3, "skipped"),
        (4, "skipped"),
        (5, "read"),
    ]
    assert report.skipped == {0: [[2, 5]]} and "skipped batches: rank 0: [2, 5)" in report.lines()[0]
    # A second skip adjacent to the first extends its range.
    again = skip_stream_state(moved, build(config), batches=1, batch_size=2, drop_last=True)
    assert again["skipped"]["1"] == [[2, 6]]
    # The next epoch reads everything again: its states drop the record.
    for each in resumed:
        for _ in each:
            pass
        next(iter(each))
        assert "skipped" not in each.state_dict() and each.state_dict()["version"] == 1
    # A resume into another layout drops it too (the new ranks' batch numbers count other batches).
    one = loader(config, 0, 1, 0)
    one.load_state_dict(later)
    assert "skipped" not in one.state_dict()


def test_a_release_that_reads_version_1_only_would_refuse_the_record(monkeypatch):
    # The loader's version check accepts 1 and 2, and refuses 3 naming both.
    state = StreamLoader(build(WIDE), batch_size=2).state_dict()
    with pytest.raises(ResumeError, match="has version 3, but this resumable_data reads versions 1 and 2"):
        StreamLoader(build(WIDE), batch_size=2).load_state_dict({**state, "version": 3})
    with pytest.raises(ResumeError, match="has version 2 but is missing the key 'skipped'"):
        StreamLoader(build(WIDE), batch_size=2).load_state_dict({**state, "version": 2})
    bad = {**state, "version": 2, "skipped": {"0": [[0, 5]]}}  # past the 0 batches yielded
    fresh = StreamLoader(build(WIDE), batch_size=2)
    before = fresh.state_dict()
    with pytest.raises(ResumeError, match=r"'skipped' of rank 0 must be a list of 1 to 1024 \[start, end\] batch"):
        fresh.load_state_dict(bad)
    assert fresh.state_dict() == before


# -- refused ---------------------------------------------------------------------------------------


def test_a_skip_past_a_ranks_end_of_the_epoch_and_an_epoch_over_are_refused():
    config = {**WIDE, "sizes": [9, 9, 3]}  # rank 1 of 2 has fewer batches than rank 0
    states = states_after(config, 2, 0, 1)
    merged = StreamLoader.merge_states(states)
    lengths = [len(list(loader(config, r, 2, 0))) for r in range(2)]
    short = int(np.argmin(lengths))
    with pytest.raises(
        ResumeError, match=rf"past the end of epoch 0 for rank {short}, which has {min(lengths) - 1} of"
    ):
        skip_stream_state(merged, build(config), batches=min(lengths), batch_size=2)
    done = loader(config, 0, 1, 0)
    for _ in done:
        pass
    with pytest.raises(ResumeError, match=r"epoch 0 is already over.*skip from a checkpoint of the next epoch"):
        skip_stream_state(done.state_dict(), build(config), batches=1, batch_size=2)


def test_a_shuffle_buffer_and_a_changed_layout_are_refused_saying_what_to_do():
    buffered = StreamLoader(build(WIDE).shuffle_buffer(4, seed=0), batch_size=2)
    next(iter(buffered))
    with pytest.raises(ResumeError, match=r"skip: ShuffleBuffer decides its next records.*\.filter\(\.\.\.\)"):
        skip_stream_state(buffered.state_dict(), build(WIDE).shuffle_buffer(4, seed=0), batches=1, batch_size=2)
    two = StreamLoader.merge_states(states_after(WIDE, 2, 0, 1))
    one = loader(WIDE, 0, 1, 0)
    one.load_state_dict(two)  # resumed into another world size: pending records first
    next(iter(one))
    with pytest.raises(ResumeError, match="skip: the state's epoch changed layout at a resume"):
        skip_stream_state(one.state_dict(), build(WIDE), batches=1, batch_size=2)
    with pytest.raises(ResumeError, match=r"where: the state's epoch changed layout.*`where --next` still answers"):
        where_stream(one.state_dict(), build(WIDE), batch_size=2, previous=1)
    assert where_stream(one.state_dict(), build(WIDE), batch_size=2, next=1).batches


def test_a_state_built_for_another_batch_size_is_refused_not_answered():
    state = StreamLoader.merge_states(states_after(WIDE, 1, 0, 2))
    with pytest.raises(ResumeError, match="not where one uninterrupted round-robin over this pipeline puts them"):
        skip_stream_state(state, build(WIDE), batches=1, batch_size=3)


# -- shards on disk: identities ----------------------------------------------------------------------


def test_the_moved_state_holds_the_shard_identities_the_uninterrupted_one_does(tmp_path: Path):
    paths = []
    for s, size in enumerate([50, 70, 30]):
        path = tmp_path / f"tok_{s}.bin"
        (s * 1000 + np.arange(size * 2)).astype(np.uint16).tofile(path)
        paths.append(path)

    def pipeline():
        return ShardedIterable(paths, read_shard=TokenShardReader(2), seed=1).shuffle_window(16, seed=2)

    def state_after(n: int) -> dict[str, Any]:
        each = StreamLoader(pipeline(), batch_size=4)
        for _ in itertools.islice(each, n):
            pass
        return each.state_dict()

    for batches in (17, 18):  # to a window's end (closed), and 4 records into the next window
        moved = skip_stream_state(state_after(3), pipeline(), batches=batches, batch_size=4)
        assert without_record(moved) == without_record(state_after(3 + batches))
    held = moved["slots"]["0"]["source"]["source"]["identities"]
    assert held  # the open window's shards: checked when it is read again
    # The shards the moved state holds, rewritten since, are refused by name when read.
    for shard in held:
        target = paths[int(shard)]
        target.write_bytes(bytes(reversed(target.read_bytes())))
    resumed = StreamLoader(pipeline(), batch_size=4)
    resumed.load_state_dict(moved)
    names = "|".join(paths[int(shard)].name for shard in held)
    with pytest.raises(ResumeError, match=rf"({names}).*changed since the checkpoint"):
        list(resumed)


# -- the command -----------------------------------------------------------------------------------


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_skip_with_a_pipeline_publishes_the_next_step_and_leaves_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The training script's pipeline, in a module of the run's folder, as `--pipeline` imports it.
    (tmp_path / "skipdata.py").write_text(
        "from resumable_data.streams import ShardedIterable\n"
        "RECORDS = {f's{i}': [[i, r] for r in range(n)] for i, n in enumerate([9, 9, 9, 9, 7])}\n"
        "def read(shard, start):\n"
        "    import torch\n"
        "    return (torch.tensor(r) for r in RECORDS[shard][start:])\n"
        "def stream():\n"
        "    return ShardedIterable(list(RECORDS), read_shard=read, seed=0, sizes=[9, 9, 9, 9, 7]).shuffle_window(5, seed=1)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("skipdata", None)
    import skipdata

    ranks = [StreamLoader(skipdata.stream(), batch_size=2, rank=r, world_size=2) for r in range(2)]
    for each in ranks:
        for _ in itertools.islice(each, 2):
            pass
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(
            5, {"model": {"w": torch.ones(3)}, "dataloader": StreamLoader.merge_states([e.state_dict() for e in ranks])}
        )
    old = tmp_path / "run" / "step-00000005"
    before = digests(old)
    argv = ["skip", str(old), "--pipeline", "skipdata:stream", "--batch-size", "2", "--batches", "3"]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'run' / 'step-00000006'}"
    assert digests(old) == before
    with CheckpointManager(tmp_path / "run", lock=False) as manager:
        state = manager.load()["dataloader"]
    for r in range(2):
        resumed = StreamLoader(skipdata.stream(), batch_size=2, rank=r, world_size=2)
        resumed.load_state_dict(state)
        reference = [b.tolist() for b in StreamLoader(skipdata.stream(), batch_size=2, rank=r, world_size=2)]
        assert [b.tolist() for b in resumed] == reference[5:]
    new = str(tmp_path / "run" / "step-00000006")
    assert main(["where", new, "--pipeline", "skipdata:stream", "--batch-size", "2", "--previous", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count(") skipped:") == 6 and out.count(") read:") == 2, out
    assert main(["skip", new, "--pipeline", "skipdata:stream", "--batch-size", "2", "--to-position", "3"]) == 1
    assert "to_position: a stream's state has no global position" in capsys.readouterr().err
    assert main(["skip", new, "--batches", "1"]) == 1
    assert "its data state is a StreamLoader's" in capsys.readouterr().err
