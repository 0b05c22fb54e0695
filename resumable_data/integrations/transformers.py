"""Hugging Face ``transformers.Trainer`` over a ResumableDataLoader: exact resumes, no replay.

``ResumableTrainer`` is ``Trainer`` whose train loader is a :class:`~resumable_data.ResumableDataLoader`
built from what Trainer itself would use (the dataset after ``remove_unused_columns``, the data
collator, the per-device batch size, ``dataloader_*`` settings, ``data_seed`` or ``seed``) and prepared
by accelerate as Trainer prepares its own. ``ResumableTrainerMixin`` gives the same to a ``Trainer``
subclass of your own (``class MyTrainer(ResumableTrainerMixin, Trainer)``).

What is saved where: every ``checkpoint-N`` gets ``resumable_data.json``, the loader's state (the
order's configuration, epoch and position) and the micro-batches each process consumed in the epoch.
On ``train(resume_from_checkpoint=...)`` it is loaded into the new loader — a changed dataset length,
seed, shuffle, batch size or number of processes is refused with a :class:`ResumeError` — and
Trainer's own bookkeeping stays as Trainer keeps it: Trainer still resumes the epoch through
accelerate's ``skip_first_batches``, but the loader hands that skip stand-ins for the batches before
the restored position (:meth:`ResumableBatchSampler.skip_ahead`), so nothing is fetched, no index is
computed, and the steps, epochs, gradient-accumulation groups and learning-rate schedule continue
exactly. The loader's position and Trainer's own (derived from ``global_step``) must agree: a
checkpoint resumed with another ``gradient_accumulation_steps`` or with ``ignore_data_skip=True``
would have Trainer skip real batches or start the epoch over, and is refused with a
:class:`ResumeError` naming both. An epoch ends where accelerate ends it: with several processes and
``dataloader_drop_last``, a last round of batches that does not reach every process is dropped, and
a checkpoint on the epoch's last step resumes in the next epoch. A kill inside a gradient-accumulation
window loses that window (Trainer saves after optimizer steps only): the resume from the checkpoint
before it trains the window again from its first micro-batch, bitwise as the uninterrupted run.
Augmentation drawn from the global RNGs is seeded per batch, so it resumes too; the model's
own randomness (dropout) is Trainer's ``rng_state.pth``, which the loader never touches.
``evaluate`` leaves the global RNGs as it found them: a resumed run does not repeat an evaluation
that came after its checkpoint (an epoch-end one after a save on the epoch's last step), so an
evaluation that drew from them would leave the uninterrupted run's dropout and augmentation
elsewhere than the resumed run's.

Which checkpoint: ``train(resume_from_checkpoint=True)`` takes the newest *complete* ``checkpoint-N``
(by step), not the newest name as Trainer does. A run killed while Trainer wrote its checkpoint
leaves a folder without ``trainer_state.json`` (Trainer writes it after the weights, optimizer,
scheduler and RNG states) or, with several processes, without another process's RNG state;
such a folder is skipped with a :class:`ResumeWarning` naming it, and the run resumes from the one
before, and writes the skipped step again when it gets there. With ``save_total_limit``, Trainer
deletes the oldest folders by modification time (by name where the file system's times are too
coarse) and never looks at completeness: a relaunch that saves on other steps than the killed run
could delete a complete folder and keep the incomplete one, so keep the save steps of a run
you resume (a resume then always reaches the skipped step first).

The loader gives each process its batches through accelerate (one global order, every
``num_processes``-th batch), as Trainer's default loader does. ``group_by_length`` and the other
``train_sampling_strategy`` values decide the order themselves and are refused, and so is an
``IterableDataset`` (a stream's position is not an index into an order: use a map-style dataset, or
a :class:`~resumable_data.StreamLoader` under another trainer).
"""

from __future__ import annotations

import json
import os
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, cast

from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoint.durable import durable_file, fsync_dir
from ..core import state as keys
from ..core.state import require_int, require_mapping
from ..errors import ResumeError, ResumeWarning
from ..map.batch_sampler import ResumableBatchSampler
from ..map.dataloader import ResumableDataLoader
from ..rng.capture import capture_rng_state, restore_rng_state

__all__ = ["STATE_FILE", "ResumableTrainer", "ResumableTrainerMixin"]

STATE_FILE = "resumable_data.json"
"""The file in every ``checkpoint-N`` that holds the loader's state."""
_VERSION = "version"
_LOADER = "loader"
_PROCESSES = "num_processes"
_RNG_FILE = re.compile(r"rng_state_(\d+)\.pth")  # one per process when there are several
_BATCHES = "batches_per_process"  # micro-batches each process consumed in the epoch
STATE_VERSION = 1
_WHAT = "ResumableTrainer checkpoint"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")  # the folders Trainer writes


class ResumableTrainerMixin:
    """Makes a ``transformers.Trainer`` subclass train from a ResumableDataLoader and resume it exactly.

    Put it first: ``class MyTrainer(ResumableTrainerMixin, Trainer)``. It overrides
    ``get_train_dataloader``, ``training_step`` (to count micro-batches) and ``train`` (to find the
    checkpoint to resume from), and adds a callback that writes the loader's state into every
    checkpoint.

    Example:
        >>> from resumable_data.integrations.transformers import ResumableTrainer
        >>> # trainer = ResumableTrainer(model=model, args=args, train_dataset=dataset)
        >>> # trainer.train(resume_from_checkpoint=True)  # exact: same batches, augmentations, steps
    """

    # Set by Trainer.__init__; declared for the type checker.
    args: TrainingArguments
    accelerator: Any
    state: TrainerState

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._resume_dir: str | None = None
        self._train_loader: ResumableDataLoader | None = None
        # This process's micro-batches consumed in the current epoch; None while unknown (the epoch
        # resumed from a checkpoint without our state, through Trainer's own skip).
        self._batches_in_epoch: int | None = 0
        self._resumed_batches: int | None = 0  # what the checkpoint had consumed of its epoch, for its epoch_begin
        self._epoch_batches = 0  # this process's micro-batches in a whole epoch (set with the loader)
        self.add_callback(_LoaderStateCallback(self))  # type: ignore[attr-defined]

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint`` also restores the loader's position."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._newest_complete_checkpoint()
        elif isinstance(resume_from_checkpoint, str):
            problem = self._checkpoint_problem(resume_from_checkpoint)
            if problem is not None:
                raise ResumeError(f"cannot resume from {resume_from_checkpoint}: {problem}")
        self._resume_dir = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.evaluate``, leaving python's, numpy's, torch's and CUDA's global RNGs as it found them.

        An evaluation loader draws its base seed from torch's RNG and a dataset may draw from all of
        them; a resumed run skips evaluations the checkpoint came before, so training must not see them.
        """
        rngs = capture_rng_state()
        try:
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]
        finally:
            restore_rng_state(rngs)

    def get_train_dataloader(self) -> DataLoader:
        """A ResumableDataLoader over what Trainer would load, prepared by accelerate, at the checkpoint's position."""
        loader = self._build_loader(super().get_train_dataloader())  # type: ignore[misc]
        prepared = self.accelerator.prepare(loader)
        # What accelerate hands this process in an epoch: with several processes and drop_last it drops
        # the last round's batches when they do not reach every process, so the epoch ends before the
        # global order does.
        self._epoch_batches = len(prepared)
        self._train_loader = loader
        self._resumed_batches = self._restore(loader, self._resume_dir) if self._resume_dir else 0
        return prepared

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.training_step``, counting the micro-batch (the position a checkpoint saves)."""
        if self._batches_in_epoch is not None:
            self._batches_in_epoch += 1
        return super().training_step(*args, **kwargs)  # type: ignore[misc]

    # -- which checkpoint ------------------------------------------------------------------------
    def _newest_complete_checkpoint(self) -> str:
        """The newest ``checkpoint-N`` in the output folder that :meth:`_checkpoint_problem` accepts."""
        root = str(self.args.output_dir)
        names = os.listdir(root) if os.path.isdir(root) else []
        steps = {int(m.group(1)): name for name in names if (m := _CHECKPOINT_RE.match(name))}
        folders = [os.path.join(root, steps[step]) for step in sorted(steps, reverse=True)]
        folders = [folder for folder in folders if os.path.isdir(folder)]
        if not folders:
            raise ResumeError(
                f"resume_from_checkpoint=True but {root!r} holds no {PREFIX_CHECKPOINT_DIR}-N folder; "
                "train without it to start fresh"
            )
        skipped: list[str] = []
        for folder in folders:
            problem = self._checkpoint_problem(folder)
            if problem is None:
                if skipped:
                    warnings.warn(
                        f"resuming from {folder}; skipped the newer incomplete {'; '.join(skipped)} "
                        "(the run reaches that step again and rewrites it)",
                        ResumeWarning,
                        stacklevel=3,
                    )
                return folder
            skipped.append(f"{folder} ({problem})")
        raise ResumeError(
            f"no complete {PREFIX_CHECKPOINT_DIR}-N folder in {root!r}: {'; '.join(skipped)}; "
            "none of them can be resumed; remove them, or train without resume_from_checkpoint, to start fresh"
        )

    def _checkpoint_problem(self, folder: str) -> str | None:
        """What a kill in the middle of writing ``folder`` left out, or None when it is complete.

        Trainer writes a checkpoint's weights, optimizer, scheduler and RNG states, then
        ``trainer_state.json``, each file whole before the next; every process writes its own RNG
        state, so with several processes another one's may be missing or cut short; this mixin
        writes :data:`STATE_FILE` last (atomically; an earlier version wrote it in place).
        """
        if not os.path.isdir(folder):
            return "no such folder"
        if not _is_json_object(os.path.join(folder, TRAINER_STATE_NAME)):
            return f"{TRAINER_STATE_NAME} is missing or cut short"
        if not self.args.save_only_model:
            # The processes that wrote it, not this run's: a changed number of processes is refused
            # by name when the checkpoint is loaded, not taken for damage here.
            processes = _writers(folder)
            names = ["rng_state.pth"] if processes <= 1 else [f"rng_state_{i}.pth" for i in range(processes)]
            # torch.save writes a zip whose directory comes last: a file cut short is not a zip.
            broken = [name for name in names if not zipfile.is_zipfile(os.path.join(folder, name))]
            if broken:
                return f"{', '.join(broken)} (the RNG state of each of {processes} processes) missing or cut short"
        ours = os.path.join(folder, STATE_FILE)
        if os.path.exists(ours) and not _is_json_object(ours):
            return f"{STATE_FILE} is cut short"
        return None

    # -- the loader ------------------------------------------------------------------------------
    def _build_loader(self, plain: DataLoader) -> ResumableDataLoader:
        """The ResumableDataLoader for Trainer's own (prepared) train loader ``plain``."""
        if isinstance(plain.dataset, IterableDataset):  # accelerate may have wrapped the user's in a shard
            user = getattr(self, "train_dataset", None)
            raise ResumeError(
                f"ResumableTrainer resumes a map-style train_dataset (with __len__ and __getitem__), whose "
                f"order it rebuilds from a seed and a position; train_dataset is a "
                f"{type(user if user is not None else plain.dataset).__name__} (an IterableDataset), whose "
                "position Trainer's loader can neither save nor restore (Trainer replays a stream from its "
                "start to skip what it trained). Pass a map-style dataset (for Hugging Face datasets: "
                "load_dataset without streaming=True), or stream through a StreamLoader "
                "(docs/guides/streams.md) under Lightning, accelerate or a training loop of your own"
            )
        batches: Any = plain.batch_sampler
        if isinstance(batches, BatchSamplerShard):
            batches = batches.batch_sampler
        if type(batches) is not BatchSampler or not isinstance(batches.sampler, (RandomSampler, SequentialSampler)):
            raise ResumeError(
                f"ResumableTrainer resumes Trainer's random or sequential order; "
                f"train_sampling_strategy={self.args.train_sampling_strategy!r} builds "
                f"{type(getattr(batches, 'sampler', batches)).__name__}, whose order cannot be resumed "
                "from a position. Use train_sampling_strategy='random' (the default)"
            )
        args = self.args
        settings: dict[str, Any] = {
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "multiprocessing_context": args.dataloader_multiprocessing_context,
        }
        if args.dataloader_num_workers > 0 and args.dataloader_prefetch_factor is not None:
            settings["prefetch_factor"] = args.dataloader_prefetch_factor
        # world_size=1: accelerate hands each process its batches of the one global order.
        return ResumableDataLoader(
            plain.dataset,  # type: ignore[arg-type]
            batch_size=batches.batch_size,
            shuffle=isinstance(batches.sampler, RandomSampler),
            seed=args.data_seed if args.data_seed is not None else args.seed,
            rank=0,
            world_size=1,
            drop_last=batches.drop_last,
            collate_fn=plain.collate_fn,
            **settings,
        )

    def _restore(self, loader: ResumableDataLoader, resume_dir: str) -> int | None:
        """Load the checkpoint's loader state; returns the micro-batches this process had consumed
        in the epoch the loader continues (0 when that epoch is a new one, None when unknown)."""
        path = os.path.join(resume_dir, STATE_FILE)
        if not os.path.exists(path):
            warnings.warn(
                f"{resume_dir} has no {STATE_FILE} (written after Trainer's own files, so a run "
                "killed in between lacks it); the loader resumes through Trainer's skip over the "
                "epoch's index lists instead, which is exact but costs time in proportion to the position "
                "(and so will resuming from the checkpoints this run writes before its next epoch)",
                ResumeWarning,
                stacklevel=3,
            )
            return None
        with open(path) as file:
            saved = require_mapping(json.load(file), _WHAT)
        if require_int(saved, _VERSION, _WHAT, minimum=1) != STATE_VERSION:
            raise ResumeError(f"{path}: unknown {_WHAT} version {saved[_VERSION]}; expected {STATE_VERSION}")
        processes = require_int(saved, _PROCESSES, _WHAT, minimum=1)
        batches = require_int(saved, _BATCHES, _WHAT, minimum=0)
        state = require_mapping(saved.get(_LOADER), f"{_WHAT} field {_LOADER!r}")
        if processes != self.accelerator.num_processes:
            raise ResumeError(
                f"number of processes changed: checkpoint has {processes}, this run has "
                f"{self.accelerator.num_processes}; Trainer's resume counts steps per process, so resume "
                f"on {processes} processes"
            )
        if state.get("batch_size") != loader.batch_size:
            raise ResumeError(
                f"batch size changed: checkpoint has {state.get('batch_size')}, this run has "
                f"{loader.batch_size}; resume with per_device_train_batch_size={state.get('batch_size')}"
            )
        epoch = require_int(state, keys.EPOCH, _WHAT, minimum=0)
        # Ended also where this process had consumed its whole epoch and the rest went to the batches
        # accelerate drops, which an earlier version saved as a position inside the epoch.
        ended = batches >= self._epoch_batches or loader.sampler.is_end(epoch, require_int(state, keys.POSITION, _WHAT))
        self._check_trainers_resume(resume_dir, (epoch + 1, 0) if ended else (epoch, batches))
        # Into the batch sampler, not the loader: accelerate's rebuilt loader iterates the batch sampler,
        # so its first draw consumes the restore, and Trainer's set_epoch of the next epoch is not taken
        # for a loop that discards it (a loader's restore is consumed only by the loader's own pass).
        batch_sampler = cast(ResumableBatchSampler, loader.batch_sampler)
        batch_sampler.load_state_dict(state)
        if ended:  # Trainer starts the next epoch
            if not loader.sampler.cursor.done:
                batch_sampler.load_state_dict(batch_sampler.state_for(epoch, loader.sampler.end_position(epoch, 0)))
            return 0
        batch_sampler.skip_ahead(batches * processes)
        return batches

    def _check_trainers_resume(self, resume_dir: str, loaders: tuple[int, int]) -> None:
        """Refuse a checkpoint whose loader position is not where Trainer's own resume continues.

        ``loaders`` is ``(epoch, micro-batches of it consumed)`` by the saved state. Trainer derives
        its own from ``global_step`` alone, as ``Trainer._init_training_state`` does (tests pin the
        arithmetic): ``global_step // steps_per_epoch`` epochs, then ``global_step % steps_per_epoch``
        steps of ``gradient_accumulation_steps`` micro-batches, skipped with ``skip_first_batches``.
        Where they differ, Trainer would skip real batches or start the epoch over: never silently.
        """
        global_step = TrainerState.load_from_json(os.path.join(resume_dir, TRAINER_STATE_NAME)).global_step
        accumulation = self.args.gradient_accumulation_steps
        steps_per_epoch = max(-(-self._epoch_batches // accumulation), 1)
        skip = 0 if self.args.ignore_data_skip else global_step % steps_per_epoch * accumulation
        trainers = (global_step // steps_per_epoch, skip)
        if trainers == loaders:
            return
        fix = (
            "resume without ignore_data_skip=True (the loader's skip reads nothing)"
            if self.args.ignore_data_skip
            else "resume with the gradient_accumulation_steps, dataset length and batch size that wrote it"
        )
        raise ResumeError(
            f"{resume_dir}: Trainer resumes at global_step {global_step} in epoch {trainers[0]} after "
            f"{trainers[1]} micro-batches ({steps_per_epoch} steps an epoch of gradient_accumulation_steps="
            f"{accumulation}, ignore_data_skip={self.args.ignore_data_skip}), but the loader's state "
            f"({STATE_FILE}) left off in epoch {loaders[0]} after {loaders[1]}; {fix}"
        )

    def _save_loader_state(self, output_dir: str) -> None:
        """Write ``resumable_data.json`` into the checkpoint Trainer has just written.

        Not while the position in the epoch is unknown: a count of only the batches trained since the
        resume would put a later resume behind Trainer's skip (and at an epoch's end, in the old epoch).
        """
        loader = self._train_loader
        if loader is None or self._batches_in_epoch is None or not self.args.should_save:
            return
        processes = self.accelerator.num_processes
        batch_sampler = cast(ResumableBatchSampler, loader.batch_sampler)
        if self._batches_in_epoch >= self._epoch_batches:
            position = loader.sampler.end_position(loader.epoch, 0)  # the epoch is over even where batches were dropped
        else:
            position = batch_sampler.position_after(loader.epoch, 0, self._batches_in_epoch * processes)
        saved = {
            _VERSION: STATE_VERSION,
            _PROCESSES: processes,
            _BATCHES: self._batches_in_epoch,
            _LOADER: batch_sampler.state_for(loader.epoch, position),
        }
        # Whole or absent: written beside and renamed, so a kill cannot leave half a file to resume from.
        path = Path(output_dir, STATE_FILE)
        partial = path.with_name(STATE_FILE + ".tmp")
        with durable_file(partial) as file:
            file.write(json.dumps(saved).encode())
        os.replace(partial, path)
        fsync_dir(path.parent)  # the rename itself survives a crash

    def _begin_epoch(self) -> None:
        self._batches_in_epoch, self._resumed_batches = self._resumed_batches, 0


def _writers(folder: str) -> int:
    """How many processes wrote checkpoint ``folder``: its :data:`STATE_FILE`'s count when readable,
    else 1 with Trainer's single-process ``rng_state.pth``, else one more than the highest
    ``rng_state_<i>.pth`` present (a process whose file a kill left out is found missing then)."""
    try:
        with open(os.path.join(folder, STATE_FILE)) as f:
            count = json.load(f).get(_PROCESSES)
        if isinstance(count, int) and not isinstance(count, bool) and count >= 1:
            return count
    except (OSError, ValueError, AttributeError):
        pass
    if os.path.exists(os.path.join(folder, "rng_state.pth")):
        return 1
    indices = [int(m.group(1)) for m in (_RNG_FILE.fullmatch(name) for name in os.listdir(folder)) if m]
    return max(indices, default=0) + 1


def _is_json_object(path: str) -> bool:
    """Whether ``path`` holds a whole JSON object (a file cut short by a kill does not parse)."""
    try:
        with open(path, "rb") as file:
            return isinstance(json.load(file), dict)
    except (OSError, ValueError):
        return False


class _LoaderStateCallback(TrainerCallback):
    """Counts epochs for the mixin and writes the loader's state into every checkpoint."""

    def __init__(self, trainer: ResumableTrainerMixin) -> None:
        self._trainer = trainer

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._trainer._begin_epoch()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._trainer._save_loader_state(
            os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        )


class ResumableTrainer(ResumableTrainerMixin, Trainer):
    """``transformers.Trainer`` whose training resumes exactly from any ``checkpoint-N``.

    A drop-in replacement: same arguments, same checkpoints (plus ``resumable_data.json``), and
    ``train(resume_from_checkpoint=True)`` continues with the very batches, augmentations, steps and
    learning rates of the uninterrupted run. See the module docstring for what is saved and how.
    """
