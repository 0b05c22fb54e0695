"""The trainer's checkpoints: fixed keys, which one to resume from, reading, restoring and writing them,
and the audit that checks a restore.

As in torchtitan, a checkpoint is a dict of the run's stateful parts under fixed keys (the table is in
``trainer/README.md``). ``--checkpoint-format file`` (default) writes one ``weights_only`` file per
step from rank 0 through ``resumable_data.CheckpointManager``; ``dcp`` / ``dcp-async`` write model,
optimizer and data state with ``torch.distributed.checkpoint`` (every rank its shards) and the rest in
``trainer.pt`` (``dcp_store.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from resumable_data import CheckpointManager, ResumeError, Stateful
from resumable_data.checkpoint import choose_checkpoint
from resumable_data.distributed import DataLoaderState, decide_on_rank_zero, fail_together, global_state

from . import parallel
from .config import TrainConfig
from .data import TrainingData
from .dcp_store import DcpCheckpoints
from .metrics import METRICS_FILE, format_lr

# Checkpoint keys, declared once: every checkpoint this trainer writes has exactly these.
MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, RNG = "model", "optimizer", "lr_scheduler", "dataloader", "rng"
TRAIN_STATE, MODEL_CONFIG, LIBRARY_VERSION, AUDIT = "train_state", "model_config", "library_version", "audit"
CHECKPOINT_KEYS = (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, RNG, TRAIN_STATE, MODEL_CONFIG, LIBRARY_VERSION, AUDIT)
# A DCP checkpoint keeps model, optimizer and data state in DCP's shards, the rest in trainer.pt.
DCP_KEYS = (MODEL, OPTIMIZER, DATALOADER)
EXTRA_KEYS = tuple(key for key in CHECKPOINT_KEYS if key not in DCP_KEYS)
NEXT_BATCH, NEXT_LR, DATA_SHA256 = "next_batch", "next_lr", "data_sha256"  # inside "audit"
CHECKPOINT_FOLDER, DCP_FOLDER = "checkpoints", "dcp"


class Checkpoints(contextlib.AbstractContextManager["Checkpoints"]):
    """The run folder's checkpoints: choose one to resume from, read it on every rank, write new ones.

    On exit an asynchronous save still in flight completes, and rank 0 releases the run folder's lock.
    """

    def __init__(self, run_dir: Path, config: TrainConfig, par: parallel.Parallel) -> None:
        self.run_dir, self.par, self.keep_last, self.async_save = run_dir, par, config.keep_last, config.async_save
        self.format = config.checkpoint_format
        self.store: DcpCheckpoints | None = None
        if config.checkpoint_format != "file":
            async_dcp = config.async_save or config.checkpoint_format == "dcp-async"
            self.store = DcpCheckpoints(
                run_dir / DCP_FOLDER, keep_last=config.keep_last, is_main=par.is_main, async_save=async_dcp
            )
        self.manager: CheckpointManager | None = None  # rank 0's, opened by choose()
        self._stack = contextlib.ExitStack()

    def __exit__(self, *exc: object) -> None:
        with self._stack:
            if self.store is not None:
                self.store.close()

    def choose(self, resume: str) -> Path | None:
        """The checkpoint ``--resume`` asks for (None: from scratch). Rank 0 locks the run folder first,
        so a second job on it stops before touching anything, and picks once for every rank.

        Raises:
            ResumeError: the folder is locked by another trainer, ``--resume`` cannot be followed (no
                checkpoint can be resumed, though some exist), or the checkpoints are in the other format.
        """

        def on_rank_zero() -> Path | None:
            folder = self.run_dir / CHECKPOINT_FOLDER
            self.manager = self._stack.enter_context(
                CheckpointManager(folder, keep_last=self.keep_last, async_save=self.async_save)
            )
            self._refuse_the_other_format()
            if self.store is not None:
                self.store.remove_leftovers()
            return choose_checkpoint(self.store.store if self.store else self.manager, resume, option="--resume")

        return decide_on_rank_zero(on_rank_zero)

    def _refuse_the_other_format(self) -> None:
        """The other format's checkpoints are the run's history: starting from scratch here would fork it."""
        other, folder = ("dcp", DCP_FOLDER) if self.store is None else ("file", CHECKPOINT_FOLDER)
        if steps := sorted(p.name for p in (self.run_dir / folder).glob("step-*") if p.is_dir()):
            raise ResumeError(
                f"--checkpoint-format {self.format}, but {self.run_dir / folder} holds this run's checkpoints, written "
                f"with --checkpoint-format {other} (newest {steps[-1]}): resume with --checkpoint-format {other}, "
                f"or train with {self.format} in another --run-dir"
            )

    def read(self, path: Path | None) -> dict[str, Any] | None:
        """This rank's copy of checkpoint ``path`` (under DCP its rank-0 part; the shards load in
        :meth:`restore`). A rank that cannot read it stops every rank, with its reason.

        Raises:
            ResumeError: unreadable on some rank, or not written by this trainer.
        """
        if path is None:  # the same on every rank: rank 0 chose for all
            return None
        return fail_together(f"reading checkpoint {path}", lambda: self._read(path))

    def _read(self, path: Path) -> dict[str, Any]:
        if self.store is not None:
            checkpoint, expected = self.store.read_extras(path), EXTRA_KEYS
        else:
            # Only rank 0 holds the run folder's lock; the others just read. map_location="cpu":
            # nothing lands on the GPU until the model is built and moved there.
            with CheckpointManager(self.run_dir / CHECKPOINT_FOLDER, keep_last=self.keep_last, lock=False) as reader:
                checkpoint, expected = reader.load(path, map_location="cpu"), CHECKPOINT_KEYS
        missing = [key for key in expected if key not in checkpoint]
        if missing:
            raise ResumeError(
                f"checkpoint {path} lacks {missing}; was it written by this trainer (--checkpoint-format)?"
            )
        return checkpoint

    def track(self, wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: Stateful) -> None:
        """The model (as the loop calls it), optimizer and loader that :meth:`restore` and :meth:`save` serve."""
        self.wrapped, self.optimizer, self.loader = wrapped, optimizer, loader

    def restore(self, path: Path, checkpoint: dict[str, Any]) -> None:
        """Load the model, the optimizer and the data position (a collective under DCP).

        Call it after the scheduler is built: LambdaLR's constructor overwrites the optimizer's
        learning rate, and this puts the saved one back. AdamW's moments go to the parameters' device.

        Raises:
            ResumeError: the state does not fit this model or loader.
        """
        if self.store is not None:
            DcpCheckpoints.load(path, app := self._dcp_app())
            model_sd, optim_sd = app[MODEL], app[OPTIMIZER]
        else:
            model_sd, optim_sd = checkpoint[MODEL], checkpoint[OPTIMIZER]
            self.loader.load_state_dict(checkpoint[DATALOADER])
        options = StateDictOptions(full_state_dict=self.store is None and self.par.distributed)
        try:
            set_state_dict(
                self.wrapped, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
            )
        except (KeyError, RuntimeError, ValueError) as e:
            raise ResumeError(
                f"the model or optimizer state of {path} does not fit this model: {e}; was it written by "
                "this trainer version (optimizer state keyed by parameter name)?"
            ) from e

    def save(self, step: int, states: dict[str, Any], *, metric: float | None) -> Path:
        """Write checkpoint ``step``: model, optimizer and data state from here, the rest (``EXTRA_KEYS``,
        gathered from every rank) from ``states``; ``metric`` makes the manager keep the best. Every
        rank calls it. Returns the checkpoint's folder (on ranks > 0 with files: the checkpoints folder).
        """
        if self.store is not None:
            return self.store.save(step, self._dcp_app(), states)
        distributed = self.par.distributed
        options = StateDictOptions(full_state_dict=distributed, cpu_offload=distributed)
        model_state, optimizer_state = get_state_dict(self.wrapped, self.optimizer, options=options)
        data_state = global_state(self.loader)  # refuses ranks that disagree
        if self.manager is None:  # not rank 0
            return self.run_dir / CHECKPOINT_FOLDER
        parts = {MODEL: model_state, OPTIMIZER: optimizer_state, DATALOADER: data_state, **states}
        return self.manager.save(step, {key: parts[key] for key in CHECKPOINT_KEYS}, metric=metric)

    def _dcp_app(self) -> dict[str, Any]:
        """What DCP saves and loads, under fixed keys: sharded model and optimizer, the global data state."""
        model_state, optimizer_state = get_state_dict(self.wrapped, self.optimizer)
        return {MODEL: model_state, OPTIMIZER: optimizer_state, DATALOADER: DataLoaderState(self.loader)}


def next_step_fingerprint(data: TrainingData, grad_accum: int, par: parallel.Parallel) -> str:
    """A short hash of what the next optimizer step reads (``TrainingData.peek``), all ranks' in rank order (a collective)."""
    indices = par.gather(data.peek(grad_accum))
    return hashlib.sha256(json.dumps(indices if par.distributed else indices[0]).encode()).hexdigest()[:16]


def audit(
    recorded: Mapping[str, Any],
    next_batch: str | None,
    data_sha256: str | None,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    step: int,
    path: Path,
) -> None:
    """Check, on every rank, that the restored run takes the step the interrupted one would have taken.

    Restoring puts the loader and the scheduler back, but flags can still have changed what comes
    next (batch size, gradient accumulation, seed, schedule): compare this run's ``next_batch``
    fingerprint (:func:`next_step_fingerprint`) and learning rate with the checkpoint's. ``next_batch``
    is None after a world-size change, when batches are cut differently: only the learning rate compares.
    The fingerprint hashes indices, not tokens: the corpus's ``data_sha256`` is compared too (if both have
    one). The restored optimizer would silently keep the old weight decay, so a changed one is refused too.

    Raises:
        ResumeError: something differs; the message says what probably changed.
    """
    problems = []
    if next_batch is not None and recorded[NEXT_BATCH] != next_batch:
        problems.append(
            f"after step {step} it expects the next batch {recorded[NEXT_BATCH]}, but this run would read {next_batch}: "
            "the data order changed (most likely --batch-size, --grad-accum or --seed differs, or the corpus: "
            "--data, --text-field, --block-size)"
        )
    saved_data = recorded.get(DATA_SHA256)
    if saved_data is not None and data_sha256 is not None and saved_data != data_sha256:
        problems.append(
            f"it was trained on a corpus of sha256 {saved_data[:16]}..., but this run's corpus has "
            f"{data_sha256[:16]}...: the data's content changed (an edited --data file, or for the default corpus "
            "another Python's standard library)"
        )
    # The schedule as this run's flags define it, not the scheduler's restored value: a changed
    # --lr, --min-lr, --warmup-steps or --max-steps shows up only here.
    expected_lr, recorded_lr = config.lr * config.lr_factor(step), recorded[NEXT_LR]
    if recorded_lr != expected_lr:
        problems.append(
            f"at step {step} it expects learning rate {format_lr(recorded_lr)}, but this run's schedule gives "
            f"{format_lr(expected_lr)} ({recorded_lr!r} != {expected_lr!r}): --lr, --min-lr, --warmup-steps or "
            f"--max-steps differs (the original values are in the 'start' events of {METRICS_FILE})"
        )
    if (decay := optimizer.param_groups[0]["weight_decay"]) != config.weight_decay:
        problems.append(
            f"it was trained with weight decay {decay!r}, but this run sets --weight-decay {config.weight_decay!r} "
            "(restoring the optimizer would quietly keep the old value)"
        )
    if problems:
        raise ResumeError(
            f"resume audit failed: the checkpoint {path} does not fit this run: {'; '.join(problems)}. Resume with "
            "the settings of the run that wrote it, or use another --run-dir"
        )
