"""``skip``: a new checkpoint whose data position is moved past a stretch, exactly accounted.

The specification:

* a loader restored from a skipped state yields the uninterrupted run's batches after the skipped
  range (rest of the epoch and the epochs after);
* the skipped samples count as consumed, not read: what was read before, what was skipped and what
  is read after are the epoch, each sample once — also when the rest is read by another number of ranks;
* the state records the range (version 4, ``"skipped"``) for the rest of its epoch, and ``where``
  reports those batches as skipped;
* ``skip CHECKPOINT`` publishes ``step-(N+1)``, which ``latest()`` selects and which loads; ``step-N``
  keeps every byte;
* refused, with one ``error:`` line naming the field and exit code 1: a skip past the epoch's end, an
  epoch already over, a backwards position, a stream's state, a checkpoint with a newer one after it.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures import make_states as saved
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_data import CheckpointManager, ResumableDataLoader, ResumeError
from resumable_data.__main__ import main
from resumable_data.position import skip, skip_state, where
from resumable_data.position.where import READ, SKIPPED

EPOCHS = 2


def make(length: int, batch_size: int, world: int, rank: int, **kwargs: Any) -> ResumableDataLoader:
    return ResumableDataLoader(
        torch.arange(length), batch_size=batch_size, world_size=world, rank=rank, seed=3, global_rng=None, **kwargs
    )


def batches_of(loader: ResumableDataLoader, epochs: int = EPOCHS) -> list[list[int]]:
    return [batch.tolist() for _ in loader.epochs(epochs) for batch in loader]


def state_after(loader: ResumableDataLoader, cut: int) -> dict[str, Any]:
    stream = (batch for _ in loader.epochs(EPOCHS) for batch in loader)
    for _ in itertools.islice(stream, cut):
        pass
    return loader.state_dict()


@settings(max_examples=30)
@given(
    length=st.integers(2, 40),
    batch_size=st.integers(1, 4),
    world=st.integers(1, 3),
    drop_last=st.booleans(),
    cut=st.integers(0, 30),
    skipped=st.integers(1, 8),
)
def test_a_skipped_state_resumes_with_the_batches_after_the_skipped_range(
    length: int, batch_size: int, world: int, drop_last: bool, cut: int, skipped: int
) -> None:
    for rank in range(world):
        reference = batches_of(make(length, batch_size, world, rank, drop_last=drop_last))
        per_epoch = len(reference) // EPOCHS
        if per_epoch == 0:
            return
        cut = cut % per_epoch  # within the first epoch, which has batches left
        skipped = min(skipped, per_epoch - cut)
        state = state_after(make(length, batch_size, world, 0, drop_last=drop_last), cut)
        moved = skip_state(state, batches=skipped)
        assert state["version"] == 2 and "skipped" not in state, "the given state is not changed"
        resumed = make(length, batch_size, world, rank, drop_last=drop_last)
        resumed.load_state_dict(moved)
        assert batches_of(resumed) == reference[cut + skipped :], f"rank {rank}"


def test_skipped_samples_are_consumed_not_read_also_at_another_world_size() -> None:
    length, size = 47, 3
    reference = [make(length, size, 2, rank) for rank in range(2)]
    head = [[b.tolist() for b in itertools.islice(iter(loader), 2)] for loader in reference]
    moved = skip_state(reference[0].state_dict(), to_position=2 * 2 * size + 5)  # not on a batch boundary
    (start, end), *_ = moved["skipped"]
    order = where(moved, positions=(start, end)).batches
    skipped_samples = [i for row in order for i in next(iter(row.indices.values()))]
    assert all(row.status == SKIPPED for row in order)
    tail = []
    for rank in range(3):  # the rest of the epoch on 3 ranks
        loader = make(length, size, 3, rank)
        loader.load_state_dict(moved)
        tail += [i for b in loader for i in b.tolist()]
    read_before = [i for rank_batches in head for b in rank_batches for i in b]
    epoch = read_before + skipped_samples + tail
    assert sorted(epoch) == list(range(length)) + sorted(epoch)[length:], "each sample once (the padding aside)"
    assert len(set(epoch)) == length
    assert not set(skipped_samples) & set(read_before + tail), "a skipped sample is never read in its epoch"


def test_the_record_lasts_its_epoch_and_where_reports_the_skipped_batches() -> None:
    loader = make(20, 2, 1, 0)
    batches = iter(loader)
    next(batches)
    moved = skip_state(loader.state_dict(), batches=3)
    assert moved["version"] == 4 and moved["skipped"] == [[2, 8]] and moved["position"] == 8
    report = where(moved, previous=4)
    assert [b.status for b in report.batches] == [READ, SKIPPED, SKIPPED, SKIPPED]
    again = skip_state(moved, batches=1)  # adjacent: one range
    assert again["skipped"] == [[2, 10]]
    resumed = make(20, 2, 1, 0)
    resumed.load_state_dict(moved)
    assert resumed.state_dict() == moved, "the restored state reads back as saved"
    rest = iter(resumed)
    next(rest)
    assert resumed.state_dict()["skipped"] == [[2, 8]]
    for _ in rest:
        pass
    resumed.set_epoch(1)
    next(iter(resumed))
    state = resumed.state_dict()
    assert state["epoch"] == 1 and state["version"] == 2 and "skipped" not in state, "the next epoch reads everything"


def test_a_bad_skipped_record_is_refused_and_changes_nothing() -> None:
    loader = make(20, 2, 1, 0)
    moved = skip_state(loader.state_dict(), batches=3)
    before = loader.state_dict()
    for bad in ([[2, 8]], [[0, 7], [7, 9]], [[3, 1]], "x", [], [[0, 9]]):
        with pytest.raises(ResumeError, match="'skipped'"):
            loader.load_state_dict(moved | {"skipped": bad, "position": 8 if bad != [[2, 8]] else 6})
    assert loader.state_dict() == before


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"batches": 10}, "past the end of epoch 0, which has 9 left"),
        ({"to_position": 1}, "to_position should be after the state's position 2"),
        ({"to_position": 21}, "at most epoch 0's length 20"),
        ({}, "give one of batches and to_position"),
    ],
)
def test_a_skip_outside_the_epoch_is_refused(arguments: dict[str, int], message: str) -> None:
    loader = make(20, 2, 1, 0)
    next(iter(loader))
    with pytest.raises(ResumeError, match=message):
        skip_state(loader.state_dict(), **arguments)


def test_an_epoch_already_over_and_a_stream_state_are_refused_with_what_to_do() -> None:
    loader = make(4, 2, 1, 0)
    for _ in loader:
        pass
    with pytest.raises(ResumeError, match=r"already over.*skip from a checkpoint of the next epoch"):
        skip_state(loader.state_dict(), batches=1)
    stream_state = torch.load(saved.STATES / "shuffle_buffer.pt", weights_only=True)["state"]
    with pytest.raises(ResumeError, match=r"give `where` and `skip` the pipeline"):
        skip_state(stream_state, batches=1)


# -- the checkpoint --------------------------------------------------------------------------------


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run folder with step-5: a loader 5 batches into an epoch of 10, and a model."""
    loader = make(40, 2, 2, 0)
    batches = iter(loader)
    for _ in range(5):
        next(batches)
    state = {"model": {"w": torch.arange(6.0)}, "dataloader": loader.state_dict(), "train_state": {"step": 5}}
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(5, state)
    return tmp_path / "run"


def test_skip_publishes_the_next_step_which_latest_selects_and_the_old_one_keeps_every_byte(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = run / "step-00000005"
    before = digests(old)
    assert main(["skip", str(old), "--batches", "3"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {run / 'step-00000006'}"
    assert digests(old) == before
    with CheckpointManager(run, lock=False) as manager:
        assert manager.latest() == run / "step-00000006"
        state = manager.load()
        assert manager.load(old)["dataloader"]["position"] == 20
    assert state["train_state"] == {"step": 5} and torch.equal(state["model"]["w"], torch.arange(6.0))
    assert state["dataloader"]["skipped"] == [[20, 32]]
    for rank in range(2):
        reference = batches_of(make(40, 2, 2, rank), 1)
        resumed = make(40, 2, 2, rank)
        resumed.load_state_dict(state["dataloader"])
        assert batches_of(resumed, 1) == reference[5 + 3 :]
    assert main(["where", str(run / "step-00000006"), "--previous", "4", "--json"]) == 0
    assert "skipped" in capsys.readouterr().out
    assert skip(run / "step-00000006", to_position=36) == run / "step-00000007"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--batches", "11"], "batches: skipping 11 batches goes past the end of epoch 0"),
        (["--batches", "0"], "--batches: expected an integer >= 1"),
        (["--batches", "two"], "--batches: expected an integer, got 'two'"),
        (["--to-position", "3"], "to_position should be after"),
        (["--batches", "1", "--state", "/nope"], "--state /nope: not a data state"),
    ],
)
def test_bad_skips_give_one_error_line(
    run: Path, argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(p.name for p in run.iterdir())
    assert main(["skip", str(run / "step-00000005"), *argv]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("error: ") and fragment in err, err
    assert sorted(p.name for p in run.iterdir()) == before


def test_a_checkpoint_with_a_newer_one_after_it_is_refused(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with CheckpointManager(run) as manager:
        manager.save(9, manager.load())
    assert main(["skip", str(run / "step-00000005"), "--batches", "1"]) == 1
    assert "step-00000009 came after it" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--next", "0"], "--next: expected an integer >= 1"),
        (["--positions", "3"], "--positions: expected A:B"),
        (["--rank", "2"], "rank should be in [0, 2)"),
        (["--sample", "40"], "sample 40 is not in epoch 0's order of 40 samples"),
        (["--epoch", "1"], "--epoch: only with --sample"),
        (["--step", "x"], "--step: expected an integer"),
    ],
)
def test_bad_where_questions_give_one_error_line(
    run: Path, argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["where", str(run / "step-00000005"), *argv]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("error: ") and fragment in err, err


@pytest.mark.parametrize("fixture", ["stream_loader_0_workers", "shuffle_buffer"])
def test_where_on_a_streams_state_says_why_it_cannot_answer(
    fixture: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "state.pt"
    torch.save(torch.load(saved.STATES / f"{fixture}.pt", weights_only=True)["state"], path)
    assert main(["where", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "depends on the pipeline" in err, err
