"""The trainer's checkpoints: their fixed keys, which one to resume from, and reading and writing them.

As in torchtitan, a checkpoint is a dict of the run's stateful parts under fixed keys:

| key | holds |
|---|---|
| ``model``, ``optimizer`` | the model's and AdamW's state (full; sharded in DCP's files) |
| ``lr_scheduler`` | LambdaLR's state |
| ``dataloader`` | the data loader's global state: epoch, position and what fixes the order |
| ``rng`` | every rank's RNG states, indexed by rank |
| ``train_state`` | :class:`trainer.train_state.TrainState` |
| ``model_config``, ``library_version`` | the architecture; ``resumable_data.__version__`` |
| ``audit`` | the next step's batch fingerprint and learning rate, checked after a resume |

Two formats: ``file`` (default) is one ``weights_only`` file per step written by rank 0 through
``resumable_data.CheckpointManager``; ``dcp`` / ``dcp-async`` write the model, optimizer and data
state with ``torch.distributed.checkpoint`` (every rank its shards) and the rest in ``trainer.pt``
(:mod:`trainer.dcp_store`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import resumable_data
from resumable_data import CheckpointManager, DataLoaderState, ResumableDataLoader, ResumeError

from . import parallel
from .config import TrainConfig
from .dcp_store import DcpCheckpoints

__all__ = ["CHECKPOINT_FOLDER", "CHECKPOINT_KEYS", "DCP_FOLDER", "Checkpoints"]

# Checkpoint keys, declared once: every checkpoint this trainer writes has exactly these.
MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
RNG = "rng"
TRAIN_STATE = "train_state"
MODEL_CONFIG = "model_config"
LIBRARY_VERSION = "library_version"
AUDIT = "audit"
CHECKPOINT_KEYS = (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, RNG, TRAIN_STATE, MODEL_CONFIG, LIBRARY_VERSION, AUDIT)
# A DCP checkpoint splits them: model, optimizer and data state in DCP's shards, the rest in
# trainer.pt, written by rank 0 and read with weights_only=True.
DCP_KEYS = (MODEL, OPTIMIZER, DATALOADER)
EXTRA_KEYS = tuple(key for key in CHECKPOINT_KEYS if key not in DCP_KEYS)
# Keys inside "audit".
NEXT_BATCH = "next_batch"
NEXT_LR = "next_lr"

CHECKPOINT_FOLDER = "checkpoints"
DCP_FOLDER = "dcp"


class Checkpoints:
    """The run folder's checkpoints: choose one to resume from, read it on every rank, write new ones.

    A context manager: on exit an asynchronous save still in flight completes, and rank 0 releases
    the run folder's lock.

    Args:
        run_dir: the run folder.
        config: the run (``keep_last``, ``async_save``, ``checkpoint_format``).
        ranks: this process's place in the job.
    """

    def __init__(self, run_dir: Path, config: TrainConfig, ranks: parallel.Parallel) -> None:
        self.run_dir, self.ranks = run_dir, ranks
        self.keep_last, self.async_save = config.keep_last, config.async_save
        self.store = (
            DcpCheckpoints(
                run_dir / DCP_FOLDER,
                keep_last=config.keep_last,
                is_main=ranks.is_main,
                async_save=config.async_save or config.checkpoint_format == "dcp-async",
            )
            if config.checkpoint_format != "file"
            else None
        )
        self.manager: CheckpointManager | None = None  # rank 0's, opened by choose()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        with self._stack:
            if self.store is not None:
                self.store.wait()

    def choose(self, resume: str) -> Path | None:
        """The checkpoint to resume from, following ``--resume`` (a collective; None: from scratch).

        Rank 0 locks the run folder first, so a second job on it stops before touching anything,
        and picks the checkpoint once for every rank.

        Raises:
            ResumeError: the folder is locked by another trainer, or ``--resume`` cannot be followed.
        """

        def on_rank_zero() -> str | None:
            self.manager = self._stack.enter_context(
                CheckpointManager(
                    self.run_dir / CHECKPOINT_FOLDER, keep_last=self.keep_last, async_save=self.async_save
                )
            )
            if self.store is not None:
                self.store.remove_leftovers()
            path = _find_checkpoint(self.store if self.store is not None else self.manager, resume)
            return None if path is None else str(path)

        chosen = self.ranks.decide(on_rank_zero)
        return None if chosen is None else Path(chosen)

    def read(self, path: Path | None) -> dict[str, Any] | None:
        """This rank's copy of checkpoint ``path`` (for DCP its rank-0 part; the shards load in :meth:`restore`).

        A collective: a rank that cannot read it stops every rank, with its reason.

        Raises:
            ResumeError: unreadable on some rank, or not written by this trainer.
        """
        checkpoint, problem = None, None
        if path is not None:
            try:
                checkpoint = self._read(path)
            except ResumeError as e:
                problem = e
        self.ranks.all_or_none(problem, f"reading checkpoint {path}")
        return checkpoint

    def _read(self, path: Path) -> dict[str, Any]:
        if self.store is not None:
            checkpoint, expected = self.store.read_extras(path), EXTRA_KEYS
        else:
            # Only rank 0 holds the run folder's lock; the others just read.
            with CheckpointManager(self.run_dir / CHECKPOINT_FOLDER, keep_last=self.keep_last, lock=False) as reader:
                # map_location="cpu": nothing lands on the GPU until the model is built and moved there.
                checkpoint, expected = reader.load(path, map_location="cpu"), CHECKPOINT_KEYS
        missing = [key for key in expected if key not in checkpoint]
        if missing:
            raise ResumeError(
                f"checkpoint {path} lacks {missing}; was it written by this trainer (--checkpoint-format)?"
            )
        return checkpoint

    def restore(
        self,
        path: Path,
        checkpoint: dict[str, Any],
        wrapped: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: ResumableDataLoader,
    ) -> None:
        """Load the model, the optimizer and the data position of ``checkpoint`` (a collective under DCP).

        Call it after the scheduler is built: LambdaLR's constructor overwrites the optimizer's
        learning rate, and this puts the saved one back. AdamW's moments go to the device of the
        (already moved) parameters.

        Raises:
            ResumeError: the state does not fit this model or loader.
        """
        if self.store is not None:
            app = _dcp_app(wrapped, optimizer, loader)
            DcpCheckpoints.load(path, app)
            model_state, optimizer_state = app[MODEL], app[OPTIMIZER]
        else:
            model_state, optimizer_state = checkpoint[MODEL], checkpoint[OPTIMIZER]
            loader.load_state_dict(checkpoint[DATALOADER])
        try:
            set_state_dict(
                wrapped, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                options=StateDictOptions(full_state_dict=self.store is None and self.ranks.distributed),
            )  # fmt: skip
        except (KeyError, RuntimeError, ValueError) as e:
            raise ResumeError(
                f"the model or optimizer state of {path} does not fit this model: {e}; was it written by "
                "this trainer version (optimizer state keyed by parameter name)?"
            ) from e

    def save(
        self,
        step: int,
        states: dict[str, Any],
        wrapped: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: ResumableDataLoader,
        *,
        metric: float | None,
    ) -> Path:
        """Write checkpoint ``step``: model, optimizer and data state from here, the rest from ``states``.

        Every rank calls it (the states are gathered or, under DCP, written by each rank).

        Args:
            states: the checkpoint's other keys (``EXTRA_KEYS``), already gathered from every rank.
            metric: the validation loss of this step, if evaluated: the manager keeps the best.

        Returns:
            The checkpoint's folder (rank 0), or the checkpoint folder (other ranks, file format).
        """
        if self.store is not None:
            return self.store.save(step, _dcp_app(wrapped, optimizer, loader), states)
        distributed = self.ranks.distributed
        options = StateDictOptions(full_state_dict=distributed, cpu_offload=distributed)
        model_state, optimizer_state = get_state_dict(wrapped, optimizer, options=options)
        data_state = resumable_data.global_state(loader)  # refuses ranks that disagree
        if self.manager is None:  # not rank 0
            return self.run_dir / CHECKPOINT_FOLDER
        parts = {MODEL: model_state, OPTIMIZER: optimizer_state, DATALOADER: data_state, **states}
        return self.manager.save(step, {key: parts[key] for key in CHECKPOINT_KEYS}, metric=metric)


def _find_checkpoint(manager: CheckpointManager | DcpCheckpoints, resume: str) -> Path | None:
    """Which checkpoint to resume from, following ``--resume``.

    Raises:
        ResumeError: ``never`` or a path was asked for, but the run folder already holds newer
            checkpoints, which a later ``--resume auto`` would confuse with this run's.
    """
    existing = manager.checkpoints()
    if resume == "auto":
        return manager.latest()
    if resume == "never":
        if existing:
            raise ResumeError(
                f"--resume never, but {manager.directory} already holds checkpoints (newest "
                f"{existing[-1].name}); two runs in one folder would mix their checkpoints: "
                "use another --run-dir or delete that one"
            )
        return None
    path = Path(resume)
    if not path.exists() and (manager.directory / path).exists():
        path = manager.directory / path
    step = CheckpointManager.step_of(path)
    newer = [p.name for p in existing if CheckpointManager.step_of(p) > step]
    if newer:
        raise ResumeError(
            f"--resume {resume} (step {step}), but {manager.directory} holds newer checkpoints {newer}; "
            "resuming from an older one would mix two histories: move them away or use another --run-dir"
        )
    return path


def _dcp_app(wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: ResumableDataLoader) -> dict[str, Any]:
    """What DCP saves and loads, under fixed keys: sharded model and optimizer, the global data state."""
    model_state, optimizer_state = get_state_dict(wrapped, optimizer)
    return {MODEL: model_state, OPTIMIZER: optimizer_state, DATALOADER: DataLoaderState(loader)}
