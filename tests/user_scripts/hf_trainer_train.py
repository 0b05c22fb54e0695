"""A user's ``transformers.Trainer`` run through ``ResumableTrainer``, used by tests/integrations/test_transformers*.py.

The one change from a plain Trainer script is the class name. Every training micro-batch's loss and
every evaluation's loss is logged; ``--kill-at K`` SIGKILLs the run at step K (``--kill-when``: at the
end of step K before anything is saved, in the middle of writing ``checkpoint-K``, right after
step K with all it saved and evaluated, or ``micro`` with ``--kill-phase P``: inside the
gradient-accumulation window of step K, after micro-batch P's backward, before the optimizer step
when P is the window's last); run again, it resumes from its last complete
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

EVAL_LOG = 10**6  # evaluation losses are logged under EVAL_LOG + step, beside the micro-batches' step * 100 + i
KILL_WHEN = ("step-end", "in-save", "after-save", "micro")


class LoggingTrainer(ResumableTrainer):
    """Logs every training micro-batch's loss under (optimizer step, micro-batch in the step)."""

    kill_in_save = 0  # SIGKILL in the middle of writing checkpoint-N for this N (0: never)
    kill_in_window: tuple[int, int] | None = None  # (step K, micro-batch P): SIGKILL after P's backward in K's window

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if not model.training:  # an evaluation batch: its loss is logged per evaluation, below
            return loss
        step = self.state.global_step
        self._micro = self._micro + 1 if getattr(self, "_step", None) == step else 0
        self._step = step
        value = loss[0] if isinstance(loss, tuple) else loss
        log_loss(Path(self.args.output_dir), step * 100 + self._micro, value.item(), self.args.process_index)
        return loss

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        loss = super().training_step(*args, **kwargs)
        # compute_loss above has logged this micro-batch and set _micro, its index in the window. Trainer
        # saves only after an optimizer step, so a kill here loses the window's accumulated gradient.
        if self.kill_in_window is not None:
            step, phase = self.kill_in_window
            maybe_die(self.state.global_step + 1, step if self._micro == phase else 0)
        return loss

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # Trainer writes a checkpoint's weights first and trainer_state.json last: dying here leaves
        # checkpoint-N with the weights alone, as a kill in the middle of the write does.
        super().save_model(output_dir, _internal_call)
        maybe_die(self.state.global_step, self.kill_in_save)


class DieAt(TrainerCallback):
    """SIGKILLs the run at step ``kill_at``: at its end (before a save at it) or right after it."""

    def __init__(self, kill_at: int, when: str) -> None:
        self.kill_at, self.when = kill_at, when

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.when == "step-end":
            maybe_die(state.global_step, self.kill_at)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The next step begins once step kill_at has saved, evaluated and (at an epoch's end) closed the epoch.
        if self.when == "after-save":
            maybe_die(state.global_step, self.kill_at)


class LogEvaluations(TrainerCallback):
    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float], **kwargs: Any) -> None:
        log_loss(Path(args.output_dir), EVAL_LOG + state.global_step, metrics["eval_loss"], args.process_index)


def train(run_dir: Path, options: argparse.Namespace, kill_at: int) -> None:
    seed_everything(0)
    evaluate = options.eval_strategy != "no"
    args = TrainingArguments(
        output_dir=str(run_dir),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=options.accumulation,
        num_train_epochs=options.epochs,
        max_steps=options.max_steps,
        learning_rate=0.01,
        lr_scheduler_type="linear",
        warmup_steps=2,
        save_strategy=options.save_strategy,
        save_steps=options.save_steps,
        save_total_limit=options.save_total_limit,
        eval_strategy=options.eval_strategy,
        eval_steps=options.eval_steps,
        logging_steps=1000,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=options.workers,
        dataloader_drop_last=options.drop_last,
        disable_tqdm=True,
    )
    trainer = LoggingTrainer(
        model=Net(),
        args=args,
        train_dataset=Augmented(options.length),
        eval_dataset=Augmented(10) if evaluate else None,
        callbacks=[DieAt(kill_at, options.kill_when), LogEvaluations()],
    )
    trainer.kill_in_save = kill_at if options.kill_when == "in-save" else 0
    trainer.kill_in_window = (kill_at, options.kill_phase) if options.kill_when == "micro" and kill_at else None
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
    parser.add_argument("--kill-when", choices=KILL_WHEN, default="step-end")
    parser.add_argument("--kill-phase", type=int, default=0, help="with --kill-when micro: the micro-batch")
    parser.add_argument("--save-strategy", choices=("steps", "epoch"), default="steps")
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--save-total-limit", type=int, default=None)
    parser.add_argument("--eval-strategy", choices=("no", "steps", "epoch"), default="no")
    parser.add_argument("--eval-steps", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--length", type=int, default=44)
    parser.add_argument("--drop-last", action="store_true")
    parser.add_argument("--reference", type=Path, default=None)
    options = parser.parse_args()
    train(options.run_dir, options, options.kill_at)
    if options.reference is not None:
        train(options.reference, options, 0)


if __name__ == "__main__":
    main()
