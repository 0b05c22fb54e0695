"""A plain PyTorch training loop made resumable with one line: ``wrap(DataLoader(...))``.

Trains a small classifier for a few epochs, once straight through and once stopped in the middle
of an epoch (as a preemption would) and resumed from the checkpoint by freshly built objects. The
per-step losses and the final weights of the two runs are compared bitwise.

    python examples/train_loop.py            # CPU only, under a minute
    python examples/train_loop.py --smoke    # what the test suite runs
"""

from __future__ import annotations

import argparse
import random
import tempfile

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from resumable_data import CheckpointManager, capture_rng_state, restore_rng_state, wrap


def build(samples: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, DataLoader]:
    """Model, optimizer, schedule and loader exactly as a fresh process would build them."""
    torch.manual_seed(0)  # the initial weights; later randomness is restored from the checkpoint
    x = torch.randn(samples, 20)
    y = (x[:, :5].sum(dim=1) > 0).long()
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.7)
    # The one line that makes the loader resumable: same dataset, batch size, workers, shuffle.
    loader = wrap(
        DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, num_workers=2, persistent_workers=True), seed=0
    )
    return model, optimizer, scheduler, loader


def train(run_dir: str, *, samples: int, num_epochs: int, stop_at: int | None = None) -> list[float]:
    """Train (continuing from the newest checkpoint in ``run_dir``); stop after step ``stop_at``."""
    model, optimizer, scheduler, loader = build(samples)
    checkpoints = CheckpointManager(run_dir)
    step, losses = 0, []
    if checkpoints.latest() is not None:
        state = checkpoints.load()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["lr_scheduler"])
        loader.load_state_dict(state["dataloader"])  # O(1): epoch and position, nothing replayed
        restore_rng_state(state["rng"])  # dropout continues with the same random numbers
        step, losses = state["train_state"]["step"], state["train_state"]["losses"]
    # The full epoch loop: a restored loader continues its epoch; set_epoch keeps the position.
    for epoch in range(loader.epoch, num_epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            losses.append(loss.item())
            if step == stop_at:  # a preemption: save everything, then the process "dies"
                checkpoints.save(
                    step,
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "lr_scheduler": scheduler.state_dict(),
                        "dataloader": loader.state_dict(),
                        "rng": capture_rng_state(),
                        "train_state": {"step": step, "losses": losses},
                    },
                )
                checkpoints.close()
                return losses
    checkpoints.close()
    torch.save(model.state_dict(), f"{run_dir}/final.pt")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a smaller run, for the test suite")
    args = parser.parse_args()
    samples, num_epochs = (160, 3) if args.smoke else (480, 3)
    steps_per_epoch = -(-samples // 16)
    stop_at = steps_per_epoch + steps_per_epoch // 2  # in the middle of the second epoch

    with tempfile.TemporaryDirectory() as straight, tempfile.TemporaryDirectory() as interrupted:
        reference = train(straight, samples=samples, num_epochs=num_epochs)
        train(interrupted, samples=samples, num_epochs=num_epochs, stop_at=stop_at)
        # A new process would start with other global RNG states; scramble them to show it does not matter.
        random.seed(1), np.random.seed(1), torch.manual_seed(1)
        resumed = train(interrupted, samples=samples, num_epochs=num_epochs)
        same_weights = all(
            torch.equal(a, b)
            for a, b in zip(
                torch.load(f"{straight}/final.pt").values(),
                torch.load(f"{interrupted}/final.pt").values(),
                strict=False,
            )
        )
    print(f"{len(reference)} steps, stopped after step {stop_at} (epoch 1, mid-epoch) and resumed")
    print(f"final loss {reference[-1]:.6f} (uninterrupted) vs {resumed[-1]:.6f} (resumed)")
    identical = resumed == reference and same_weights
    print(f"identical: {identical}")
    raise SystemExit(0 if identical else 1)


if __name__ == "__main__":
    main()
