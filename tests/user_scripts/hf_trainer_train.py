"""A user's ``transformers.Trainer`` run through ``ResumableTrainer``, used by tests/integrations/test_transformers.py.

The one change from a plain Trainer script is the class name. Every micro-batch's loss is logged;
``--kill-at`` SIGKILLs the run after that optimizer step; run again, it resumes from the last
``checkpoint-N`` and the losses and final weights equal an uninterrupted run bitwise.
``--reference DIR`` then also trains uninterrupted in DIR, in the same process.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from toy import (
    Augmented,
    Net,
    log_loss,
    maybe_die,
    save_weights,
    seed_everything,
)  # first: makes torchvision importable

# isort: split
from transformers import TrainerCallback, TrainingArguments

from resumable_data.integrations.transformers import ResumableTrainer


class LoggingTrainer(ResumableTrainer):
    """Logs every micro-batch's loss under (optimizer step, micro-batch in the step)."""

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        step = self.state.global_step
        self._micro = self._micro + 1 if getattr(self, "_step", None) == step else 0
        self._step = step
        value = loss[0] if isinstance(loss, tuple) else loss
        log_loss(Path(self.args.output_dir), step * 100 + self._micro, value.item(), self.args.process_index)
        return loss


class DieAt(TrainerCallback):
    def __init__(self, kill_at: int) -> None:
        self.kill_at = kill_at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        maybe_die(state.global_step, self.kill_at)


def train(
    run_dir: Path, workers: int, accumulation: int, kill_at: int, save_steps: int, max_steps: int, length: int
) -> None:
    seed_everything(0)
    args = TrainingArguments(
        output_dir=str(run_dir),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=3,
        max_steps=max_steps,
        learning_rate=0.01,
        lr_scheduler_type="linear",
        warmup_steps=2,
        save_strategy="steps",
        save_steps=save_steps,
        logging_steps=1000,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=workers,
        disable_tqdm=True,
    )
    trainer = LoggingTrainer(model=Net(), args=args, train_dataset=Augmented(length), callbacks=[DieAt(kill_at)])
    resume = any(run_dir.glob("checkpoint-*"))
    trainer.train(resume_from_checkpoint=True if resume else None)
    if args.process_index == 0:
        save_weights(run_dir, trainer.model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--length", type=int, default=44)
    parser.add_argument("--reference", type=Path, default=None)
    args = parser.parse_args()
    train(args.run_dir, args.workers, args.accumulation, args.kill_at, args.save_steps, args.max_steps, args.length)
    if args.reference is not None:
        train(args.reference, args.workers, args.accumulation, 0, args.save_steps, args.max_steps, args.length)


if __name__ == "__main__":
    main()
