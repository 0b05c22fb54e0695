"""transformers.Trainer through ResumableTrainer: a run SIGKILLed mid-epoch and resumed with
``resume_from_checkpoint`` logs every loss and ends with the weights of an uninterrupted run, bitwise.

The user script (tests/user_scripts/hf_trainer_train.py) trains a model with dropout on data whose
augmentation draws from the global RNGs. One case runs in the default suite; the matrix (workers,
gradient accumulation, a save on an epoch's last step, ``max_steps``, two processes) is slow, and
test_transformers_matrix.py crosses save and evaluation cadences, ``save_total_limit`` and kill points.
In-process tests here cover what a kill in the middle of a checkpoint write leaves, and evaluation.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the [transformers] extra is not installed")

from integrations_harness import kill_and_resume  # first: makes torchvision importable

# isort: split
from accelerate import skip_first_batches
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from resumable_data import ResumableDataLoader, ResumeError, ResumeWarning, wrap
from resumable_data.integrations.transformers import STATE_FILE, ResumableTrainer
from resumable_data.rng.capture import capture_rng_state
from resumable_data.testing import assert_same
from toy import Augmented, Net, seed_everything

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def _args(out: Path, **overrides: object) -> TrainingArguments:
    settings: dict[str, object] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "num_train_epochs": 2,
        "learning_rate": 0.01,
        "save_strategy": "steps",
        "save_steps": 3,
        "logging_steps": 1000,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
    }
    return TrainingArguments(**{**settings, **overrides})  # type: ignore[arg-type]


class _Preempted(Exception):
    """What the in-process run dies of (the SIGKILLed scripts below are the real thing)."""


class _DieAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise _Preempted


class _Logging(ResumableTrainer):
    """Logs every micro-batch's loss, in order, with the optimizer step it belongs to."""

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.losses.append((self.state.global_step, loss.item().hex()))
        return loss


def _fit(out: Path, die_at: int = 0, resume: bool = False, **overrides: object) -> _Logging:
    callbacks = [_DieAt(die_at)] if die_at else []
    seed_everything(0)  # the initial weights
    trainer = _Logging(model=Net(), args=_args(out, **overrides), train_dataset=Augmented(40), callbacks=callbacks)
    trainer.losses = []
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer


def test_a_trainer_run_stopped_mid_epoch_resumes_to_the_same_weights(tmp_path: Path) -> None:
    # 40 samples, batches of 4, accumulation 2: 5 steps an epoch; saved at step 6, stopped at 7.
    reference = _fit(tmp_path / "reference", gradient_accumulation_steps=2)
    with pytest.raises(_Preempted):
        _fit(tmp_path / "run", die_at=7, gradient_accumulation_steps=2)
    assert (tmp_path / "run" / "checkpoint-6" / STATE_FILE).exists()
    resumed = _fit(tmp_path / "run", resume=True, gradient_accumulation_steps=2)
    assert resumed.losses == [(step, loss) for step, loss in reference.losses if step >= 6]
    assert_same(reference.model.state_dict(), resumed.model.state_dict(), "final weights")


def test_a_mid_epoch_resume_is_exact_and_warns_nothing(tmp_path: Path, reference: _Logging) -> None:
    # Found on main: every exact mid-epoch resume warned at the next epoch "ResumeWarning:
    # sampler.set_epoch(1) discards the restored position" (Trainer's set_epoch(1) on a restore no pass
    # had consumed: the loader was restored, and accelerate's rebuilt loader iterates its batch sampler).
    with pytest.raises(_Preempted):
        _fit(tmp_path, die_at=4)  # 10 steps an epoch: checkpoint-3 is in epoch 0, the resume crosses into 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit(tmp_path, resume=True)
    assert [str(w.message) for w in caught if issubclass(w.category, ResumeWarning)] == []
    assert resumed.losses == [(step, loss) for step, loss in reference.losses if step >= 3]
    assert_same(reference.model.state_dict(), resumed.model.state_dict(), "final weights")


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        # Found on main: Trainer skipped 6 micro-batches where the checkpoint had consumed 3, so after 3
        # stand-ins it discarded 3 real batches, never trained on; silently.
        (
            {"gradient_accumulation_steps": 2},
            r"epoch 0 after 6 micro-batches .*left off in epoch 0 after 3; "
            "resume with the gradient_accumulation_steps",
        ),
        # Found on main: Trainer did not skip, so the stand-ins reached collate_fn and every relaunch
        # failed with a message about accelerate's padding.
        ({"ignore_data_skip": True}, r"epoch 0 after 0 micro-batches .*resume without ignore_data_skip=True"),
    ],
    ids=["gradient_accumulation_steps", "ignore_data_skip"],
)
def test_a_resume_where_trainer_would_skip_otherwise_than_the_checkpoint_is_refused(
    tmp_path: Path, setting: dict[str, object], expected: str
) -> None:
    with pytest.raises(_Preempted):
        _fit(tmp_path, die_at=4)  # checkpoint-3: 3 micro-batches of epoch 0
    with pytest.raises(ResumeError, match=f"checkpoint-3: Trainer resumes at global_step 3 in {expected}"):
        _fit(tmp_path, resume=True, **setting)


def test_a_checkpoint_that_ended_its_epoch_short_of_the_order_resumes_in_the_next_epoch(
    tmp_path: Path, reference: _Logging
) -> None:
    # What earlier versions wrote on an epoch's last step with 2 processes and dataloader_drop_last
    # (accelerate drops a last round that does not reach every process): every batch of this
    # process's epoch consumed, the position short of the epoch's end. Written here by hand on one
    # process; on main the resume pushed 10 stand-ins into the next epoch ("a batch reached
    # collate_fn without its global-RNG seeding"), as every 2-process relaunch did.
    with pytest.raises(_Preempted):
        _fit(tmp_path, die_at=12, save_steps=5)  # 10 steps an epoch: checkpoint-10 is epoch 0's last
    path = tmp_path / "checkpoint-10" / STATE_FILE
    saved = json.loads(path.read_text())
    assert saved["batches_per_process"] == 10 and saved["loader"]["position"] == 40
    path.write_text(json.dumps({**saved, "loader": {**saved["loader"], "position": 36}}))
    resumed = _fit(tmp_path, resume=True, save_steps=5)
    assert resumed.losses == [(step, loss) for step, loss in reference.losses if step >= 10]
    assert_same(reference.model.state_dict(), resumed.model.state_dict(), "final weights")


class _Stream(IterableDataset):
    def __iter__(self) -> Any:
        return iter(Augmented(8)[i] for i in range(8))


def test_an_iterable_dataset_is_refused_naming_it_and_what_resumes_instead(tmp_path: Path) -> None:
    # Found on main: the refusal said "train_sampling_strategy='random' builds _InfiniteConstantSampler ...
    # Use train_sampling_strategy='random'", the setting already in use.
    trainer = ResumableTrainer(model=Net(), args=_args(tmp_path, max_steps=4), train_dataset=_Stream())
    with pytest.raises(ResumeError) as refused:
        trainer.train()
    message = str(refused.value)
    assert "train_dataset is a _Stream (an IterableDataset)" in message
    assert "map-style" in message and "StreamLoader" in message
    assert "train_sampling_strategy" not in message


def _cut_short(name: str) -> Callable[[Path], None]:
    def cut(folder: Path) -> None:
        path = folder / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    return cut


def _remove(name: str) -> Callable[[Path], None]:
    return lambda folder: os.remove(folder / name)


# What a kill leaves in the middle of writing a checkpoint: Trainer writes trainer_state.json after the
# weights, optimizer, scheduler and RNG states, and (with several processes) each process its own RNG
# state; an earlier version of ResumableTrainer wrote resumable_data.json in place.
_KILLED_WRITES = {
    "trainer_state.json missing": _remove("trainer_state.json"),
    "trainer_state.json cut short": _cut_short("trainer_state.json"),
    "rng_state.pth cut short": _cut_short("rng_state.pth"),
    f"{STATE_FILE} cut short": _cut_short(STATE_FILE),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> _Logging:
    """An uninterrupted run with the default settings."""
    return _fit(tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("damage", _KILLED_WRITES.values(), ids=_KILLED_WRITES.keys())
def test_resume_true_takes_the_newest_complete_checkpoint(
    tmp_path: Path, reference: _Logging, damage: Callable[[Path], None]
) -> None:
    # Found on main: a kill in the middle of Trainer's write of checkpoint-6 left it without
    # trainer_state.json; train(resume_from_checkpoint=True) picked it by its name and failed on every
    # relaunch (FileNotFoundError), although checkpoint-3 was complete.
    with pytest.raises(_Preempted):
        _fit(tmp_path / "run", die_at=7)
    damage(tmp_path / "run" / "checkpoint-6")
    with pytest.warns(ResumeWarning, match="skipped the newer incomplete .*checkpoint-6"):
        resumed = _fit(tmp_path / "run", resume=True)
    assert resumed.losses == [(step, loss) for step, loss in reference.losses if step >= 3]
    assert_same(reference.model.state_dict(), resumed.model.state_dict(), "final weights")


def test_resume_from_an_incomplete_checkpoint_is_refused_naming_what_it_lacks(tmp_path: Path) -> None:
    with pytest.raises(_Preempted):
        _fit(tmp_path, die_at=4)
    os.remove(tmp_path / "checkpoint-3" / "trainer_state.json")
    trainer = _Logging(model=Net(), args=_args(tmp_path), train_dataset=Augmented(40))
    with pytest.raises(ResumeError, match=r"checkpoint-3: trainer_state.json is missing"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    with pytest.raises(ResumeError, match=r"no complete checkpoint-N folder .*checkpoint-3 \(trainer_state.json"):
        trainer.train(resume_from_checkpoint=True)


def test_a_checkpoint_of_another_number_of_processes_is_complete_and_refused_by_that_name(tmp_path: Path) -> None:
    # Found in review: completeness was judged by this run's number of processes, so every checkpoint a
    # two-process run wrote was "missing rng_state.pth" here, and the refusal told the user to remove
    # them all. They are complete; what differs is the number of processes, and that is what is said.
    with pytest.raises(_Preempted):
        _fit(tmp_path, die_at=4)
    folder = tmp_path / "checkpoint-3"
    os.rename(folder / "rng_state.pth", folder / "rng_state_0.pth")
    shutil.copy(folder / "rng_state_0.pth", folder / "rng_state_1.pth")
    saved = json.loads((folder / STATE_FILE).read_text())
    (folder / STATE_FILE).write_text(json.dumps({**saved, "num_processes": 2}))
    trainer = _Logging(model=Net(), args=_args(tmp_path), train_dataset=Augmented(40))
    with pytest.raises(ResumeError, match="number of processes changed: checkpoint has 2, this run has 1"):
        trainer.train(resume_from_checkpoint=True)


def test_evaluate_leaves_the_global_rngs_as_it_found_them(tmp_path: Path) -> None:
    # Found on main: evaluating drew from torch's RNG (the evaluation loader's base seed) and from every
    # RNG the evaluation set's augmentation uses; a resume from a checkpoint on an epoch's last step
    # skips that epoch's evaluation, so every later dropout mask and loss differed from the
    # uninterrupted run's.
    trainer = ResumableTrainer(model=Net(), args=_args(tmp_path), eval_dataset=Augmented(12))
    before = capture_rng_state()
    trainer.evaluate()
    assert_same(before, capture_rng_state(), "global RNG states")


def test_a_run_resumed_through_trainers_skip_writes_checkpoints_that_resume_exactly(tmp_path: Path) -> None:
    # A checkpoint without resumable_data.json (the run was killed between Trainer's files and ours)
    # resumes through Trainer's skip. Found on main: the run then wrote, at the epoch's end, a position
    # counting only the batches trained since the resume; resuming from that checkpoint failed on every
    # relaunch ("a batch reached collate_fn without its global-RNG seeding").
    reference = _fit(tmp_path / "reference", save_steps=5)  # 10 steps an epoch
    with pytest.raises(_Preempted):
        _fit(tmp_path / "run", die_at=7, save_steps=5)
    os.remove(tmp_path / "run" / "checkpoint-5" / STATE_FILE)
    with pytest.raises(_Preempted), pytest.warns(ResumeWarning, match=f"has no {STATE_FILE}"):
        _fit(tmp_path / "run", die_at=12, resume=True, save_steps=5)
    with pytest.warns(ResumeWarning, match=f"checkpoint-10 has no {STATE_FILE}"):  # it was written in that epoch
        resumed = _fit(tmp_path / "run", resume=True, save_steps=5)
    assert resumed.losses == [(step, loss) for step, loss in reference.losses if step >= 10]
    assert_same(reference.model.state_dict(), resumed.model.state_dict(), "final weights")


def test_trainers_skip_over_a_resumable_loader_keeps_batches_and_augmentations(tmp_path: Path) -> None:
    # Found on main: a Trainer whose get_train_dataloader() returned a ResumableDataLoader crashed
    # on resume in accelerate's skip_first_batches (AttributeError: 'list' object has no attribute 'key').
    class Own(Trainer):
        def get_train_dataloader(self) -> DataLoader:
            return self.accelerator.prepare(ResumableDataLoader(Augmented(40), batch_size=4, seed=3))

    trainer = Own(model=Net(), args=_args(tmp_path), train_dataset=Augmented(40))
    reference = list(trainer.get_train_dataloader())
    assert_same(reference[3:], list(skip_first_batches(trainer.get_train_dataloader(), 3)), "batches after the skip")


def test_wrap_takes_trainers_own_train_loader(tmp_path: Path) -> None:
    # Found on main: wrap(super().get_train_dataloader()) raised "a custom batch_sampler decides
    # batches itself" for the plain BatchSampler that accelerate passes as batch_sampler=.
    class Wrapped(Trainer):
        def get_train_dataloader(self) -> DataLoader:
            return wrap(super().get_train_dataloader(), seed=0)

    trainer = Wrapped(model=Net(), args=_args(tmp_path), train_dataset=Augmented(40))
    loader = trainer.get_train_dataloader()
    assert isinstance(loader, ResumableDataLoader) and loader.batch_size == 4
    assert sum(len(batch["x"]) for batch in loader) == 40


@pytest.mark.slow  # two processes under torchrun, like the other multi-process cases: about 35 s
def test_a_two_process_drop_last_run_resumes_from_a_checkpoint_on_an_epochs_last_step(tmp_path: Path) -> None:
    # 30 samples in batches of 4: 7 batches an epoch, of which accelerate gives each of 2 processes 3 and
    # drops the 7th; a save every 3 steps falls on each epoch's last step, the kill comes in the next one.
    # Found on main: the checkpoint put the epoch at sample 24, not at its end, so every relaunch failed
    # on both ranks ("a batch reached collate_fn without its global-RNG seeding").
    flags = ("--length", "30", "--drop-last", "--save-steps", "3")
    kill_and_resume("hf_trainer_train.py", tmp_path, 5, *flags, processes=2, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_killed_trainer_run_resumes_bitwise(tmp_path: Path, workers: int, accumulation: int) -> None:
    kill_and_resume("hf_trainer_train.py", tmp_path, 5, "--workers", str(workers), "--accumulation", str(accumulation))


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_killed_trainer_run_saved_on_an_epochs_last_step_resumes_bitwise(tmp_path: Path, accumulation: int) -> None:
    # 44 samples in batches of 4: 11 micro-batches an epoch; a save every 11 (or 5 groups of 2 and a
    # last group of 1: 6 steps) falls on the epoch's last step, and the kill comes in the next epoch.
    steps_per_epoch = {1: 11, 2: 6}[accumulation]
    kill_and_resume(
        "hf_trainer_train.py",
        tmp_path,
        steps_per_epoch + 2,
        "--accumulation",
        str(accumulation),
        "--save-steps",
        str(steps_per_epoch),
    )


@pytest.mark.slow
def test_a_killed_trainer_run_with_max_steps_resumes_bitwise(tmp_path: Path) -> None:
    # max_steps=15 ends mid-epoch (11 steps an epoch) and overrides num_train_epochs.
    kill_and_resume("hf_trainer_train.py", tmp_path, 9, "--max-steps", "15")


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_killed_two_process_trainer_run_resumes_bitwise(tmp_path: Path, accumulation: int) -> None:
    # 48 samples: 6 batches per process and epoch (an uneven split would make accelerate pad the
    # last batch without its seeding, which the collate function refuses); saved at 4, killed at 5.
    kill_and_resume(
        "hf_trainer_train.py", tmp_path, 5, "--accumulation", str(accumulation), "--length", "48", processes=2
    )
