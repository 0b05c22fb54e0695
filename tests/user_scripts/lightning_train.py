"""A user's Lightning fit over a ResumableDataLoader with ResumeCallback, used by tests/integrations/test_lightning*.py.

``ModelCheckpoint`` saves every few steps (or every epoch, or only ``last.ckpt``); ``--kill-at`` SIGKILLs
the fit after that step (``--kill-in validation``: in that step's validation); ``--save-at`` instead saves
``last.ckpt`` with ``trainer.save_checkpoint`` at that micro-batch of the fit (inside a gradient-accumulation
window, as a preemption handler does: ``--save-in signal`` from a SIGUSR1 handler that lands in the
micro-batch's training step) and SIGKILLs the fit right after; run again with
``ckpt_path="last"``, it resumes and the losses and final weights equal an uninterrupted fit bitwise.
``--reference DIR`` then also fits uninterrupted in DIR, in the same process. The other flags are the
Trainer settings users combine: validation cadence and loader, ``limit_train_batches``,
``max_epochs``/``max_steps``, accumulation, workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
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
from torch.utils.data import DataLoader

from resumable_data import ResumableDataLoader, ShardedIterable, StreamLoader
from resumable_data.integrations.lightning import ResumeCallback

DATA = Augmented(48)  # 12 batches of 4 an epoch
VALIDATION = Augmented(16)  # 4 batches of 4; its augmentation draws from the global RNGs too
SHARD = 12  # --stream: the 48 samples as 4 shards of 12 indices, fetched (and augmented) by a map
VALIDATION_LOADERS = ("none", "plain", "resumable")  # none, a shuffled DataLoader, a ResumableDataLoader
CHECKPOINTS = ("steps", "epochs", "last")  # every_n_train_steps, every_n_epochs=1, save_last only
SAVES = ("batch-end", "signal")  # --save-at: from on_train_batch_end, or from a signal handler in training_step
VALIDATION_LOG = "validation.jsonl"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a fit is run with; the defaults are the plain fit of tests/integrations/test_lightning.py."""

    workers: int = 0
    accumulation: int = 1
    kill_at: int = 0  # SIGKILL after this optimizer step (0: never)
    kill_in: str = "train"  # "train": at that step's end; "validation": in the first validation from that step on
    save_every: int = 4
    checkpoint: str = "steps"
    devices: int = 1
    stream: bool = False
    max_epochs: int = 3
    max_steps: int = -1
    limit_train_batches: int | float | None = None
    val_check_interval: int | float | None = None
    validation: str = "none"
    save_at: int = -1  # in a fit that starts afresh: save last.ckpt at this micro-batch and SIGKILL (-1: never)
    save_in: str = "batch-end"  # where that save happens: SAVES


def log_validation(run_dir: Path, step: int, batch_idx: int, loss: float) -> None:
    with open(run_dir / VALIDATION_LOG, "a") as log:
        log.write(json.dumps({"step": step, "batch": batch_idx, "loss": float(loss).hex()}) + "\n")


def read_validation(run_dir: Path) -> dict[tuple[int, int], str]:
    """The last loss logged for each (step, batch) of validation (a resumed run's, for those it ran again)."""
    path = run_dir / VALIDATION_LOG
    lines = path.read_text().splitlines() if path.exists() else []
    return {(entry["step"], entry["batch"]): entry["loss"] for entry in map(json.loads, lines)}


def read_indices(shard: int, start: int) -> Any:
    return iter(range(shard * SHARD + start, (shard + 1) * SHARD))


class Regressor(lightning.LightningModule):
    def __init__(self, run_dir: Path, settings: Settings) -> None:
        super().__init__()
        self.net, self.run_dir, self.settings = Net(), run_dir, settings

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.settings.save_in == "signal" and self._at_save_point():
            os.kill(os.getpid(), signal.SIGUSR1)  # a preemption notice, handled in this step (see fit)
        loss = self.net(**batch)["loss"]
        log_loss(self.run_dir, self.global_step * 100 + batch_idx, loss.item(), self.global_rank)
        return loss

    def _at_save_point(self) -> bool:
        return self.trainer.fit_loop.total_batch_idx == self.settings.save_at

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.settings.save_in == "batch-end" and self._at_save_point():
            save_and_die(self.trainer, self.run_dir)
        if self.settings.kill_in == "train":
            maybe_die(self.global_step, self.settings.kill_at)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = self.net(**batch)["loss"]
        self.log("val_loss", loss)
        if self.trainer.sanity_checking:
            return
        log_validation(self.run_dir, self.global_step, batch_idx, loss.item())
        kill_at = self.settings.kill_at
        if self.settings.kill_in == "validation" and kill_at and self.global_step >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> ResumableDataLoader | StreamLoader:
        workers = self.settings.workers
        if self.settings.stream:
            records = ShardedIterable(range(len(DATA) // SHARD), read_shard=read_indices, seed=3).map(DATA.__getitem__)
            return StreamLoader(records, batch_size=4, num_workers=workers)
        return ResumableDataLoader(DATA, batch_size=4, seed=3, num_workers=workers)


def _validation_loader(settings: Settings) -> DataLoader | None:
    if settings.validation == "plain":  # its order and its workers' seeds come from torch's global RNG
        return DataLoader(VALIDATION, batch_size=4, shuffle=True, num_workers=settings.workers)
    if settings.validation == "resumable":
        return ResumableDataLoader(VALIDATION, batch_size=4, seed=5, num_workers=settings.workers)
    return None


def _checkpoints(run_dir: Path, settings: Settings) -> ModelCheckpoint:
    if settings.checkpoint == "steps":
        return ModelCheckpoint(dirpath=run_dir, every_n_train_steps=settings.save_every, save_top_k=-1, save_last=True)
    if settings.checkpoint == "epochs":
        return ModelCheckpoint(dirpath=run_dir, every_n_epochs=1, save_top_k=-1, save_last=True)
    return ModelCheckpoint(dirpath=run_dir, save_last=True)  # after each validation, or at each epoch's end


def save_and_die(trainer: lightning.Trainer, run_dir: Path) -> None:
    """What a preemption handler does: save the fit where it is (every rank calls it), then the process dies."""
    trainer.save_checkpoint(run_dir / "last.ckpt")
    os.kill(os.getpid(), signal.SIGKILL)


def fit(run_dir: Path, settings: Settings, callbacks: tuple[lightning.Callback, ...] = ()) -> None:
    seed_everything(0)
    resume = (run_dir / "last.ckpt").exists()
    if resume:  # --save-at is the first fit's preemption
        settings = dataclasses.replace(settings, save_at=-1)
    model = Regressor(run_dir, settings)
    trainer = lightning.Trainer(
        max_epochs=settings.max_epochs,
        max_steps=settings.max_steps,
        limit_train_batches=settings.limit_train_batches,
        val_check_interval=settings.val_check_interval,
        accelerator="cpu",
        devices=settings.devices,
        strategy="ddp" if settings.devices > 1 else "auto",
        use_distributed_sampler=False,  # the ResumableDataLoader shards by rank itself
        accumulate_grad_batches=settings.accumulation,
        callbacks=[ResumeCallback(), _checkpoints(run_dir, settings), *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if settings.save_in == "signal" and settings.save_at >= 0:
        signal.signal(signal.SIGUSR1, lambda *_: save_and_die(trainer, run_dir))
    trainer.fit(model, val_dataloaders=_validation_loader(settings), ckpt_path="last" if resume else None)
    if trainer.global_rank == 0:
        save_weights(run_dir, model)


def _number(text: str) -> int | float | None:
    """A Trainer count-or-fraction flag: ``none``, an int (batches) or a float (a fraction of the epoch)."""
    if text == "none":
        return None
    return float(text) if "." in text else int(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--kill-in", choices=("train", "validation"), default="train")
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--checkpoint", choices=CHECKPOINTS, default="steps")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--stream", action="store_true", help="a StreamLoader instead of a ResumableDataLoader")
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--limit-train-batches", type=_number, default=None)
    parser.add_argument("--val-check-interval", type=_number, default=None)
    parser.add_argument("--validation", choices=VALIDATION_LOADERS, default="none")
    parser.add_argument("--save-at", type=int, default=-1)
    parser.add_argument("--save-in", choices=SAVES, default="batch-end")
    parser.add_argument("--reference", type=Path, default=None)
    args = parser.parse_args()
    settings = Settings(**{field.name: getattr(args, field.name) for field in dataclasses.fields(Settings)})
    args.run_dir.mkdir(parents=True, exist_ok=True)
    fit(args.run_dir, settings)
    if args.reference is not None:
        args.reference.mkdir(parents=True, exist_ok=True)
        fit(args.reference, dataclasses.replace(settings, kill_at=0, save_at=-1))


if __name__ == "__main__":
    main()
