"""A user's accelerate training loop over a ResumableDataLoader, used by tests/integrations/test_accelerate.py.

``--mode stateful``: the loader goes through ``accelerator.prepare`` with
``DataLoaderConfiguration(use_stateful_dataloader=True)``, and ``save_state``/``load_state`` carry its
position. ``--mode register``: the loader stays out of ``prepare`` and is registered with
``register_for_checkpointing``. ``--mode skip``: a prepared loader, resumed the way accelerate's
examples teach, with ``skip_first_batches(prepared, batches_done)``.

Run it, SIGKILL it (``--kill-at``), run it again: the losses and final weights equal an uninterrupted
run bitwise. ``--reference DIR`` then also trains uninterrupted in DIR, in the same process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator, skip_first_batches
from accelerate.utils import DataLoaderConfiguration

from resumable_data import ResumableDataLoader
from toy import Augmented, Net, log_loss, maybe_die, save_weights, seed_everything

EPOCHS = 3


def train(run_dir: Path, mode: str, workers: int, kill_at: int, save_every: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(0)
    config = DataLoaderConfiguration(use_stateful_dataloader=mode == "stateful")
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    # world_size=1: accelerate gives each process its share of the one global order.
    loader = ResumableDataLoader(Augmented(), batch_size=4, seed=5, num_workers=workers, world_size=1, rank=0)
    if mode == "register":
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        accelerator.register_for_checkpointing(loader)
        train_loader = loader
    else:
        model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    checkpoint = run_dir / "checkpoint"
    step, epoch, batch_in_epoch = 0, 0, 0
    if (checkpoint / "progress.json").exists():
        accelerator.load_state(str(checkpoint))
        step, epoch, batch_in_epoch = json.loads((checkpoint / "progress.json").read_text())
    while epoch < EPOCHS:
        train_loader.set_epoch(epoch)
        batches = train_loader
        if mode == "skip" and batch_in_epoch:
            batches = skip_first_batches(train_loader, batch_in_epoch)
        for batch in batches:
            loss = model(**batch)["loss"]
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step, batch_in_epoch = step + 1, batch_in_epoch + 1
            log_loss(run_dir, step, loss.item(), accelerator.process_index)
            if step % save_every == 0:
                accelerator.save_state(str(checkpoint))
                if accelerator.is_main_process:
                    (checkpoint / "progress.json").write_text(json.dumps([step, epoch, batch_in_epoch]))
                accelerator.wait_for_everyone()
            maybe_die(step, kill_at)
        epoch, batch_in_epoch = epoch + 1, 0
    if accelerator.is_main_process:
        save_weights(run_dir, accelerator.unwrap_model(model))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--mode", choices=["stateful", "register", "skip"], default="stateful")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--reference", type=Path, default=None)
    args = parser.parse_args()
    train(args.run_dir, args.mode, args.workers, args.kill_at, args.save_every)
    if args.reference is not None:
        train(args.reference, args.mode, args.workers, 0, args.save_every)


if __name__ == "__main__":
    main()
