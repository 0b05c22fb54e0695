"""A user's accelerate training loop over a ResumableDataLoader, used by tests/integrations/test_accelerate.py.

``--mode stateful``: the loader goes through ``accelerator.prepare`` with
``DataLoaderConfiguration(use_stateful_dataloader=True)``, and ``save_state``/``load_state`` carry its
position. ``--mode register``: the loader stays out of ``prepare`` and is registered with
``register_for_checkpointing``. ``--mode skip``: a prepared loader, resumed the way accelerate's
examples teach, with accelerate's ``skip_first_batches(prepared, batches_done)``; ``--mode skip-ours``:
the same with ``resumable_data.integrations.accelerate.skip_first_batches``.

``--no-set-epoch`` leaves ``set_epoch`` to accelerate (its ``DataLoaderShard`` calls it with a pass
counter that restarts at 0 in the resumed process). ``--accumulate N`` trains with gradient accumulation
over N batches (checkpoints then fall on optimizer steps only, unless ``--save-anywhere``). ``--window``
iterates an ``AcceleratorWindow``, so saves inside a window resume exactly. ``--split-batches``,
``--dispatch-batches`` and ``--no-even-batches`` are accelerate's ``DataLoaderConfiguration`` settings
(the prepared loader goes through ``check_prepared``, which refuses dispatching, unless
``--no-check-prepared``). As accelerate's examples, the loop resumes at the epoch the next batch belongs
to (``starting_epoch = batches_done // len(loader)``).

Run it, SIGKILL it (``--kill-at``), run it again: the losses and final weights equal an uninterrupted
run bitwise. ``--reference DIR`` then also trains uninterrupted in DIR, in the same process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate import skip_first_batches as accelerate_skip_first_batches
from accelerate.utils import DataLoaderConfiguration

from resumable_data import ResumableDataLoader
from resumable_data.integrations.accelerate import AcceleratorWindow, check_prepared, skip_first_batches
from toy import Augmented, Net, log_loss, maybe_die, save_weights, seed_everything

EPOCHS = 3


def train(run_dir: Path, args: argparse.Namespace, kill_at: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(0)
    config = DataLoaderConfiguration(
        use_stateful_dataloader=args.mode == "stateful",
        dispatch_batches=args.dispatch_batches,
        split_batches=args.split_batches,
        even_batches=args.even_batches,
    )
    accelerator = Accelerator(cpu=True, dataloader_config=config, gradient_accumulation_steps=args.accumulate)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    # world_size=1: accelerate gives each process its share of the one global order.
    # split_batches: each process takes its part of a batch of every process's samples together.
    batch_size = 4 * accelerator.num_processes if args.split_batches else 4
    dataset = Augmented(args.samples)
    loader = ResumableDataLoader(dataset, batch_size=batch_size, seed=5, num_workers=args.workers, world_size=1, rank=0)
    if args.mode == "register":
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        if not args.window:  # the window registers itself, with the loader's state in it
            accelerator.register_for_checkpointing(loader)
        train_loader = loader
    else:
        model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        if args.check_prepared:
            check_prepared(train_loader)
    # The window keeps the accumulation window's start: a save inside it resumes there.
    window = AcceleratorWindow(accelerator, train_loader) if args.window else None
    checkpoint = run_dir / "checkpoint"
    step = 0
    if (checkpoint / "progress.json").exists():
        accelerator.load_state(str(checkpoint))
        step = json.loads((checkpoint / "progress.json").read_text())
        if window is not None:
            step -= window.rewound  # the window's micro-batches drawn before the save are read again
    per_epoch = len(train_loader)
    for epoch in range(step // per_epoch, EPOCHS):
        if args.set_epoch:
            train_loader.set_epoch(epoch)
        batches, done = train_loader if window is None else window, step - epoch * per_epoch
        if args.mode == "skip" and done > 0:
            batches = accelerate_skip_first_batches(train_loader, done)
        elif args.mode == "skip-ours" and done > 0:
            batches = skip_first_batches(train_loader, done)
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(**batch)["loss"]
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            step += 1
            log_loss(run_dir, step, loss.item(), accelerator.process_index)
            # Without the window, accumulated gradients are not saved: checkpoint on optimizer steps only.
            if (step in args.save_at or step % args.save_every == 0) and (
                args.save_anywhere or accelerator.sync_gradients
            ):
                accelerator.save_state(str(checkpoint))
                if accelerator.is_main_process:
                    (checkpoint / "progress.json").write_text(json.dumps(step))
                accelerator.wait_for_everyone()
            maybe_die(step, kill_at)
    if accelerator.is_main_process:
        save_weights(run_dir, accelerator.unwrap_model(model))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--mode", choices=["stateful", "register", "skip", "skip-ours"], default="stateful")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--save-at", type=int, nargs="*", default=[], help="also checkpoint after these steps")
    parser.add_argument("--no-set-epoch", dest="set_epoch", action="store_false")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--save-anywhere", action="store_true", help="also save inside accumulation windows")
    parser.add_argument("--window", action="store_true", help="iterate an AcceleratorWindow (stateful, register)")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--dispatch-batches", action="store_true")
    parser.add_argument("--split-batches", action="store_true")
    parser.add_argument("--no-even-batches", dest="even_batches", action="store_false")
    parser.add_argument("--no-check-prepared", dest="check_prepared", action="store_false")
    parser.add_argument("--reference", type=Path, default=None)
    args = parser.parse_args()
    train(args.run_dir, args, args.kill_at)
    if args.reference is not None:
        train(args.reference, args, 0)


if __name__ == "__main__":
    main()
