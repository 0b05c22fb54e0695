"""A user's training loop on torchtitan's components over a TitanLoader, used by
tests/integrations/torchtitan_checks.py (run in torchtitan's own environment by
tests/integrations/test_torchtitan.py).

    python -m torch.distributed.run --nproc_per_node=2 torchtitan_train.py --run-dir DIR

On CPU, gloo: torchtitan's ``OptimizersContainer`` (AdamW) and ``LRSchedulersContainer``, and its
``CheckpointManager`` saving every ``--save-every`` steps into ``DIR/checkpoint/step-N`` with the loader
under ``"dataloader"`` (torchtitan's trainer keeps its step in a ``"train_state"`` Stateful; so does this
loop). The model is a tiny next-token predictor with dropout; the data are token shards written here,
read as 9-token windows through a shuffle buffer, for 2 epochs. A relaunch calls ``checkpointer.load()``
(the newest ``step-N``) and goes on with the next batch.

``--kill-at K`` SIGKILLs every rank after step K; ``--reference DIR`` then also trains uninterrupted in
DIR, in the same process. Each rank logs its losses.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from toy import log_loss, maybe_die, save_weights, seed_everything

# isort: split
import torch
import torch.distributed as dist
from torch import nn
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from resumable_data.integrations.torchtitan import TitanLoader
from resumable_data.rng import rank_seed
from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader, write_token_shards

SEED = 0
WINDOW = 9  # 8 inputs and their 8 next tokens
VOCAB = 64
STEPS = 24  # 2 epochs: 48 windows, 2 ranks, batches of 2


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.dropout = nn.Dropout(0.3)
        self.out = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.dropout(self.embed(tokens)))


class TrainState:
    """The step, saved under "train_state" as torchtitan's trainer saves its own."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


def make_loader(run_dir: Path) -> TitanLoader:
    tokens = run_dir / "tokens"
    if dist.get_rank() == 0 and not tokens.exists():
        documents = [np.random.default_rng(3).integers(0, VOCAB, 48 * WINDOW)]
        write_token_shards(documents, tokens, shard_tokens=8 * WINDOW)
    dist.barrier()
    stream = ShardedIterable.from_index(tokens, read_shard=TokenShardReader(WINDOW), seed=SEED).shuffle_buffer(4)
    return TitanLoader(StreamLoader(stream, batch_size=2), seed=SEED)


def train(run_dir: Path, save_every: int, kill_at: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seed_everything(SEED)  # the same initial weights on every rank
    model = TinyLM()
    adamw = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01})
    optimizers = OptimizersContainer.Config(implementation="for-loop", param_groups=[adamw]).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    loader = make_loader(run_dir)
    state = TrainState()
    checkpointer = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="checkpoint", interval=save_every, keep_latest_k=3),
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=str(run_dir),
    )
    seed_everything(rank_seed(SEED, rank))  # each rank its own dropout masks
    checkpointer.load()  # the newest step-N, when there is one: the loader's position and RNGs with it
    for inputs, labels in loader:
        if state.step == STEPS:
            break
        logits = model(inputs["input"])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        optimizers.zero_grad()
        loss.backward()
        for p in model.parameters():  # data parallel: the ranks' mean gradient
            dist.all_reduce(p.grad)
            p.grad /= world_size
        optimizers.step()
        schedulers.step()
        state.step += 1
        log_loss(run_dir, state.step, loss.item(), rank)
        checkpointer.save(state.step)
        maybe_die(state.step, kill_at)
    checkpointer.close()
    if rank == 0:
        save_weights(run_dir, model)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--reference", type=Path, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    train(args.run_dir, args.save_every, args.kill_at)
    if args.reference is not None:
        train(args.reference, args.save_every, 0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
