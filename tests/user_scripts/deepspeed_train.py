"""A user's DeepSpeed training loop over a ResumableDataLoader (or a StreamLoader), used by
tests/integrations/test_deepspeed.py.

    python -m torch.distributed.run --nproc_per_node=2 deepspeed_train.py --run-dir DIR [--stage S] [--stream]

On CPU: a gloo process group first, then ``deepspeed.initialize`` with a plain ``torch.optim.AdamW`` in
fp32 and ZeRO stage ``--stage``. The loader is built here (not DeepSpeed's ``training_data``) and shards
itself by rank. Every ``--save-every`` steps ``engine.save_checkpoint`` writes, and
``resumable_data.integrations.deepspeed.client_state`` adds the loader's global state and every rank's
RNG states to its ``client_state``; a relaunch finds DeepSpeed's ``latest`` file, calls
``load_checkpoint`` and ``load_client_state``, and goes on with the next batch: no skip loop.

``--grad-accum G`` accumulates gradients over G micro-batches (a step counts micro-batches, calls of
``engine.step()``, as DeepSpeed's loop does). The micro-batches come through an ``AccumulationWindow``,
passed to ``client_state`` with the engine: a save inside a window holds the window's start, and the
relaunch reads the window's micro-batches drawn before the save again (``resume_step``) and recomputes
the same gradient. ``--no-window`` passes the engine without the window: such a save inside a window
is refused. The LR (a warmup over the first optimizer steps) is logged with each micro-batch's loss.

``--kill-at K`` SIGKILLs every rank after step K; ``--reference DIR`` then also trains uninterrupted in
DIR, in the same process. Each rank logs its losses and its batches' sample indices.
``--naive`` saves what a user would without this library, each rank's own loader and RNG state in
``client_state``, to show that DeepSpeed keeps only the data-parallel writer's (each rank writes which
rank's ``client_state`` it got back to ``resumed<rank>.json``). ``--training-data`` trains on the loader
``deepspeed.initialize(training_data=...)`` returns instead of building one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

from toy import Augmented, Net, log_loss, maybe_die, save_weights, seed_everything

# isort: split
import deepspeed
import torch
import torch.distributed as dist

from resumable_data import ResumableDataLoader, ShardedIterable, StreamLoader
from resumable_data.accumulation import AccumulationWindow
from resumable_data.integrations.deepspeed import client_state, load_client_state, resume_step
from resumable_data.rng import capture_rng_state, rank_seed, restore_rng_state

SEED = 0
EPOCHS = 2
# --stream: the 48 samples as 12 shards of 4 indices, fetched (and augmented) by a map. A resume on another
# number of ranks deals whole unfinished shards to the new ranks: with a batch a shard, every rank has the
# same number of steps left when the shards left divide evenly, as DeepSpeed's collectives need.
SHARD = 4


class Indexed(Augmented):
    """toy.Augmented that also says which sample each item is, so the test can count them."""

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**super().__getitem__(index), "index": index}


DATA = Indexed(48)


def read_indices(shard: int, start: int) -> Any:
    return iter(range(shard * SHARD + start, (shard + 1) * SHARD))


def make_loader(stream: bool, batch_size: int) -> ResumableDataLoader | StreamLoader:
    if stream:
        records = ShardedIterable(range(len(DATA) // SHARD), read_shard=read_indices, seed=3).map(DATA.__getitem__)
        return StreamLoader(records, batch_size=batch_size)
    return ResumableDataLoader(DATA, batch_size=batch_size, seed=3)


def log_indices(run_dir: Path, step: int, epoch: int, indices: list[int], rank: int) -> None:
    with open(run_dir / f"indices{rank}.jsonl", "a") as log:
        log.write(json.dumps({"step": step, "epoch": epoch, "indices": indices}) + "\n")


def log_lr(run_dir: Path, step: int, lr: float, rank: int) -> None:
    with open(run_dir / f"lr{rank}.jsonl", "a") as log:
        log.write(json.dumps({"step": step, "lr": float(lr).hex()}) + "\n")


def train(run_dir: Path, args: argparse.Namespace, kill_at: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    seed_everything(SEED)  # the same initial weights on every rank
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": args.grad_accum,
        # ZeRO 3 keeps parameters under this many elements whole on every rank: 0, so this small model's are
        # partitioned as a large model's would be.
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**6,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    # A warmup, so that an optimizer step moved to another micro-batch shows in the LR too.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    training_data = DATA if args.training_data else None
    engine, _, deepspeed_loader, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config, training_data=training_data
    )
    seed_everything(rank_seed(SEED, rank))  # each rank its own dropout masks and augmentations
    if deepspeed_loader is None:
        loader = make_loader(args.stream, engine.train_micro_batch_size_per_gpu())
    else:
        loader = deepspeed_loader
    # The micro-batches come through the window, which remembers where the open accumulation window began.
    window = AccumulationWindow(loader, engine.gradient_accumulation_steps())
    checkpoint = run_dir / "checkpoint"
    step = 0  # micro-batches trained: calls of engine.step()
    if args.training_data:  # a checkpoint before the first step: DeepSpeed's loader is refused here
        engine.save_checkpoint(str(checkpoint), client_state=client_state(loader, step=0))
    if (checkpoint / "latest").exists():
        # ZeRO 1 and 2 refuse their partitioned optimizer state at another data-parallel degree.
        _, saved = engine.load_checkpoint(str(checkpoint), load_optimizer_states=not args.model_only)
        if args.naive:
            step = saved["step"]
            loader.load_state_dict(saved["loader"])
            restore_rng_state(saved["rng"])
            resumed = {"saved_by": saved["saved_by"]}
        else:
            # Saved inside an accumulation window: the loader and the RNGs as the window began, and the
            # step counter back by the micro-batches of it drawn before the save, which are trained again.
            resumed = {"rng_restored": load_client_state(loader, saved, seed=SEED, window=window)}
            step = resume_step(saved)
        torch_rng = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()  # draws nothing
        (run_dir / f"resumed{rank}.json").write_text(json.dumps({**resumed, "step": step, "torch_rng": torch_rng}))
    for epoch in loader.epochs(EPOCHS):
        for batch in window:
            loss = engine(x=batch["x"], labels=batch["labels"])["loss"]
            engine.backward(loss)
            engine.step()
            step += 1
            log_loss(run_dir, step, loss.item(), rank)
            log_lr(run_dir, step, engine.get_lr()[0], rank)
            log_indices(run_dir, step, epoch, batch["index"].tolist(), rank)
            if step % args.save_every == 0:
                if args.naive:
                    mine = {"loader": loader.state_dict(), "rng": capture_rng_state(), "saved_by": rank, "step": step}
                else:
                    mine = client_state(loader, step=step, window=None if args.no_window else window, engine=engine)
                engine.save_checkpoint(str(checkpoint), client_state=mine)
            maybe_die(step, kill_at)
    # Under ZeRO 3 each rank holds a part of every parameter: gathered whole for the save (on every rank).
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=args.stage == 3):
        if rank == 0:
            save_weights(run_dir, engine.module)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--stage", type=int, default=1, help="ZeRO stage")
    parser.add_argument("--stream", action="store_true", help="a StreamLoader instead of a ResumableDataLoader")
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--naive", action="store_true", help="per-rank states in client_state")
    parser.add_argument("--no-window", action="store_true", help="client_state(..., engine=engine) without window=")
    parser.add_argument("--model-only", action="store_true", help="load_checkpoint(load_optimizer_states=False)")
    parser.add_argument("--training-data", action="store_true", help="deepspeed.initialize(training_data=...)")
    parser.add_argument("--reference", type=Path, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    train(args.run_dir, args, args.kill_at)
    if args.reference is not None:
        train(args.reference, args, 0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
