"""Lightning with ResumeCallback: a fit SIGKILLed mid-epoch and resumed with ``ckpt_path="last"``
logs every loss and ends with the weights of an uninterrupted fit, bitwise.

The user script (tests/user_scripts/lightning_train.py) fits a model with dropout on data whose
augmentation draws from the global RNGs, from a ResumableDataLoader or a StreamLoader. One fit runs
in the default suite; workers, gradient accumulation, a StreamLoader and ddp on two CPU processes
are slow.
"""

from __future__ import annotations

import types
import warnings
from pathlib import Path
from typing import Any

import pytest

from integrations_harness import kill_and_resume  # first: makes torchvision importable

pytest.importorskip("lightning", reason="the [lightning] extra is not installed")

# isort: split
import lightning
import torch
from lightning_train import Settings, fit  # the user script's fit, here stopped by an exception instead of a kill

from resumable_data import ResumeWarning
from resumable_data.testing import assert_same
from toy import read_losses

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class _Preempted(Exception):
    pass


class _StopAt(lightning.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: lightning.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            raise _Preempted


def _fit(run_dir: Path, *callbacks: lightning.Callback, **settings: Any) -> None:
    # 48 samples in batches of 4, accumulation 2: 6 steps an epoch; a checkpoint every 4 steps.
    run_dir.mkdir(exist_ok=True)
    fit(run_dir, Settings(**{"accumulation": 2, "max_epochs": 2, **settings}), callbacks)


def _assert_stopped_fit_resumes_identically(tmp_path: Path, stop_at: int, **settings: Any) -> None:
    """A fit stopped after step ``stop_at`` and resumed from its last checkpoint logs the losses and ends with
    the weights of an uninterrupted fit, bitwise."""
    run, reference = tmp_path / "run", tmp_path / "reference"
    _fit(reference, **settings)
    with pytest.raises(_Preempted):
        _fit(run, _StopAt(stop_at), **settings)
    _fit(run, **settings)
    assert read_losses(run) == read_losses(reference)
    expected = torch.load(reference / "weights.pt", weights_only=True)
    assert_same(expected, torch.load(run / "weights.pt", weights_only=True), "final weights")


@pytest.mark.parametrize("stream", [False, True], ids=["ResumableDataLoader", "StreamLoader"])
def test_a_fit_stopped_mid_epoch_resumes_to_the_same_losses_and_weights(tmp_path: Path, stream: bool) -> None:
    # Found here with a StreamLoader: Lightning fetches a loader without len one batch ahead, so the
    # state it saved was one batch past the steps taken and the resumed fit skipped a batch.
    # The last checkpoint is step 4's, in the first epoch's last third.
    _assert_stopped_fit_resumes_identically(tmp_path, 7, stream=stream)


def test_validation_right_after_a_checkpoint_does_not_change_the_resumed_losses(tmp_path: Path) -> None:
    # Found on main: with checkpoints on validation steps, the uninterrupted fit validated after saving,
    # its shuffled DataLoader drawing its order from torch's global RNG, and trained on from there; the
    # resumed fit restored the RNG saved before that validation: every loss after the resume differed.
    _assert_stopped_fit_resumes_identically(
        tmp_path, 6, accumulation=1, validation="plain", val_check_interval=4, save_every=4
    )


@pytest.mark.parametrize("stream", [False, True], ids=["ResumableDataLoader", "StreamLoader"])
def test_a_checkpoint_on_the_last_batch_limit_train_batches_allows_resumes_where_the_fit_goes_on(
    tmp_path: Path, stream: bool
) -> None:
    # Lightning ends each epoch after 5 of its 12 batches, and the checkpoint is the one after batch 5.
    # Found on main with a ResumableDataLoader: Lightning starts its next epoch with set_epoch, the
    # checkpoint held a position inside epoch 0, and the resumed fit's "epoch 1" was epoch 0's
    # remaining samples. A StreamLoader (no sampler, no set_epoch from Lightning) goes on in its epoch
    # in both fits.
    _assert_stopped_fit_resumes_identically(
        tmp_path, 6, accumulation=1, max_epochs=3, limit_train_batches=5, save_every=5, stream=stream
    )


def test_a_checkpoint_at_an_epochs_end_resumes_into_the_next_epoch(tmp_path: Path) -> None:
    # Found here (silent on main): from a checkpoint written in on_train_epoch_end Lightning loads no
    # loader state (it counts the epoch as done), creates the fresh loader's iterator (epoch 0) and only
    # then calls sampler.set_epoch(1): the resumed epoch 1 trained on epoch 0's order. The last
    # checkpoint is epoch 0's end (step 6).
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeWarning)
        _assert_stopped_fit_resumes_identically(tmp_path, 8, checkpoint="epochs")


def test_a_stream_fit_resumed_from_an_epochs_end_warns_that_lightning_does_not_restore_the_loader(
    tmp_path: Path,
) -> None:
    # Found here, silent on main: Lightning draws a fresh StreamLoader's first batch (epoch 0) before any
    # callback hook of the resumed fit runs, and restores no loader state at an epoch's end.
    with pytest.raises(_Preempted):
        _fit(tmp_path, _StopAt(8), checkpoint="epochs", stream=True)
    with pytest.warns(ResumeWarning, match="written at the end of an epoch"):
        _fit(tmp_path, checkpoint="epochs", stream=True)


def test_a_fit_resumed_inside_an_epoch_does_not_warn(tmp_path: Path) -> None:
    with pytest.raises(_Preempted):
        _fit(tmp_path, _StopAt(5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeWarning)
        _fit(tmp_path)


def test_a_resumed_fit_without_the_loaders_state_warns(tmp_path: Path) -> None:
    # Found on main: such a fit silently started the epoch over at position 0 while batch_idx went on.
    with pytest.raises(_Preempted):
        _fit(tmp_path, _StopAt(5))
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)  # Lightning's own file
    del checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    torch.save(checkpoint, tmp_path / "last.ckpt")
    with pytest.warns(ResumeWarning, match="holds no state for its"):
        _fit(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_killed_fit_resumes_bitwise(tmp_path: Path, workers: int, accumulation: int) -> None:
    kill_and_resume("lightning_train.py", tmp_path, 6, "--workers", str(workers), "--accumulation", str(accumulation))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_killed_fit_over_a_stream_loader_resumes_bitwise(tmp_path: Path, workers: int) -> None:
    kill_and_resume("lightning_train.py", tmp_path, 6, "--stream", "--workers", str(workers))


@pytest.mark.slow
def test_a_killed_ddp_fit_on_two_processes_resumes_bitwise(tmp_path: Path) -> None:
    # Lightning launches the second process itself; both log their losses.
    kill_and_resume("lightning_train.py", tmp_path, 4, "--devices", "2", ranks=2)


def test_lightning_still_saves_the_train_loaders_state_where_resume_callback_corrects_it(tmp_path: Path) -> None:
    # ResumeCallback reads and rewrites checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    # (no public hook exposes it): this fails if Lightning moves it.
    with pytest.raises(_Preempted):
        _fit(tmp_path, _StopAt(5), stream=True)
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)  # Lightning's own file
    states = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert isinstance(states, list) and len(states) == 1
    # Step 4 with accumulation 2 is 8 batches trained: the saved state has handed out exactly 8.
    assert sum(states[0]["batches"].values()) == 8


def test_a_stream_loader_among_several_train_loaders_warns() -> None:
    from resumable_data.integrations.lightning import ResumeCallback
    from resumable_data.streams import ShardedIterable, StreamLoader

    stream = StreamLoader(ShardedIterable(["x"], read_shard=lambda s, i: iter(())))
    # What on_train_start reads: Trainer.train_dataloader, the fit's train loaders as given.
    trainer = types.SimpleNamespace(train_dataloader={"a": stream, "b": [1, 2]})
    with pytest.warns(ResumeWarning, match="among several train loaders"):
        ResumeCallback().on_train_start(trainer, None)  # type: ignore[arg-type]
