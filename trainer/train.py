"""The training loop, and the checkpoint that lets it stop anywhere and continue exactly.

Read top to bottom: the configuration, the checkpoint layout, then :func:`train`, which builds
everything, restores a checkpoint if there is one, checks the restore (the resume audit) and runs
the loop. A resumed run is bitwise identical to one that was never interrupted (on CPU; on CUDA
with ``--deterministic``) because everything that decides the next step is in the checkpoint:
weights, AdamW's moments, the scheduler's step, the data loader's position, every RNG and the
step counter.

Under ``torchrun`` the same function runs on every rank (see :mod:`trainer.parallel`): DDP (or
FSDP2 with ``--fsdp``), rank 0 choosing the checkpoint and writing checkpoints and metrics, every
rank's RNG state gathered into the checkpoint, and elastic resume on another number of ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import signal
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import resumable_data
from resumable_data import CheckpointManager, DataLoaderState, ResumableDataLoader, ResumeError

from . import parallel
from .data import TokenWindows, default_cache_dir, prepare_data
from .dcp_store import DcpCheckpoints
from .model import GPT, ModelConfig

__all__ = ["TrainConfig", "TrainResult", "read_metrics", "train"]

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
CHECKPOINT_FORMATS = ("file", "dcp", "dcp-async")

# Keys inside "train_state" and "audit".
TRAIN_STATE_VERSION = 1
VERSION = "version"
STEP = "step"
TOKENS_SEEN = "tokens_seen"
BEST_VAL_LOSS = "best_val_loss"
NEXT_BATCH = "next_batch"
NEXT_LR = "next_lr"
# The batch layout that wrote the checkpoint, for an elastic resume (absent in older checkpoints:
# one rank, and the flags' batch size and accumulation).
WORLD_SIZE = "world_size"
BATCH_SIZE = "batch_size"
GRAD_ACCUM = "grad_accum"

# The model's shape comes from the checkpoint on resume; these TrainConfig fields may only repeat it.
ARCHITECTURE_FIELDS = ("block_size", "n_layer", "n_head", "n_embd", "dropout")

CHECKPOINT_FOLDER = "checkpoints"
DCP_FOLDER = "dcp"
METRICS_FILE = "metrics.jsonl"
ADAM_BETAS = (0.9, 0.95)


def _option(default: Any, help: str) -> Any:
    """A config field with the ``--flag`` help text the command line is generated from."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    """Everything a run needs. Each field is also a ``python -m trainer`` flag (``--max-steps``...).

    The defaults are the README's main run: a 0.8M-parameter model on the standard library's
    source that shows a clearly falling loss within a few minutes on 2 CPU cores.
    """

    run_dir: str = _option("runs/default", "folder for checkpoints and metrics")
    data: str | None = _option(None, "text file or folder (default: Python's stdlib source)")
    cache_dir: str | None = _option(None, "where tokenized corpora are cached")
    resume: str = _option("auto", "'auto' (newest valid checkpoint, if any), 'never', or a checkpoint path")
    # Architecture: None means "from the checkpoint on resume, else ModelConfig's default".
    block_size: int | None = _option(None, "context length in bytes")
    n_layer: int | None = _option(None, "transformer blocks")
    n_head: int | None = _option(None, "attention heads")
    n_embd: int | None = _option(None, "embedding width")
    dropout: float | None = _option(None, "dropout probability")
    # Optimization.
    batch_size: int = _option(32, "sequences per micro-batch")
    grad_accum: int = _option(1, "micro-batches per optimizer step")
    max_steps: int = _option(1000, "optimizer steps; the LR schedule spans them")
    lr: float = _option(3e-3, "peak learning rate")
    min_lr: float = _option(3e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = _option(50, "linear warmup steps")
    weight_decay: float = _option(0.1, "AdamW weight decay (linear weights only)")
    grad_clip: float = _option(1.0, "clip the gradient norm to this (0: off)")
    # Evaluation and checkpoints.
    eval_every: int = _option(100, "evaluate (and checkpoint) every N steps")
    eval_batches: int = _option(8, "validation batches per evaluation")
    checkpoint_every: int = _option(100, "checkpoint every N steps")
    keep_last: int = _option(2, "newest checkpoints to keep (>= 2; the best is kept too)")
    async_save: bool = _option(False, "write checkpoints in a background thread while training goes on")
    stop_at: int | None = _option(None, "save and exit after this step, as if preempted")
    crash_at_step: int | None = _option(None, "testing: kill -9 this process during this step")
    # System.
    seed: int = _option(1337, "seed for initialization, data order and dropout")
    device: str = _option("auto", "'auto' (CUDA when available), 'cpu', 'cuda', 'cuda:1'...")
    num_workers: int = _option(0, "DataLoader worker processes")
    compile: bool = _option(False, "torch.compile the model (exact resume is verified only without it)")
    deterministic: bool = _option(False, "torch.use_deterministic_algorithms (exact resume on CUDA)")
    progress: bool = _option(True, "show a progress bar")
    # Distributed (under torchrun).
    checkpoint_format: str = _option(
        "file", "'file' (one weights_only file, rank 0), 'dcp' or 'dcp-async' (torch.distributed.checkpoint)"
    )
    elastic: str = _option(
        "per-rank-batch",
        "on a resume with another number of ranks keep the 'per-rank-batch' or the 'global-batch' (changes --grad-accum), or 'refuse'",
    )
    fsdp: bool = _option(False, "shard the model with FSDP2 fully_shard instead of DDP (torchrun; meant for CUDA)")
    record_indices: bool = _option(False, "testing: log each rank's batch indices to RUN_DIR/indices.rankR.jsonl")

    def validate(self) -> None:
        """Check the values a user typed, before anything is built.

        Raises:
            ValueError: naming the flag and the value.
        """
        at_least = {
            "batch_size": 1,
            "grad_accum": 1,
            "max_steps": 1,
            "warmup_steps": 0,
            "eval_every": 1,
            "eval_batches": 1,
            "checkpoint_every": 1,
            "keep_last": 2,
            "num_workers": 0,
        }
        for name, minimum in at_least.items():
            value = getattr(self, name)
            if value < minimum:
                raise ValueError(f"--{_flag(name)} should be >= {minimum}, but got {value}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "lr" and value == 0):
                raise ValueError(f"--{_flag(name)} should be a finite number >= 0 (lr > 0), but got {value}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        for name, choices in (("checkpoint_format", CHECKPOINT_FORMATS), ("elastic", parallel.ELASTIC_POLICIES)):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"--{_flag(name)} should be one of {', '.join(choices)}, but got {getattr(self, name)!r}"
                )
        for name in ("stop_at", "crash_at_step"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= self.max_steps:
                raise ValueError(
                    f"--{_flag(name)} should be between 1 and --max-steps {self.max_steps}, but got {value}"
                )


@dataclass
class TrainResult:
    """What one call to :func:`train` did (this process only; a resumed run has its own)."""

    run_dir: Path
    step: int
    losses: dict[int, float]
    val_losses: dict[int, float]
    best_val_loss: float
    resumed_from: Path | None
    stopped_by: str | None


def _flag(name: str) -> str:
    return name.replace("_", "-")


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """The learning rate of 0-based optimizer step ``step``, as a fraction of the peak.

    Linear warmup (the first steps' Adam moments are too noisy for the full rate), then cosine
    decay from 1 to ``min_ratio`` at ``max_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _schedule(config: TrainConfig, step: int) -> float:
    return lr_multiplier(step, config.warmup_steps, config.max_steps, config.min_lr / config.lr)


def batch_fingerprint(indices: list[list[int]]) -> str:
    """A short hash of the dataset indices of the next optimizer step's micro-batches."""
    return hashlib.sha256(json.dumps(indices).encode()).hexdigest()[:16]


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a run's metrics log, oldest first (a line cut off by a kill is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics log at {path}; is {run_dir} a run folder?")
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            events.append(json.loads(line))
    return events


class _Metrics:
    """Appends one JSON line per event; line-buffered, so a kill -9 loses at most a partial line."""

    def __init__(self, path: Path) -> None:
        self._file: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the run; close() ends it

    def log(self, event: str, **values: Any) -> None:
        self._file.write(json.dumps({"event": event, "time": time.time(), **values}) + "\n")

    def close(self) -> None:
        self._file.close()


class _NoMetrics:
    """What ranks other than 0 log to: nothing (rank 0 writes the run's one metrics file)."""

    def log(self, event: str, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass


class _GracefulStop:
    """SIGTERM and SIGINT set a flag; the loop finishes its step, saves and exits.

    A preempted job (SIGTERM) or a Ctrl-C thus always leaves a checkpoint of its last step. A
    second Ctrl-C raises KeyboardInterrupt at once, for when saving itself hangs.
    """

    def __init__(self) -> None:
        self.reason: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _GracefulStop:
        # Handlers can only be installed from the main thread (a notebook or test may call
        # train() from another one; it then simply cannot be stopped by a signal).
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name
        tqdm.write(f"received {self.reason}: finishing this step, then saving (Ctrl-C again aborts without saving)")


def _model_config(config: TrainConfig, saved: Mapping[str, Any] | None) -> ModelConfig:
    """The architecture: the checkpoint's on resume (flags may only repeat it), else the flags'.

    Raises:
        ResumeError: a flag conflicts with the checkpoint, or the checkpoint's config is invalid.
    """
    requested = {name: getattr(config, name) for name in ARCHITECTURE_FIELDS if getattr(config, name) is not None}
    if saved is None:
        return ModelConfig(**requested)
    try:
        restored = ModelConfig(**saved)
    except (TypeError, ValueError) as e:
        raise ResumeError(f"the checkpoint's model_config {dict(saved)} is not valid: {e}") from e
    conflicts = [
        f"--{_flag(name)} {value} (checkpoint: {getattr(restored, name)})"
        for name, value in requested.items()
        if value != getattr(restored, name)
    ]
    if conflicts:
        raise ResumeError(
            "on resume the architecture comes from the checkpoint, and these flags conflict with it: "
            f"{', '.join(conflicts)}; drop them to resume, or train a new model in another --run-dir"
        )
    return restored


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


def _read_checkpoint(path: Path, store: DcpCheckpoints | None, run_dir: Path, keep_last: int) -> dict[str, Any]:
    """This rank's copy of the checkpoint (for DCP: its rank-0 part; the shards load later).

    Raises:
        ResumeError: unreadable, or not written by this trainer.
    """
    if store is not None:
        checkpoint, expected = DcpCheckpoints.read_extras(path), EXTRA_KEYS
    else:
        # Only rank 0 holds the run folder's lock; the others just read.
        with CheckpointManager(run_dir / CHECKPOINT_FOLDER, keep_last=keep_last, lock=False) as reader:
            # map_location="cpu": nothing lands on the GPU until the model is built and moved there.
            checkpoint, expected = reader.load(path, map_location="cpu"), CHECKPOINT_KEYS
    missing = [key for key in expected if key not in checkpoint]
    if missing:
        raise ResumeError(f"checkpoint {path} lacks {missing}; was it written by this trainer (--checkpoint-format)?")
    return checkpoint


def _saved_layout(state: Mapping[str, Any], config: TrainConfig) -> tuple[int, int, int]:
    """(world size, per-rank batch, gradient accumulation) of the run that wrote ``train_state``."""
    try:
        return (
            int(state.get(WORLD_SIZE, 1)),
            int(state.get(BATCH_SIZE, config.batch_size)),
            int(state.get(GRAD_ACCUM, config.grad_accum)),
        )
    except (TypeError, ValueError) as e:
        raise ResumeError(f"the checkpoint's train_state has a malformed batch layout {dict(state)}: {e!r}") from e


def _wrap(model: GPT, config: TrainConfig, ranks: parallel.Parallel) -> torch.nn.Module:
    """The model as the loop calls it: DDP, FSDP2 (``--fsdp``), or itself in a single process."""
    if config.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)  # the embedding, tied to the output head, stays in the root group
        return model
    if not ranks.distributed:
        return model
    # The model has no buffers, so a DDP forward runs no collective (evaluation uses the bare model).
    device_ids = [ranks.device.index] if ranks.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def _gradient_sync(wrapped: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if isinstance(wrapped, DistributedDataParallel) and not sync:
        return wrapped.no_sync()
    if hasattr(wrapped, "set_requires_gradient_sync"):  # an FSDP2 module
        wrapped.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def _local(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor (FSDP's gradient norm), or the tensor itself."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _dcp_app(wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: ResumableDataLoader) -> dict[str, Any]:
    """What DCP saves and loads, under fixed keys: sharded model and optimizer, the global data state."""
    model_state, optimizer_state = get_state_dict(wrapped, optimizer)
    return {MODEL: model_state, OPTIMIZER: optimizer_state, DATALOADER: DataLoaderState(loader)}


def _next_step_fingerprint(loader: ResumableDataLoader, grad_accum: int, ranks: parallel.Parallel) -> str:
    """The next optimizer step's batch indices, of all ranks in rank order (a collective)."""
    mine = loader.peek_indices(grad_accum)
    return batch_fingerprint(mine) if ranks.world_size == 1 else batch_fingerprint(ranks.gather(mine))


def _weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the full weights (gathered from shards under FSDP: a collective)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()):
        digest.update(name.encode())
        digest.update(_local(tensor).detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too


def _endless(loader: ResumableDataLoader) -> Iterator[Any]:
    """Batches forever: each new ``iter()`` continues the loader's epoch, or starts the next."""
    while True:
        yield from loader


@torch.no_grad()
def _evaluate(
    model: torch.nn.Module,
    val: TokenWindows,
    indices: list[int],
    batch_size: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager[Any],
) -> float:
    """Mean loss over a fixed set of validation windows.

    It draws no random numbers (eval mode has no dropout; batches are stacked by hand rather than
    through a DataLoader, whose iterators draw a seed), so evaluating never changes the training
    run: a checkpoint written right after an evaluation resumes identically.
    """
    model.eval()
    losses = []
    for start in range(0, len(indices), batch_size):
        pairs = [val[i] for i in indices[start : start + batch_size]]
        x = torch.stack([p[0] for p in pairs]).to(device)
        y = torch.stack([p[1] for p in pairs]).to(device)
        with autocast:
            _, loss = model(x, y)
        losses.append(loss.item())
    model.train()
    return sum(losses) / len(losses)


def train(config: TrainConfig) -> TrainResult:
    """Train, resuming from the run folder's newest valid checkpoint unless told otherwise.

    Started by ``torchrun``, every rank runs this: data-parallel (DDP, or FSDP2 with ``--fsdp``)
    over gloo on CPU or NCCL on CUDA; rank 0 alone writes checkpoints and metrics.

    Args:
        config: the run; see :class:`TrainConfig`.

    Returns:
        What this call did; the checkpoints and ``metrics.jsonl`` are in ``config.run_dir``.

    Raises:
        ValueError: an invalid setting.
        ResumeError: the checkpoint is corrupt or does not fit this run, the resume audit failed,
            or another trainer holds the run folder (``CheckpointLockedError``). Under torchrun
            every rank raises it.

    Example:
        >>> train(TrainConfig(run_dir="runs/a", max_steps=100, stop_at=40))  # saves step 40, returns
        >>> train(TrainConfig(run_dir="runs/a", max_steps=100))  # continues from step 40 to 100
    """
    config.validate()
    ranks = parallel.start(config.device)
    clean = False
    try:
        result = _train(config, ranks)
        clean = True
        return result
    except BaseException as e:
        # The traceback holds the training frame, and with it the DDP model: free it before the
        # process group goes (see parallel.stop).
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        parallel.stop(ranks, clean=clean)


def _train(config: TrainConfig, ranks: parallel.Parallel) -> TrainResult:
    device = ranks.device
    if config.deterministic:
        # cuBLAS is deterministic only with a fixed workspace, set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    if config.fsdp and not ranks.distributed:
        raise ValueError(
            "--fsdp shards the model over the ranks of a torchrun job; start it with torchrun --nproc_per_node N"
        )
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    say = tqdm.write if ranks.is_main else (lambda message: None)

    with contextlib.ExitStack() as stack:
        store = (
            DcpCheckpoints(run_dir / DCP_FOLDER, keep_last=config.keep_last, is_main=ranks.is_main,
                           async_save=config.checkpoint_format == "dcp-async")
            if config.checkpoint_format != "file" else None
        )  # fmt: skip
        manager: CheckpointManager | None = None

        def choose() -> str | None:
            # Rank 0 locks the run folder first, so a second job on it stops before touching
            # anything, and picks the checkpoint once for every rank.
            nonlocal manager
            manager = stack.enter_context(
                CheckpointManager(run_dir / CHECKPOINT_FOLDER, keep_last=config.keep_last, async_save=config.async_save)
            )
            if store is not None:
                store.remove_leftovers()
            path = _find_checkpoint(store if store is not None else manager, config.resume)
            return None if path is None else str(path)

        chosen = ranks.decide(choose)
        resume_path = Path(chosen) if chosen is not None else None
        # Every rank reads the same checkpoint; one that cannot stops the job with the reason.
        checkpoint: dict[str, Any] | None = None
        problem: ResumeError | None = None
        if resume_path is not None:
            try:
                checkpoint = _read_checkpoint(resume_path, store, run_dir, config.keep_last)
            except ResumeError as e:
                problem = e
        ranks.all_or_none(problem, f"reading checkpoint {resume_path}")
        model_config = _model_config(config, checkpoint[MODEL_CONFIG] if checkpoint else None)
        saved_world, saved_batch, saved_accum = (
            _saved_layout(checkpoint[TRAIN_STATE], config)
            if checkpoint
            else (ranks.world_size, config.batch_size, config.grad_accum)
        )
        plan = parallel.elastic_plan(
            policy=config.elastic, saved_world=saved_world, saved_batch=saved_batch, saved_accum=saved_accum,
            world=ranks.world_size, batch=config.batch_size, accum=config.grad_accum,
        )  # fmt: skip
        grad_accum = plan.grad_accum

        data = prepare_data(config.data, Path(config.cache_dir) if config.cache_dir else default_cache_dir())
        train_windows = TokenWindows(data.train, model_config.block_size)
        val_windows = TokenWindows(data.val, model_config.block_size)
        # The same validation windows at every evaluation, spread over the split, so evaluations
        # are comparable with each other.
        n_val = min(len(val_windows), config.eval_batches * config.batch_size)
        val_indices = list(range(0, len(val_windows), len(val_windows) // n_val))[:n_val]

        _seed_everything(config.seed)  # the same initial weights on every rank
        model = GPT(model_config)
        model.to(device)
        if ranks.rank > 0:
            _seed_everything(parallel.rank_seed(config.seed, ranks.rank))  # different dropout masks per rank
        wrapped = _wrap(model, config, ranks)
        optimizer = torch.optim.AdamW(model.param_groups(config.weight_decay), lr=config.lr, betas=ADAM_BETAS)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(config, s))
        loader = ResumableDataLoader(
            train_windows,
            batch_size=config.batch_size,
            shuffle=True,
            seed=config.seed,
            rank=ranks.rank,
            world_size=ranks.world_size,
            drop_last=True,  # every step sees the same number of tokens
            num_workers=config.num_workers,
            pin_memory=device.type == "cuda",
        )
        if len(loader) == 0:  # drop_last with fewer windows than a batch: an endless empty loop
            raise ValueError(
                f"the training split has {len(train_windows)} windows of {model_config.block_size} bytes, fewer "
                f"than one batch of {config.batch_size} per rank on {ranks.world_size} ranks; use a smaller "
                "--batch-size or --block-size, or more data"
            )
        say(
            f"{'resuming from ' + str(resume_path) if resume_path else 'training from scratch'} | "
            f"{model.num_parameters() / 1e6:.2f}M parameters on {device} x {ranks.world_size} | {data.describe()} | "
            f"{len(loader) // grad_accum} optimizer steps per epoch"
        )
        step, tokens_seen, best_val_loss = 0, 0, math.inf
        rng_note = "restored"
        if checkpoint is not None:
            if store is not None:
                app = _dcp_app(wrapped, optimizer, loader)
                DcpCheckpoints.load(resume_path, app)  # type: ignore[arg-type]
                model_state, optimizer_state = app[MODEL], app[OPTIMIZER]
            else:
                model_state, optimizer_state = checkpoint[MODEL], checkpoint[OPTIMIZER]
                loader.load_state_dict(checkpoint[DATALOADER])
            # After the scheduler is built: its constructor overwrites the optimizer's lr, and
            # these loads put the saved one back. The optimizer casts AdamW's moments to the
            # device of the (already moved) parameters.
            try:
                set_state_dict(
                    wrapped, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                    options=StateDictOptions(full_state_dict=store is None and ranks.distributed),
                )  # fmt: skip
            except (KeyError, RuntimeError, ValueError) as e:
                raise ResumeError(
                    f"the model or optimizer state of {resume_path} does not fit this model: {e}; was it written by "
                    "this trainer version (optimizer state keyed by parameter name)?"
                ) from e
            scheduler.load_state_dict(checkpoint[LR_SCHEDULER])
            step, tokens_seen, best_val_loss = _load_train_state(checkpoint[TRAIN_STATE], resume_path)
            # The audit runs on every rank. After a world-size change the batches are cut
            # differently, so only the learning rate can be compared.
            same_world = saved_world == ranks.world_size
            expected_batch = _next_step_fingerprint(loader, grad_accum, ranks) if same_world else None
            _audit(checkpoint[AUDIT], expected_batch, config, step, resume_path, say)
            if not same_world:
                say(
                    f"world size changed ({config.elastic}): {plan.describe()}; the rest of epoch {loader.epoch} is read exactly once"
                )
            # Last, because building the model above drew from the RNGs it restores.
            rng_states = checkpoint[RNG]
            rng_states = [rng_states] if isinstance(rng_states, Mapping) else list(rng_states)
            if ranks.rank < len(rng_states):
                resumable_data.restore_rng_state(rng_states[ranks.rank])
            else:  # a rank the checkpoint's job did not have: derived, so the resume is reproducible
                _seed_everything(parallel.rank_seed(config.seed, ranks.rank, step))
            if ranks.world_size > len(rng_states):
                rng_note = f"ranks {len(rng_states)}..{ranks.world_size - 1} seeded from (seed, step, rank)"
            checkpoint = None  # free the CPU copy of the weights

        autocast: contextlib.AbstractContextManager[Any] = (
            torch.autocast(device_type="cuda", dtype=torch.bfloat16)
            if device.type == "cuda"
            else contextlib.nullcontext()
        )
        # Compile after loading: the compiled wrapper renames state_dict keys, so the plain model
        # is what gets saved and loaded.
        forward = torch.compile(wrapped) if config.compile else wrapped
        # Evaluation runs on every rank with the same windows, outside DDP (whose forward would
        # expect a matching backward); an FSDP model gathers its shards on every rank.
        evaluate_with = model if ranks.distributed else forward
        tokens_per_step = config.batch_size * grad_accum * ranks.world_size * model_config.block_size

        def save(val_loss: float | None) -> Path:
            # Collectives first, on every rank: each rank's RNG state and next batch.
            extras = {
                LR_SCHEDULER: scheduler.state_dict(),
                RNG: ranks.gather(resumable_data.capture_rng_state()),  # indexed by rank
                TRAIN_STATE: {
                    VERSION: TRAIN_STATE_VERSION, STEP: step, TOKENS_SEEN: tokens_seen, BEST_VAL_LOSS: best_val_loss,
                    WORLD_SIZE: ranks.world_size, BATCH_SIZE: config.batch_size, GRAD_ACCUM: grad_accum,
                },
                MODEL_CONFIG: asdict(model_config),
                LIBRARY_VERSION: resumable_data.__version__,
                # What the next step will use, checked after a resume (see _audit).
                AUDIT: {NEXT_BATCH: _next_step_fingerprint(loader, grad_accum, ranks), NEXT_LR: optimizer.param_groups[0]["lr"]},
            }  # fmt: skip
            if store is not None:
                path = store.save(step, _dcp_app(wrapped, optimizer, loader), extras)
            else:
                options = StateDictOptions(full_state_dict=ranks.distributed, cpu_offload=ranks.distributed)
                model_state, optimizer_state = get_state_dict(wrapped, optimizer, options=options)
                data_state = resumable_data.global_state(loader)  # refuses ranks that disagree
                path = run_dir / CHECKPOINT_FOLDER
                if manager is not None:
                    parts = {MODEL: model_state, OPTIMIZER: optimizer_state, DATALOADER: data_state, **extras}
                    path = manager.save(step, {key: parts[key] for key in CHECKPOINT_KEYS}, metric=val_loss)
            metrics.log("checkpoint", step=step, path=str(path))
            return path

        metrics = stack.enter_context(
            contextlib.closing(_Metrics(run_dir / METRICS_FILE) if ranks.is_main else _NoMetrics())
        )
        indices_log = (
            stack.enter_context(open(run_dir / f"indices.rank{ranks.rank}.jsonl", "a", buffering=1))
            if config.record_indices
            else None
        )
        metrics.log(
            "start", step=step, device=str(device), world_size=ranks.world_size, pids=ranks.gather(os.getpid()),
            parameters=model.num_parameters(),
            config=asdict(config), model_config=asdict(model_config), data=data.describe(),
        )  # fmt: skip
        if resume_path is not None:
            metrics.log(
                "resume", step=step, checkpoint=str(resume_path), audit="ok", elastic=config.elastic,
                changes=plan.changes, rng=rng_note,
            )  # fmt: skip

        result = TrainResult(run_dir, step, {}, {}, best_val_loss, resume_path, None)
        if step == 0:
            # The untrained model's loss is the baseline the falling loss is measured against. It
            # has no checkpoint, so it does not count towards best_val_loss.
            result.val_losses[0] = _evaluate(
                evaluate_with, val_windows, val_indices, config.batch_size, device, autocast
            )
            metrics.log("eval", step=0, val_loss=result.val_losses[0])
            say(f"step 0: val loss {result.val_losses[0]:.4f}")

        batches = _endless(loader)
        stack.callback(batches.close)  # shuts down DataLoader workers
        if store is not None:
            stack.callback(store.wait)  # an asynchronous save still in flight completes its folder
        bar = stack.enter_context(
            tqdm(
                total=config.max_steps,
                initial=step,
                disable=not (config.progress and ranks.is_main),
                unit="step",
                dynamic_ncols=True,
            )
        )
        tokens_per_second = 0.0
        last_saved: Path | None = None
        stopped_by: str | None = None
        stop = stack.enter_context(_GracefulStop())
        while step < config.max_steps:
            started = time.perf_counter()
            lr = optimizer.param_groups[0]["lr"]
            loss_sum = torch.zeros((), device=device)
            for micro in range(grad_accum):
                upcoming = loader.peek_indices(1)[0] if indices_log is not None else None
                x, y = next(batches)
                if indices_log is not None:
                    indices_log.write(
                        json.dumps(
                            {
                                "step": step + 1,
                                "epoch": loader.epoch,
                                "world_size": ranks.world_size,
                                "indices": upcoming,
                            }
                        )
                        + "\n"
                    )
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                # In DDP and FSDP only the last micro-batch synchronizes gradients.
                with _gradient_sync(wrapped, micro == grad_accum - 1):
                    with autocast:
                        _, loss = forward(x, y)
                    # Divide so the accumulated gradient is the mean over micro-batches, as
                    # with one big batch, rather than their sum.
                    (loss / grad_accum).backward()
                loss_sum += loss.detach()
            if config.crash_at_step == step + 1 and ranks.is_main:
                os.kill(os.getpid(), signal.SIGKILL)  # a real kill -9: no handler, no cleanup
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip or math.inf)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens_per_step
            if config.stop_at == step and stop.reason is None:
                stop.reason = f"--stop-at {step}"
            # Read once: a signal arriving after this is handled at the next step. One all-reduce
            # gives the loss over all ranks and tells every rank when any of them was signalled.
            local_stop = stop.reason
            summed_loss, any_stop = ranks.step_sync(loss_sum, local_stop is not None)
            stopped_by = local_stop or ("a signal to another rank" if any_stop else None)
            train_loss = summed_loss / grad_accum  # .item() waits for the GPU
            elapsed = time.perf_counter() - started
            tokens_per_second = (
                tokens_per_step / elapsed
                if tokens_per_second == 0
                else (0.9 * tokens_per_second + 0.1 * tokens_per_step / elapsed)
            )
            result.losses[step] = train_loss
            metrics.log(
                "step",
                step=step,
                loss=train_loss,
                lr=lr,
                grad_norm=_local(grad_norm).item(),
                tokens=tokens_seen,
                step_time=elapsed,
                epoch=loader.epoch,
            )
            bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:,.0f}")
            bar.update()

            val_loss = None
            if step % config.eval_every == 0 or step == config.max_steps:
                val_loss = _evaluate(evaluate_with, val_windows, val_indices, config.batch_size, device, autocast)
                best_val_loss = min(best_val_loss, val_loss)
                result.val_losses[step] = val_loss
                metrics.log("eval", step=step, val_loss=val_loss, best_val_loss=best_val_loss)
                say(f"step {step}: train loss {train_loss:.4f}, val loss {val_loss:.4f} (best {best_val_loss:.4f})")
            # Checkpoints fall on optimizer-step boundaries only, so gradient accumulation
            # never has to be resumed halfway. Each evaluation is saved with its metric,
            # which makes the manager keep the best model.
            if val_loss is not None or step % config.checkpoint_every == 0 or step == config.max_steps or stopped_by:
                last_saved = save(val_loss)
            if stopped_by:
                break

        bar.close()  # before the last message, so the message is not drawn over
        result.step, result.best_val_loss, result.stopped_by = step, best_val_loss, stopped_by
        if stopped_by is not None:
            metrics.log("stop", step=step, reason=stopped_by)
            say(f"stopped by {stopped_by}: saved {last_saved}; run the same command again to continue")
        else:
            # Each rank's weights, hashed: data-parallel ranks must end with identical ones.
            digests = ranks.gather(_weights_digest(model))
            metrics.log(
                "end", step=step, best_val_loss=best_val_loss, tokens_per_second=tokens_per_second, rank_weights=digests
            )
            say(f"done: {step} steps, best val loss {best_val_loss:.4f}, checkpoints in {run_dir}")
    return result


def _load_train_state(state: Mapping[str, Any], path: Path | None) -> tuple[int, int, float]:
    """Step, tokens seen and best validation loss from a checkpoint's ``train_state``.

    Raises:
        ResumeError: the state was written by an incompatible trainer or is malformed.
    """
    if state.get(VERSION) != TRAIN_STATE_VERSION:
        raise ResumeError(
            f"checkpoint {path} has train_state version {state.get(VERSION)!r}, but this trainer reads "
            f"version {TRAIN_STATE_VERSION}; resume it with the trainer that wrote it"
        )
    try:
        return int(state[STEP]), int(state[TOKENS_SEEN]), float(state[BEST_VAL_LOSS])
    except (KeyError, TypeError, ValueError) as e:
        raise ResumeError(f"checkpoint {path} has a malformed train_state {dict(state)}: {e!r}") from e


def _audit(
    recorded: Mapping[str, Any],
    expected_batch: str | None,
    config: TrainConfig,
    step: int,
    path: Path | None,
    say: Any = tqdm.write,
) -> None:
    """Check that the restored run will take the step the interrupted one would have taken.

    The checkpoint recorded a fingerprint of the next step's batch indices and the next learning
    rate. Restoring puts the loader and the scheduler back, but flags can still have changed what
    comes next (batch size, gradient accumulation, seed, schedule), so recompute both and compare.

    ``expected_batch`` is this run's fingerprint of the next step, or None after a world-size
    change (batches are then cut differently, and only the learning rate is compared).

    Raises:
        ResumeError: either differs; the message says what probably changed.
    """
    if expected_batch is not None and recorded[NEXT_BATCH] != expected_batch:
        raise ResumeError(
            f"resume audit failed: after step {step} the checkpoint {path} expects the next batch "
            f"{recorded[NEXT_BATCH]}, but this run would read {expected_batch}. The data order changed: "
            "most likely --batch-size, --grad-accum or --seed differs from the run that wrote it, or the "
            "corpus (--data, --block-size) changed. Resume with the original settings or use another --run-dir"
        )
    # The schedule as this run's flags define it, not the scheduler's restored value: a changed
    # --lr, --min-lr, --warmup-steps or --max-steps shows up only here.
    expected_lr = config.lr * _schedule(config, step)
    if recorded[NEXT_LR] != expected_lr:
        raise ResumeError(
            f"resume audit failed: at step {step} the checkpoint {path} expects learning rate "
            f"{recorded[NEXT_LR]!r}, but this run's schedule gives {expected_lr!r}: --lr, --min-lr, "
            "--warmup-steps or --max-steps differs from the run that wrote it (its values are in the "
            f"'start' events of {METRICS_FILE}). Resume with the original settings or use another --run-dir"
        )
    say(
        f"resume audit ok: step {step}, next batch {expected_batch or '(another world size: not compared)'} "
        f"and next lr {expected_lr:.3e} match the checkpoint"
    )
