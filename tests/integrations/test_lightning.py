"""Lightning with ResumeCallback: a fit SIGKILLed mid-epoch and resumed with ``ckpt_path="last"``
logs every loss and ends with the weights of an uninterrupted fit, bitwise.

The user script (tests/user_scripts/lightning_train.py) fits a model with dropout on data whose
augmentation draws from the global RNGs, from a ResumableDataLoader or a StreamLoader. One fit runs
in the default suite; workers, gradient accumulation, a StreamLoader and ddp on two CPU processes
are slow. A checkpoint written inside a gradient-accumulation window resumes from the window's start
(tests/integrations/test_lightning_matrix.py has every micro-batch of a window).
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

from resumable_data import ResumeError, ResumeWarning
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


class _SaveAndStop(lightning.Callback):
    """A preemption handler: ``trainer.save_checkpoint`` after micro-batch ``batch`` of the fit, then stop."""

    def __init__(self, run_dir: Path, batch: int) -> None:
        self.run_dir, self.batch = run_dir, batch

    def on_train_batch_end(self, trainer: lightning.Trainer, *args: object) -> None:
        if trainer.fit_loop.total_batch_idx == self.batch:
            trainer.save_checkpoint(self.run_dir / "last.ckpt")
            raise _Preempted


def _assert_stopped_fit_resumes_identically(
    tmp_path: Path, stop_at: int, save_at: int | None = None, **settings: Any
) -> None:
    """A fit stopped after step ``stop_at`` (or saved and stopped after micro-batch ``save_at``) and resumed
    from its last checkpoint logs the losses and ends with the weights of an uninterrupted fit, bitwise."""
    run, reference = tmp_path / "run", tmp_path / "reference"
    _fit(reference, **settings)
    with pytest.raises(_Preempted):
        _fit(run, _StopAt(stop_at) if save_at is None else _SaveAndStop(run, save_at), **settings)
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


def test_a_checkpoint_saved_inside_an_accumulation_window_resumes_to_the_same_losses_and_weights(
    tmp_path: Path,
) -> None:
    # Issue 45 item 2, silent on main: accumulate_grad_batches=2 and trainer.save_checkpoint after micro-batch 4,
    # the first half of the window 4-5. Lightning resumed at micro-batch 5 with an empty window, so the
    # optimizer step lost micro-batch 4's gradient: every loss from micro-batch 6 on differed, and the
    # weights. ResumeCallback saves the window's start instead, and the resumed fit reads 4 again.
    _assert_stopped_fit_resumes_identically(tmp_path, 0, save_at=4)


def test_model_checkpoint_after_a_validation_inside_an_accumulation_window_resumes_identically(
    tmp_path: Path,
) -> None:
    # Found here, silent on main: ModelCheckpoint(save_last=True) saves after every validation, and
    # val_check_interval=3 with accumulate_grad_batches=2 validates after micro-batch 2, inside the window
    # 2-3: the resumed fit lost micro-batch 2's gradient (first different loss at step 2, micro-batch 4).
    _assert_stopped_fit_resumes_identically(
        tmp_path, 3, checkpoint="last", validation="plain", val_check_interval=3, max_epochs=1
    )


def test_two_checkpoints_inside_windows_resume_in_a_row_to_the_same_losses_and_weights(tmp_path: Path) -> None:
    # accumulate_grad_batches=3: the first fit is saved after micro-batch 4 (window 3-5), the second resumes
    # at micro-batch 3 and is saved after micro-batch 7 (window 6-8), a window start it recorded itself.
    run, reference = tmp_path / "run", tmp_path / "reference"
    _fit(reference, accumulation=3)
    for save_at in (4, 7):
        with pytest.raises(_Preempted):
            _fit(run, _SaveAndStop(run, save_at), accumulation=3)
    _fit(run, accumulation=3)
    assert read_losses(run) == read_losses(reference)
    expected = torch.load(reference / "weights.pt", weights_only=True)
    assert_same(expected, torch.load(run / "weights.pt", weights_only=True), "final weights")


class _SaveBeforeOptimizerStep(lightning.Callback):
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def on_before_optimizer_step(self, trainer: lightning.Trainer, *args: object) -> None:
        if trainer.global_step == 1:
            trainer.save_checkpoint(self.run_dir / "last.ckpt")


def test_a_checkpoint_inside_the_optimizer_step_is_refused_naming_the_window(tmp_path: Path) -> None:
    # Between the last micro-batch's backward and the end of the optimizer step the weights may or may not
    # have stepped yet: neither the window's start nor the present is the state of the weights.
    match = r"inside optimizer step 2 \(micro-batch 2 of accumulate_grad_batches=2 .*every_n_train_steps"
    with pytest.raises(ResumeError, match=match):
        _fit(tmp_path, _SaveBeforeOptimizerStep(tmp_path))
    assert not (tmp_path / "last.ckpt").exists()


class _SavedAt(lightning.Callback):
    """Records the micro-batch of the fit after which each checkpoint is written."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def on_save_checkpoint(self, trainer: lightning.Trainer, *args: object) -> None:
        self.batches.append(trainer.fit_loop.total_batch_idx)


def test_model_checkpoint_every_n_train_steps_saves_on_optimizer_steps_under_accumulation(tmp_path: Path) -> None:
    # ModelCheckpoint counts optimizer steps (trainer.global_step), so with accumulation it saves right after
    # a window's optimizer step, never inside a window: the cadence the refusal above recommends.
    saved = _SavedAt()
    _fit(tmp_path, saved, accumulation=3, save_every=1, max_epochs=1)
    assert set(saved.batches) == {2, 5, 8, 11}  # 12 micro-batches, windows of 3


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


class _FitLoopStates(lightning.Callback):
    """``Trainer.fit_loop.state_dict()`` after each micro-batch (after ResumeCallback's hook) and one save."""

    def __init__(self, run_dir: Path, save_at: int) -> None:
        self.run_dir, self.save_at, self.states = run_dir, save_at, {}

    def on_train_batch_end(self, trainer: lightning.Trainer, *args: object) -> None:
        batch = trainer.fit_loop.total_batch_idx
        self.states[batch] = trainer.fit_loop.state_dict()
        if batch == self.save_at:
            trainer.save_checkpoint(self.run_dir / f"{batch}.ckpt")
        if batch == self.save_at + 1:
            trainer.save_checkpoint(self.run_dir / f"{batch}.ckpt")
            raise _Preempted


def test_lightning_still_writes_and_reads_the_fit_loop_state_resume_callback_rewinds(tmp_path: Path) -> None:
    # Inside a window ResumeCallback writes checkpoint["loops"]["fit_loop"] as Trainer.fit_loop.state_dict()
    # was at the window's start, and reads the optimizer-step and batch counters in it (no public hook
    # exposes them): this fails if Lightning changes that layout. Micro-batch 3 ends the window 2-3.
    states = _FitLoopStates(tmp_path, save_at=3)
    with pytest.raises(_Preempted):
        _fit(tmp_path, states)
    on_step = torch.load(tmp_path / "3.ckpt", weights_only=False)["loops"]["fit_loop"]  # Lightning's own file
    assert on_step == states.states[3]  # on an optimizer step, Lightning's checkpoint is the fit loop's state
    assert on_step["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"] == {
        "ready": 2,
        "completed": 2,
    }
    assert on_step["epoch_loop.batch_progress"]["current"] == {"ready": 4, "started": 4, "processed": 4, "completed": 3}
    inside = torch.load(tmp_path / "4.ckpt", weights_only=False)["loops"]["fit_loop"]
    assert inside == states.states[3] != states.states[4]  # inside the window 4-5: the window's start


def test_a_stream_loader_among_several_train_loaders_warns() -> None:
    from resumable_data.integrations.lightning import ResumeCallback
    from resumable_data.streams import ShardedIterable, StreamLoader

    stream = StreamLoader(ShardedIterable(["x"], read_shard=lambda s, i: iter(())))
    # What on_train_start reads: Trainer.train_dataloader, the fit's train loaders as given, and its accumulation.
    trainer = types.SimpleNamespace(train_dataloader={"a": stream, "b": [1, 2]}, accumulate_grad_batches=1)
    with pytest.warns(ResumeWarning, match="among several train loaders"):
        ResumeCallback().on_train_start(trainer, None)  # type: ignore[arg-type]
