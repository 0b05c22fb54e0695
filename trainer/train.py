"""The training loop, and the resume that lets it stop anywhere and continue exactly.

:func:`train` reads top to bottom: choose and read a checkpoint, build data, model, optimizer and
scheduler, restore the checkpoint and check the restore (the resume audit), then the loop: fetch,
forward, backward, step, schedule, log, maybe evaluate, maybe checkpoint. A resumed run is bitwise
identical to one that was never interrupted (on CPU; on CUDA with ``--deterministic``) because
everything that decides the next step is in the checkpoint (:mod:`trainer.checkpointing`): weights,
AdamW's moments, the scheduler's step, the data loader's position, every RNG and the train state
(:class:`~trainer.train_state.TrainState`).

Under ``torchrun`` the same function runs on every rank (see :mod:`trainer.parallel`): DDP (or
FSDP2 with ``--fsdp``), rank 0 choosing the checkpoint and writing checkpoints and metrics, every
rank's RNG state gathered into the checkpoint, and elastic resume on another number of ranks.

The loop carries no test hooks: verify-resume's SIGKILL during a step and the batch-index log
of the elastic checks are installed from outside by :mod:`trainer.harness.killpoints`.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import resumable_data
from resumable_data import ResumableDataLoader, ResumeError

from . import parallel
from .checkpointing import (
    AUDIT,
    CHECKPOINT_FOLDER,
    CHECKPOINT_KEYS,
    DCP_FOLDER,
    LIBRARY_VERSION,
    LR_SCHEDULER,
    MODEL,
    MODEL_CONFIG,
    NEXT_BATCH,
    NEXT_LR,
    OPTIMIZER,
    RNG,
    TRAIN_STATE,
    Checkpoints,
)
from .config import TrainConfig, flag
from .data import TokenWindows, default_cache_dir, prepare_data
from .metrics import METRICS_FILE, Metrics, NoMetrics, read_metrics
from .model import GPT, ModelConfig
from .train_state import TrainState

# The names other modules and the tests import from here.
__all__ = [
    "CHECKPOINT_FOLDER",
    "CHECKPOINT_KEYS",
    "DCP_FOLDER",
    "MODEL",
    "OPTIMIZER",
    "TrainConfig",
    "TrainResult",
    "TrainState",
    "read_metrics",
    "train",
]

ADAM_BETAS = (0.9, 0.95)


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

    Example::

        train(TrainConfig(run_dir="runs/a", max_steps=100, stop_at=40))  # saves step 40, returns
        train(TrainConfig(run_dir="runs/a", max_steps=100))  # continues from step 40 to 100
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
        # -- Which checkpoint, if any, and what it fixes: the architecture and the train state --
        checkpoints = stack.enter_context(Checkpoints(run_dir, config, ranks))
        resume_path = checkpoints.choose(config.resume)
        checkpoint = checkpoints.read(resume_path)
        model_config = _model_config(config, checkpoint[MODEL_CONFIG] if checkpoint else None)
        state = TrainState(world_size=ranks.world_size, batch_size=config.batch_size, grad_accum=config.grad_accum)
        if checkpoint is not None:
            state.load_state_dict(checkpoint[TRAIN_STATE])  # with the batch layout that wrote it
        # On another number of ranks, --elastic decides the gradient accumulation.
        plan = parallel.elastic_plan(
            policy=config.elastic, saved_world=state.world_size, saved_batch=state.batch_size,
            saved_accum=state.grad_accum, world=ranks.world_size, batch=config.batch_size, accum=config.grad_accum,
        )  # fmt: skip
        grad_accum = plan.grad_accum
        state.world_size, state.batch_size, state.grad_accum = ranks.world_size, config.batch_size, grad_accum
        tokens_per_step = config.batch_size * grad_accum * ranks.world_size * model_config.block_size

        # -- Data: the training windows in a resumable order, fixed validation windows --
        data = prepare_data(config.data, Path(config.cache_dir) if config.cache_dir else default_cache_dir())
        train_windows = TokenWindows(data.train, model_config.block_size)
        val_windows = TokenWindows(data.val, model_config.block_size)
        # The same validation windows at every evaluation, spread over the split, so evaluations
        # are comparable with each other.
        n_val = min(len(val_windows), config.eval_batches * config.batch_size)
        val_indices = list(range(0, len(val_windows), len(val_windows) // n_val))[:n_val]
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

        # -- Model, optimizer, schedule --
        _seed_everything(config.seed)  # the same initial weights on every rank
        model = GPT(model_config)
        model.to(device)
        if ranks.rank > 0:
            _seed_everything(parallel.rank_seed(config.seed, ranks.rank))  # different dropout masks per rank
        wrapped = _wrap(model, config, ranks)
        optimizer = torch.optim.AdamW(model.param_groups(config.weight_decay), lr=config.lr, betas=ADAM_BETAS)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: config.lr_factor(s))
        say(
            f"{'resuming from ' + str(resume_path) if resume_path else 'training from scratch'} | "
            f"{model.num_parameters() / 1e6:.2f}M parameters on {device} x {ranks.world_size} | {data.describe()} | "
            f"{len(loader) // grad_accum} optimizer steps per epoch"
        )

        # -- Resume: put everything back, check the next step, restore the RNGs last --
        rng_note = "restored"
        if checkpoint is not None and resume_path is not None:
            checkpoints.restore(resume_path, checkpoint, wrapped, optimizer, loader)  # weights, moments, data position
            scheduler.load_state_dict(checkpoint[LR_SCHEDULER])
            # The audit runs on every rank. After a world-size change the batches are cut
            # differently, so only the learning rate can be compared.
            same_world = not plan.changes.get("world_size")
            expected_batch = _next_step_fingerprint(loader, grad_accum, ranks) if same_world else None
            _audit(checkpoint[AUDIT], expected_batch, optimizer, config, state.step, resume_path, say)
            if not same_world:
                say(
                    f"world size changed ({config.elastic}): {plan.describe()}; the rest of epoch {loader.epoch} is read exactly once"
                )
            # Last, because building the model above drew from the RNGs it restores.
            rng_note = _restore_rng(checkpoint[RNG], ranks, config.seed, state.step)
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

        # -- Logging --
        metrics = stack.enter_context(
            contextlib.closing(Metrics(run_dir / METRICS_FILE) if ranks.is_main else NoMetrics())
        )
        metrics.log(
            "start", step=state.step, device=str(device), world_size=ranks.world_size, pids=ranks.gather(os.getpid()),
            parameters=model.num_parameters(),
            config=asdict(config), model_config=asdict(model_config), data=data.describe(),
        )  # fmt: skip
        if resume_path is not None:
            metrics.log(
                "resume", step=state.step, checkpoint=str(resume_path), audit="ok", elastic=config.elastic,
                changes=plan.changes, rng=rng_note,
            )  # fmt: skip

        # -- Evaluation and checkpoints, as the loop calls them --
        def evaluate() -> float:
            return _evaluate(evaluate_with, val_windows, val_indices, config.batch_size, device, autocast)

        def save_checkpoint(val_loss: float | None) -> Path:
            # Everything that decides the next step, under the checkpoint's fixed keys. Every rank
            # takes part: its RNG state and next batch are gathered.
            states = {
                LR_SCHEDULER: scheduler.state_dict(),
                RNG: ranks.gather(resumable_data.capture_rng_state()),  # indexed by rank
                TRAIN_STATE: state.state_dict(),
                MODEL_CONFIG: asdict(model_config),
                LIBRARY_VERSION: resumable_data.__version__,
                # What the next step will use, checked after a resume (see _audit).
                AUDIT: {NEXT_BATCH: _next_step_fingerprint(loader, grad_accum, ranks), NEXT_LR: optimizer.param_groups[0]["lr"]},
            }  # fmt: skip
            path = checkpoints.save(state.step, states, wrapped, optimizer, loader, metric=val_loss)
            metrics.log("checkpoint", step=state.step, path=str(path))
            return path

        result = TrainResult(run_dir, state.step, {}, {}, state.best_val_loss, resume_path, None)
        if state.step == 0:
            # The untrained model's loss is the baseline the falling loss is measured against. It
            # has no checkpoint, so it does not count towards best_val_loss.
            result.val_losses[0] = evaluate()
            metrics.log("eval", step=0, val_loss=result.val_losses[0])
            say(f"step 0: val loss {result.val_losses[0]:.4f}")

        # -- The loop --
        batches = _endless(loader)
        stack.callback(batches.close)  # shuts down DataLoader workers
        bar = stack.enter_context(
            tqdm(
                total=config.max_steps,
                initial=state.step,
                disable=not (config.progress and ranks.is_main),
                unit="step",
                dynamic_ncols=True,
            )
        )
        stop = stack.enter_context(_GracefulStop())
        tokens_per_second = 0.0
        last_saved: Path | None = None
        stopped_by: str | None = None
        while state.step < config.max_steps:
            started = time.perf_counter()
            lr = optimizer.param_groups[0]["lr"]
            loss_sum = torch.zeros((), device=device)
            for micro in range(grad_accum):
                x, y = next(batches)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                # In DDP and FSDP only the last micro-batch synchronizes gradients.
                with _gradient_sync(wrapped, micro == grad_accum - 1):
                    with autocast:
                        _, loss = forward(x, y)
                    # Divide so the accumulated gradient is the mean over micro-batches, as
                    # with one big batch, rather than their sum.
                    (loss / grad_accum).backward()
                loss_sum += loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip or math.inf)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.tokens_seen += tokens_per_step

            # Stop after this step? Read once: a signal arriving later is handled at the next
            # step. One all-reduce gives the loss over all ranks and tells every rank when any of
            # them was signalled.
            if config.stop_at == state.step and stop.reason is None:
                stop.reason = f"--stop-at {state.step}"
            local_stop = stop.reason
            summed_loss, any_stop = ranks.step_sync(loss_sum, local_stop is not None)
            stopped_by = local_stop or ("a signal to another rank" if any_stop else None)
            train_loss = summed_loss / grad_accum  # .item() waits for the GPU
            elapsed = time.perf_counter() - started
            tokens_per_second = _moving_average(tokens_per_second, tokens_per_step / elapsed)
            result.losses[state.step] = train_loss
            metrics.log(
                "step", step=state.step, loss=train_loss, lr=lr, grad_norm=_local(grad_norm).item(),
                tokens=state.tokens_seen, step_time=elapsed, epoch=loader.epoch,
            )  # fmt: skip
            bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:,.0f}")
            bar.update()

            last_step = state.step == config.max_steps
            val_loss = None
            if state.step % config.eval_every == 0 or last_step:
                val_loss = evaluate()
                state.best_val_loss = min(state.best_val_loss, val_loss)
                result.val_losses[state.step] = val_loss
                metrics.log("eval", step=state.step, val_loss=val_loss, best_val_loss=state.best_val_loss)
                say(
                    f"step {state.step}: train loss {train_loss:.4f}, val loss {val_loss:.4f} "
                    f"(best {state.best_val_loss:.4f})"
                )
            # Checkpoints fall on optimizer-step boundaries only, so gradient accumulation never
            # has to be resumed halfway. Each evaluation is saved with its metric, which makes the
            # manager keep the best model; the last step and a stop are always saved.
            if val_loss is not None or state.step % config.checkpoint_every == 0 or last_step or stopped_by:
                last_saved = save_checkpoint(val_loss)
            if stopped_by:
                break

        # -- The end --
        bar.close()  # before the last message, so the message is not drawn over
        result.step, result.best_val_loss, result.stopped_by = state.step, state.best_val_loss, stopped_by
        if stopped_by is not None:
            metrics.log("stop", step=state.step, reason=stopped_by)
            say(f"stopped by {stopped_by}: saved {last_saved}; run the same command again to continue")
        else:
            # Each rank's weights, hashed: data-parallel ranks must end with identical ones.
            digests = ranks.gather(_weights_digest(model))
            metrics.log(
                "end", step=state.step, best_val_loss=state.best_val_loss, tokens_per_second=tokens_per_second,
                rank_weights=digests,
            )  # fmt: skip
            say(f"done: {state.step} steps, best val loss {state.best_val_loss:.4f}, checkpoints in {run_dir}")
    return result


# -- Helpers, in the order train() uses them -------------------------------------------------


def _model_config(config: TrainConfig, saved: Mapping[str, Any] | None) -> ModelConfig:
    """The architecture: the checkpoint's on resume (flags may only repeat it), else the flags'.

    Raises:
        ResumeError: a flag conflicts with the checkpoint, or the checkpoint's config is invalid.
    """
    requested = config.architecture()
    if saved is None:
        return ModelConfig(**requested)
    try:
        restored = ModelConfig(**saved)
    except (TypeError, ValueError) as e:
        raise ResumeError(f"the checkpoint's model_config {dict(saved)} is not valid: {e}") from e
    conflicts = [
        f"{flag(name)} {value} (checkpoint: {getattr(restored, name)})"
        for name, value in requested.items()
        if value != getattr(restored, name)
    ]
    if conflicts:
        raise ResumeError(
            "on resume the architecture comes from the checkpoint, and these flags conflict with it: "
            f"{', '.join(conflicts)}; drop them to resume, or train a new model in another --run-dir"
        )
    return restored


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too


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


def batch_fingerprint(indices: list[list[int]]) -> str:
    """A short hash of the dataset indices of the next optimizer step's micro-batches."""
    return hashlib.sha256(json.dumps(indices).encode()).hexdigest()[:16]


def _next_step_fingerprint(loader: ResumableDataLoader, grad_accum: int, ranks: parallel.Parallel) -> str:
    """The next optimizer step's batch indices, of all ranks in rank order (a collective)."""
    mine = loader.peek_indices(grad_accum)
    return batch_fingerprint(mine) if ranks.world_size == 1 else batch_fingerprint(ranks.gather(mine))


def _audit(
    recorded: Mapping[str, Any],
    expected_batch: str | None,
    optimizer: torch.optim.Optimizer,
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
    change (batches are then cut differently, and only the learning rate is compared). The
    restored ``optimizer`` carries the weight decay the run was trained with: loading it would
    silently override a changed ``--weight-decay``, so a difference is refused too.

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
    expected_lr = config.lr * config.lr_factor(step)
    if recorded[NEXT_LR] != expected_lr:
        raise ResumeError(
            f"resume audit failed: at step {step} the checkpoint {path} expects learning rate "
            f"{recorded[NEXT_LR]!r}, but this run's schedule gives {expected_lr!r}: --lr, --min-lr, "
            "--warmup-steps or --max-steps differs from the run that wrote it (its values are in the "
            f"'start' events of {METRICS_FILE}). Resume with the original settings or use another --run-dir"
        )
    restored_decay = optimizer.param_groups[0]["weight_decay"]
    if restored_decay != config.weight_decay:
        raise ResumeError(
            f"resume audit failed: the checkpoint {path} was trained with weight decay {restored_decay!r}, "
            f"but this run sets --weight-decay {config.weight_decay!r}; restoring the optimizer would quietly "
            "keep the old value. Resume with the original settings or use another --run-dir"
        )
    say(
        f"resume audit ok: step {step}, next batch {expected_batch or '(another world size: not compared)'} "
        f"and next lr {expected_lr:.3e} match the checkpoint"
    )


def _restore_rng(saved: Any, ranks: parallel.Parallel, seed: int, step: int) -> str:
    """Put back this rank's RNG states; a rank the checkpoint's job did not have is seeded from
    ``(seed, step, rank)``, so an elastic resume is reproducible. Returns what was done, for the log.

    Raises:
        ResumeError: the checkpoint's ``rng`` is not a list by rank.
    """
    if not isinstance(saved, list):
        raise ResumeError(
            f"the checkpoint's rng should be a list of RNG states by rank, but it is a {type(saved).__name__}; "
            "it was written by trainer 0.1.0: resume it with that trainer, or start a new --run-dir"
        )
    if ranks.rank < len(saved):
        resumable_data.restore_rng_state(saved[ranks.rank])
    else:
        _seed_everything(parallel.rank_seed(seed, ranks.rank, step))
    if ranks.world_size > len(saved):
        return f"ranks {len(saved)}..{ranks.world_size - 1} seeded from (seed, step, rank)"
    return "restored"


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


def _endless(loader: ResumableDataLoader) -> Iterator[Any]:
    """Batches forever: each new ``iter()`` continues the loader's epoch, or starts the next."""
    while True:
        yield from loader


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


def _moving_average(average: float, value: float) -> float:
    """Throughput for the progress bar: the first value, then an exponential moving average."""
    return value if average == 0 else 0.9 * average + 0.1 * value


def _weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the full weights (gathered from shards under FSDP: a collective)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()):
        digest.update(name.encode())
        digest.update(_local(tensor).detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
