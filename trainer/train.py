"""Train a small GPT that can stop anywhere and continue exactly: :func:`train`, top to bottom.

Choose and read a checkpoint; build data, model, optimizer and schedule; restore the checkpoint and
check that the next step is the one the interrupted run would have taken (the resume audit); then
loop. Everything that decides the next step is in the checkpoint (``checkpointing.py``), so a resumed
run is bitwise identical to one never interrupted (on CPU; on CUDA with ``--deterministic``). Under
torchrun every rank runs this code; what DDP and FSDP2 do differently is behind ``parallel.Parallel``.
Test hooks (SIGKILLs, batch logs) are installed from outside, by ``tests/system/``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from tqdm import tqdm

import resumable_data
from resumable_data.checkpoint import GracefulStop
from resumable_data.position import ends_a_skip
from resumable_data.rng import rank_seed, restore_rank_rng_state

from . import checkpointing as ckpt
from . import parallel
from .config import TrainConfig
from .data import training_data
from .documents import EOS, document_data, document_files
from .metrics import METRICS_FILE, Metrics, Progress, format_lr
from .model import GPT
from .shards import shard_data, shard_index, shard_vocab_size
from .train_state import TrainState

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
    """Train, resuming from the run folder's newest valid checkpoint unless ``config.resume`` says otherwise.

    Raises:
        ValueError: an invalid setting.
        ResumeError: the checkpoint is corrupt or does not fit this run, the resume audit failed, or
            another trainer holds the run folder. Under torchrun every rank raises it.

    Example::

        train(TrainConfig(run_dir="runs/a", max_steps=100, stop_at=40))  # saves step 40, returns
        train(TrainConfig(run_dir="runs/a", max_steps=100))  # continues from step 40 to 100
    """
    config.validate()
    par = parallel.start(config.device, config.fsdp)
    try:
        result = _train(config, par)
    except BaseException as e:
        # The traceback holds the training frame, and with it the DDP model: free it before the
        # process group goes (see Parallel.close).
        traceback.clear_frames(e.__traceback__)
        par.close(clean=False)
        raise
    par.close(clean=True)
    return result


def _train(config: TrainConfig, par: parallel.Parallel) -> TrainResult:
    if config.deterministic:
        # cuBLAS is deterministic only with a fixed workspace, set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    say = tqdm.write if par.is_main else (lambda message: None)

    with contextlib.ExitStack() as stack:
        # -- Which checkpoint, if any, and what it fixes: the architecture, the step, the batch layout --
        checkpoints = stack.enter_context(ckpt.Checkpoints(run_dir, config, par))
        resume_path = checkpoints.choose(config.resume)
        say(f"{run_dir}: resuming from {resume_path}" if resume_path else f"{run_dir}: training from scratch")
        checkpoint = checkpoints.read(resume_path)
        if config.skip_batches and resume_path is None:
            raise resumable_data.ResumeError(f"--skip-batches {config.skip_batches}: no checkpoint to resume from")
        # --data: token shards (write-shards' index.json, local or s3://), documents, or text (fixed byte windows)
        index = shard_index(config.data)
        documents = None if index else document_files(config.data)
        vocab_size = shard_vocab_size(index) if index else (EOS + 1 if documents else 256)  # documents add an EOS
        model_config = config.model_config(checkpoint[ckpt.MODEL_CONFIG] if checkpoint else None, vocab_size)
        state = TrainState(world_size=par.world_size, batch_size=config.batch_size, grad_accum=config.grad_accum)
        if checkpoint is not None:
            state.load_state_dict(checkpoint[ckpt.TRAIN_STATE])  # with the batch layout that wrote it
        # On another number of ranks, --elastic decides the gradient accumulation.
        plan = state.relayout(config.elastic, par.world_size, config.batch_size, config.grad_accum)
        grad_accum = plan.grad_accum
        tokens_per_step = config.batch_size * grad_accum * par.world_size * model_config.block_size

        # -- Data: batches in a resumable order, and the same validation windows at every evaluation --
        block = model_config.block_size
        if index is not None:
            data = shard_data(config, block, index, par)
        else:
            data = document_data(config, block, documents, par) if documents else training_data(config, block, par, say)
        loader = data.loader

        # -- Model, optimizer, schedule --
        resumable_data.seed_everything(config.seed)  # the same initial weights on every rank
        model = GPT(model_config).to(par.device)
        if par.rank > 0:  # different dropout masks per rank
            resumable_data.seed_everything(rank_seed(config.seed, par.rank))
        wrapped = par.wrap(model)
        optimizer = torch.optim.AdamW(model.param_groups(config.weight_decay), lr=config.lr, betas=ADAM_BETAS)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: config.lr_factor(s))
        checkpoints.track(wrapped, optimizer, loader)
        say(
            f"{model.num_parameters() / 1e6:.2f}M parameters on {par.device} x {par.world_size} | "
            f"{data.description} | {data.epoch_length(grad_accum)}"
        )

        # -- Resume: put everything back, check the next step, restore the RNGs last --
        resumed: dict[str, Any] = {}  # for the log
        if checkpoint is not None and resume_path is not None:
            checkpoints.restore(resume_path, checkpoint)  # weights, moments, data position
            if config.skip_batches:  # past a bad stretch: the data state records those batches as skipped
                data.skip(config.skip_batches)
            scheduler.load_state_dict(checkpoint[ckpt.LR_SCHEDULER])
            # A world-size change cuts batches differently, and a skip (ending here) moved them on: only the lr compares.
            same_world = "world_size" not in plan.changes
            compare = same_world and not ends_a_skip(loader.state_dict())
            next_batch = ckpt.next_step_fingerprint(data, grad_accum, par) if compare else None
            ckpt.audit(checkpoint[ckpt.AUDIT], next_batch, data.sha256, optimizer, config, state.step, resume_path)
            lr = optimizer.param_groups[0]["lr"]
            say(
                f"resuming at step {state.step}: epoch {loader.epoch}, {data.done()}; "
                f"the next step's {'batch indices and ' if compare else ''}learning rate {format_lr(lr)} match "
                "what the checkpoint recorded" + ("" if same_world else f"; {config.elastic}: {plan.describe()}")
            )
            # Last, because building the model above drew from the RNGs it restores.
            saved_rng = checkpoint[ckpt.RNG]  # by rank; a rank it lacks is seeded from (seed, step, rank)
            restore_rank_rng_state(saved_rng, par.rank, seed=config.seed, step=state.step)
            rng = f"ranks {len(saved_rng)}..{par.world_size - 1} seeded from (seed, step, rank)"
            rng = rng if par.world_size > len(saved_rng) else "restored"
            resumed = {"step": state.step, "checkpoint": str(resume_path), "audit": "ok", "elastic": config.elastic}
            resumed |= {"changes": plan.changes, "rng": rng, "skipped_batches": config.skip_batches}
            checkpoint = None  # free the CPU copy of the weights

        # -- Logging: opened after the resume, so a refused one leaves no start event in metrics.jsonl --
        metrics = stack.enter_context(Metrics(run_dir / METRICS_FILE if par.is_main else None))
        metrics.log(
            "start",
            step=state.step,
            device=str(par.device),
            world_size=par.world_size,
            pids=par.gather(os.getpid()),
            parameters=model.num_parameters(),
            config=asdict(config),
            model_config=asdict(model_config),
            data=data.description,
        )
        if resumed:
            metrics.log("resume", **resumed)

        autocast = torch.autocast(par.device.type, torch.bfloat16, enabled=par.device.type == "cuda")
        # Compile after loading: the compiled wrapper renames state_dict keys, so the plain model
        # is what gets saved and loaded.
        forward = torch.compile(wrapped) if config.compile else wrapped
        # Evaluation runs on every rank with the same windows, outside DDP (whose forward would expect
        # a matching backward); an FSDP model gathers its shards on every rank.
        evaluate_with = model if par.distributed else forward

        @torch.no_grad()
        def evaluate() -> float:
            # No random numbers are drawn (eval mode has no dropout; batches are stacked by hand, not by
            # a DataLoader, whose iterators draw a seed), so evaluating never changes the training run.
            evaluate_with.eval()
            losses = []
            for start in range(0, len(data.val), config.batch_size):
                pairs = data.val[start : start + config.batch_size]
                x, y = (torch.stack(t).to(par.device) for t in zip(*pairs, strict=True))
                with autocast:
                    losses.append(evaluate_with(x, y)[1].item())
            evaluate_with.train()
            return sum(losses) / len(losses)

        def save_checkpoint(val_loss: float | None) -> Path:
            # Everything that decides the next step, under the checkpoint's fixed keys. Every rank
            # takes part: its RNG state and next batch are gathered.
            states = {
                ckpt.LR_SCHEDULER: scheduler.state_dict(),
                ckpt.RNG: par.gather(resumable_data.capture_rng_state()),  # indexed by rank
                ckpt.TRAIN_STATE: state.state_dict(),
                ckpt.MODEL_CONFIG: asdict(model_config),
                ckpt.LIBRARY_VERSION: resumable_data.__version__,
                # What the next step will use, checked after a resume (see checkpointing.audit).
                ckpt.AUDIT: {
                    ckpt.NEXT_BATCH: ckpt.next_step_fingerprint(data, grad_accum, par),
                    ckpt.NEXT_LR: optimizer.param_groups[0]["lr"],
                    ckpt.DATA_SHA256: data.sha256,
                },
            }
            path = checkpoints.save(state.step, states, metric=val_loss)
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
        batches = data.batches()  # each new iter() continues the loader's epoch, or starts the next
        stack.callback(batches.close)  # shuts down DataLoader workers
        bar = stack.enter_context(Progress(config.max_steps, state.step, enabled=config.progress and par.is_main))
        stop = stack.enter_context(GracefulStop(announce=tqdm.write))
        # Under torchrun the ranks agree on the logged losses and on stopping in one all-reduce every
        # --sync-every steps and at every save, not every step; a single process waits for nobody.
        sync_every = config.sync_every if par.distributed else 1
        # The steps since then, not yet logged: event, loss, gradient norm. The last two stay tensors,
        # so that on a GPU the loop does not wait for every step to finish.
        pending: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = []
        window_started, tokens_per_second = time.perf_counter(), 0.0
        last_saved: Path | None = None
        stopped_by: str | None = None
        while state.step < config.max_steps:
            lr = optimizer.param_groups[0]["lr"]
            loss = torch.zeros((), device=par.device)
            for micro in range(grad_accum):
                x, y = (t.to(par.device, non_blocking=True) for t in next(batches))
                # In DDP and FSDP only the last micro-batch all-reduces the gradients.
                with par.gradient_sync(wrapped, micro == grad_accum - 1):
                    with autocast:
                        _, micro_loss = forward(x, y)
                    # Divide so the accumulated gradient is the mean over micro-batches, as with
                    # one big batch, rather than their sum.
                    (micro_loss / grad_accum).backward()
                loss += micro_loss.detach() / grad_accum
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip or math.inf)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.tokens_seen += tokens_per_step
            event = {"step": state.step, "lr": lr, "tokens": state.tokens_seen, "epoch": loader.epoch}
            pending.append((event, loss, par.local(grad_norm).detach()))
            resumable_data.audit.log(state.step, loss=loss, lr=lr)  # a no-op unless `resumable_data verify` runs us

            evaluate_now = state.step % config.eval_every == 0 or state.step == config.max_steps
            # Checkpoints fall on optimizer-step boundaries only, so gradient accumulation never
            # has to be resumed halfway. --stop-at is the same on every rank: nothing to agree on.
            save_now = evaluate_now or state.step % config.checkpoint_every == 0 or state.step == config.stop_at
            stopped_by = f"--stop-at {config.stop_at}" if state.step == config.stop_at else None
            if save_now or state.step % sync_every == 0:
                # The signal flag is read once (a later signal waits for the next sync) and reduced with
                # the losses, so a SIGTERM to any one rank stops every rank after the same step.
                signalled = stop.reason
                flag = torch.tensor([float(signalled is not None)], device=par.device)
                *losses, anyone = par.mean(torch.cat([torch.stack([p[1] for p in pending]), flag]).double()).tolist()
                if stopped_by is None and anyone > 0:
                    stopped_by = signalled or "a signal to another rank"
                step_time = (time.perf_counter() - window_started) / len(pending)  # .tolist() waited for the GPU
                rate = tokens_per_step / step_time  # for the bar, smoothed: the first value, then a moving average
                tokens_per_second = rate if tokens_per_second == 0 else 0.9 * tokens_per_second + 0.1 * rate
                norms = torch.stack([p[2] for p in pending]).tolist()
                for (event, _, _), step_loss, norm in zip(pending, losses, norms, strict=True):
                    result.losses[event["step"]] = step_loss
                    metrics.log("step", **event, loss=step_loss, grad_norm=norm, step_time=step_time)
                bar.update(len(pending), losses[-1], lr, tokens_per_second)
                pending.clear()
                window_started = time.perf_counter()

            val_loss = None
            if evaluate_now:
                val_loss = evaluate()
                state.best_val_loss = min(state.best_val_loss, val_loss)
                result.val_losses[state.step] = val_loss
                metrics.log("eval", step=state.step, val_loss=val_loss, best_val_loss=state.best_val_loss)
                say(
                    f"step {state.step}: train loss {result.losses[state.step]:.4f}, val loss {val_loss:.4f} "
                    f"(best {state.best_val_loss:.4f})"
                )
            # Each evaluation is saved with its metric, which makes the manager keep the best model;
            # the last step and a stop are always saved.
            if save_now or stopped_by:
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
            metrics.log(
                "end",
                step=state.step,
                best_val_loss=state.best_val_loss,
                tokens_per_second=tokens_per_second,
                rank_weights=par.gather(_weights_digest(model, par)),
            )
            say(f"done: {state.step} steps, best val loss {state.best_val_loss:.4f}, checkpoints in {run_dir}")
    return result


def _weights_digest(model: torch.nn.Module, par: parallel.Parallel) -> str:
    """sha256 of the full weights (gathered from shards under FSDP: a collective)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()):
        digest.update(name.encode())
        digest.update(par.local(tensor).detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
