"""A user's Lightning fit over a ResumableDataLoader with ResumeCallback, used by tests/integrations/test_lightning.py.

``ModelCheckpoint`` saves every few steps; ``--kill-at`` SIGKILLs the fit after that step; run again
with ``ckpt_path="last"``, it resumes and the losses and final weights equal an uninterrupted fit
bitwise. ``--reference DIR`` then also fits uninterrupted in DIR, in the same process.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from toy import (  # first: makes torchvision importable
    Augmented,
    Net,
    log_loss,
    maybe_die,
    save_weights,
    seed_everything,
)

# isort: split
import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from resumable_data import ResumableDataLoader, ShardedIterable, StreamLoader
from resumable_data.integrations.lightning import ResumeCallback

DATA = Augmented(48)
SHARD = 12  # --stream: the 48 samples as 4 shards of 12 indices, fetched (and augmented) by a map


def read_indices(shard: int, start: int) -> Any:
    return iter(range(shard * SHARD + start, (shard + 1) * SHARD))


class Regressor(lightning.LightningModule):
    def __init__(self, run_dir: Path, kill_at: int) -> None:
        super().__init__()
        self.net, self.run_dir, self.kill_at = Net(), run_dir, kill_at

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.net(**batch)["loss"]
        log_loss(self.run_dir, self.global_step * 100 + batch_idx, loss.item(), self.global_rank)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        maybe_die(self.global_step, self.kill_at)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> ResumableDataLoader | StreamLoader:
        if self.stream:
            records = ShardedIterable(range(len(DATA) // SHARD), read_shard=read_indices, seed=3).map(DATA.__getitem__)
            return StreamLoader(records, batch_size=4, num_workers=self.workers)
        return ResumableDataLoader(DATA, batch_size=4, seed=3, num_workers=self.workers)


def fit(
    run_dir: Path,
    workers: int,
    accumulation: int,
    kill_at: int,
    save_every: int,
    devices: int,
    stream: bool,
    max_epochs: int = 3,
    callbacks: tuple[lightning.Callback, ...] = (),
) -> None:
    seed_everything(0)
    model = Regressor(run_dir, kill_at)
    model.workers, model.stream = workers, stream
    checkpoints = ModelCheckpoint(dirpath=run_dir, every_n_train_steps=save_every, save_top_k=-1, save_last=True)
    trainer = lightning.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        use_distributed_sampler=False,  # the ResumableDataLoader shards by rank itself
        accumulate_grad_batches=accumulation,
        callbacks=[ResumeCallback(), checkpoints, *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    resume = (run_dir / "last.ckpt").exists()
    trainer.fit(model, ckpt_path="last" if resume else None)
    if trainer.global_rank == 0:
        save_weights(run_dir, model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--stream", action="store_true", help="a StreamLoader instead of a ResumableDataLoader")
    parser.add_argument("--reference", type=Path, default=None)
    args = parser.parse_args()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    fit(args.run_dir, args.workers, args.accumulation, args.kill_at, args.save_every, args.devices, args.stream)
    if args.reference is not None:
        args.reference.mkdir(parents=True, exist_ok=True)
        fit(args.reference, args.workers, args.accumulation, 0, args.save_every, args.devices, args.stream)


if __name__ == "__main__":
    main()
