"""What a user sets for a run: :class:`TrainConfig`, one ``python -m trainer train`` flag per field.

Only settings live here. Values derived from them (the learning rate of a step, the architecture
flags given) are methods, and what a run derives at start (gradient accumulation after an elastic
resume, tokens per step) are local variables of :func:`trainer.train.train`. Test instrumentation
(SIGKILL at a chosen moment, a log of every batch's indices) is installed from outside the trainer
by :mod:`trainer.harness.killpoints`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from . import parallel

__all__ = ["ARCHITECTURE_FIELDS", "CHECKPOINT_FORMATS", "TrainConfig", "flag", "lr_multiplier"]

# The model's shape comes from the checkpoint on resume; these fields may only repeat it.
ARCHITECTURE_FIELDS = ("block_size", "n_layer", "n_head", "n_embd", "dropout")
CHECKPOINT_FORMATS = ("file", "dcp", "dcp-async")


def _option(default: Any, help: str) -> Any:
    """A config field with the ``--flag`` help text the command line is generated from."""
    return field(default=default, metadata={"help": help})


def flag(name: str) -> str:
    """The command-line flag of a field: ``max_steps`` -> ``--max-steps``."""
    return "--" + name.replace("_", "-")


@dataclass
class TrainConfig:
    """Everything a user sets for a run. Each field is also a ``python -m trainer`` flag (``--max-steps``...).

    The defaults are the README's main run: a 0.8M-parameter model on the standard library's
    source that shows a clearly falling loss within a few minutes on 2 CPU cores.
    """

    run_dir: str = _option("runs/default", "folder for checkpoints and metrics")
    data: str | None = _option(None, "text file or folder (default: Python's stdlib source)")
    cache_dir: str | None = _option(None, "where tokenized corpora are cached")
    resume: str = _option("auto", "'auto' (newest valid checkpoint, if any), 'never', or a checkpoint path")
    # Architecture: None means "from the checkpoint on resume, else ModelConfig's default".
    block_size: int | None = _option(None, "context length in bytes")
    n_layer: int | None = _option(None, "transformer blocks")
    n_head: int | None = _option(None, "attention heads")
    n_embd: int | None = _option(None, "embedding width")
    dropout: float | None = _option(None, "dropout probability")
    # Optimization.
    batch_size: int = _option(32, "sequences per micro-batch")
    grad_accum: int = _option(1, "micro-batches per optimizer step")
    max_steps: int = _option(1000, "optimizer steps; the LR schedule spans them")
    lr: float = _option(3e-3, "peak learning rate")
    min_lr: float = _option(3e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = _option(50, "linear warmup steps")
    weight_decay: float = _option(0.1, "AdamW weight decay (linear weights only)")
    grad_clip: float = _option(1.0, "clip the gradient norm to this (0: off)")
    # Evaluation and checkpoints.
    eval_every: int = _option(100, "evaluate (and checkpoint) every N steps")
    eval_batches: int = _option(8, "validation batches per evaluation")
    checkpoint_every: int = _option(100, "checkpoint every N steps")
    keep_last: int = _option(2, "newest checkpoints to keep (>= 2; the best is kept too)")
    async_save: bool = _option(False, "write checkpoints in the background while training goes on")
    stop_at: int | None = _option(
        None, "save and exit after this step; the schedule still spans --max-steps (run a long schedule in slices)"
    )
    # System.
    seed: int = _option(1337, "seed for initialization, data order and dropout")
    device: str = _option("auto", "'auto' (CUDA when available), 'cpu', 'cuda', 'cuda:1'...")
    num_workers: int = _option(0, "DataLoader worker processes")
    compile: bool = _option(False, "torch.compile the model (exact resume is verified only without it)")
    deterministic: bool = _option(False, "torch.use_deterministic_algorithms (exact resume on CUDA)")
    progress: bool = _option(True, "show a progress bar")
    # Distributed (under torchrun).
    checkpoint_format: str = _option(
        "file", "'file' (one weights_only file, rank 0), 'dcp' or 'dcp-async' (torch.distributed.checkpoint)"
    )
    elastic: str = _option(
        "per-rank-batch",
        "on a resume with another number of ranks keep the 'per-rank-batch' or the 'global-batch' (changes --grad-accum), or 'refuse'",
    )
    fsdp: bool = _option(False, "shard the model with FSDP2 fully_shard instead of DDP (torchrun; meant for CUDA)")

    def validate(self) -> None:
        """Check the values a user typed, before anything is built.

        Raises:
            ValueError: naming the flag and the value.
        """
        at_least = {
            "batch_size": 1,
            "grad_accum": 1,
            "max_steps": 1,
            "warmup_steps": 0,
            "eval_every": 1,
            "eval_batches": 1,
            "checkpoint_every": 1,
            "keep_last": 2,
            "num_workers": 0,
        }
        for name, minimum in at_least.items():
            value = getattr(self, name)
            if value < minimum:
                raise ValueError(f"{flag(name)} should be >= {minimum}, but got {value}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "lr" and value == 0):
                raise ValueError(f"{flag(name)} should be a finite number >= 0 (lr > 0), but got {value}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        for name, choices in (("checkpoint_format", CHECKPOINT_FORMATS), ("elastic", parallel.ELASTIC_POLICIES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{flag(name)} should be one of {', '.join(choices)}, but got {getattr(self, name)!r}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.max_steps:
            raise ValueError(f"--stop-at should be between 1 and --max-steps {self.max_steps}, but got {self.stop_at}")

    def architecture(self) -> dict[str, Any]:
        """The architecture flags that were given (the others come from the checkpoint or the defaults)."""
        return {name: getattr(self, name) for name in ARCHITECTURE_FIELDS if getattr(self, name) is not None}

    def lr_factor(self, step: int) -> float:
        """The learning rate of 0-based optimizer step ``step`` as a fraction of ``lr`` (LambdaLR's factor)."""
        return lr_multiplier(step, self.warmup_steps, self.max_steps, self.min_lr / self.lr)


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """The learning rate of 0-based optimizer step ``step``, as a fraction of the peak.

    Linear warmup (the first steps' Adam moments are too noisy for the full rate), then cosine
    decay from 1 to ``min_ratio`` at ``max_steps``.

    Example:
        >>> [round(lr_multiplier(s, warmup_steps=2, max_steps=4, min_ratio=0.1), 3) for s in range(5)]
        [0.5, 1.0, 1.0, 0.55, 0.1]
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
