"""What a user sets for a run: :class:`TrainConfig`, one ``python -m trainer train`` flag per field.

Only settings live here; what derives from them alone (a step's learning rate, the architecture)
are methods, and what a run derives at start (gradient accumulation after an elastic resume) are
local variables of :func:`trainer.train.train`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from resumable_data import ResumeError

from .model import ModelConfig
from .train_state import ELASTIC_POLICIES

# The model's shape comes from the checkpoint on resume; these fields may only repeat it.
ARCHITECTURE_FIELDS = ("block_size", "n_layer", "n_head", "n_embd", "dropout")
CHECKPOINT_FORMATS = ("file", "dcp", "dcp-async")


def _option(default: Any, help: str, minimum: int | None = None) -> Any:
    """A config field with the ``--flag`` help text the command line is generated from, and its smallest value."""
    return field(default=default, metadata={"help": help, "minimum": minimum})


def flag(name: str) -> str:
    """The command-line flag of a field: ``max_steps`` -> ``--max-steps``."""
    return "--" + name.replace("_", "-")


@dataclass
class TrainConfig:
    """Everything a user sets for a run; each field is a ``python -m trainer`` flag (``--max-steps``...).

    The defaults are the README's main run: a 0.8M-parameter model on the standard library's source
    whose loss falls clearly within a few minutes on 2 CPU cores.
    """

    run_dir: str = _option("runs/default", "folder for checkpoints and metrics")
    data: str | None = _option(
        None,
        "text file or folder, .jsonl/.parquet documents, or write-shards token shards: their index.json, its folder "
        "or URL (s3://bucket/tokens/) (default: Python's stdlib source)",
    )
    text_field: str = _option("text", "the field of each .jsonl/.parquet document that holds its text")
    cache_dir: str | None = _option(None, "where tokenized corpora are cached, and token shards read from a URL")
    cache_limit: int | None = _option(None, "bytes the shard cache may take (default: no bound; needs --cache-dir)", 1)
    prefetch: int = _option(2, "token shards each reader downloads ahead into the shard cache", 0)
    resume: str = _option("auto", "'auto' (newest valid checkpoint, if any), 'never', or a checkpoint path")
    skip_batches: int = _option(0, "on resume, skip the next N batches of the epoch (recorded as skipped)", 0)
    # Architecture: None means "from the checkpoint on resume, else ModelConfig's default".
    block_size: int | None = _option(None, "context length in bytes")
    n_layer: int | None = _option(None, "transformer blocks")
    n_head: int | None = _option(None, "attention heads")
    n_embd: int | None = _option(None, "embedding width")
    dropout: float | None = _option(None, "dropout probability")
    # Optimization.
    batch_size: int = _option(32, "sequences per micro-batch", 1)
    grad_accum: int = _option(1, "micro-batches per optimizer step", 1)
    max_steps: int = _option(1000, "optimizer steps; the LR schedule spans them", 1)
    lr: float = _option(3e-3, "peak learning rate")
    min_lr: float = _option(3e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = _option(50, "linear warmup steps", 0)
    weight_decay: float = _option(0.1, "AdamW weight decay (linear weights only)")
    grad_clip: float = _option(1.0, "clip the gradient norm to this (0: off)")
    # Evaluation and checkpoints.
    eval_every: int = _option(100, "evaluate (and checkpoint) every N steps", 1)
    eval_batches: int = _option(8, "validation batches per evaluation", 1)
    checkpoint_every: int = _option(100, "checkpoint every N steps", 1)
    keep_last: int = _option(2, "newest checkpoints to keep (the best is kept too)", 2)
    async_save: bool = _option(False, "write checkpoints in the background while training goes on")
    stop_at: int | None = _option(
        None, "save and exit after this step; the schedule still spans --max-steps (run a long schedule in slices)"
    )
    # System.
    seed: int = _option(1337, "seed for initialization, data order and dropout")
    device: str = _option("auto", "'auto' (CUDA when available), 'cpu', 'cuda', 'cuda:1'...")
    num_workers: int = _option(0, "DataLoader worker processes", 0)
    compile: bool = _option(False, "torch.compile the model (exact resume is verified only without it)")
    deterministic: bool = _option(False, "torch.use_deterministic_algorithms (exact resume on CUDA)")
    progress: bool = _option(True, "show a progress bar")
    # Distributed (under torchrun).
    sync_every: int = _option(
        10, "under torchrun: steps between the all-reduces that average the logged loss and check for a stop", 1
    )
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
        for f in fields(self):
            minimum, value = f.metadata["minimum"], getattr(self, f.name)
            if minimum is not None and value is not None and value < minimum:
                raise ValueError(f"{flag(f.name)} should be >= {minimum}, but got {value}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "lr" and value == 0):
                raise ValueError(f"{flag(name)} should be a finite number >= 0 (lr > 0), but got {value}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        for name, choices in (("checkpoint_format", CHECKPOINT_FORMATS), ("elastic", ELASTIC_POLICIES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{flag(name)} should be one of {', '.join(choices)}, but got {getattr(self, name)!r}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.max_steps:
            raise ValueError(f"--stop-at should be between 1 and --max-steps {self.max_steps}, but got {self.stop_at}")

    def model_config(self, saved: Mapping[str, Any] | None, vocab_size: int = ModelConfig.vocab_size) -> ModelConfig:
        """The architecture: the checkpoint's on resume (flags may only repeat it), else the flags'
        with the data's ``vocab_size``.

        Raises:
            ResumeError: a flag conflicts with the checkpoint, or the checkpoint's config is invalid.
        """
        requested = {name: getattr(self, name) for name in ARCHITECTURE_FIELDS if getattr(self, name) is not None}
        if saved is None:
            return ModelConfig(vocab_size=vocab_size, **requested)
        try:
            restored = ModelConfig(**saved)
        except (TypeError, ValueError) as e:
            raise ResumeError(f"the checkpoint's model_config {dict(saved)} is not valid: {e}") from e
        conflicts = [
            f"{flag(k)} {v} (checkpoint: {getattr(restored, k)})"
            for k, v in requested.items()
            if v != getattr(restored, k)
        ]
        if conflicts:
            raise ResumeError(
                "on resume the architecture comes from the checkpoint, and these flags conflict with it: "
                f"{', '.join(conflicts)}; drop them to resume, or train a new model in another --run-dir"
            )
        return restored

    def lr_factor(self, step: int) -> float:
        """The learning rate of 0-based optimizer step ``step`` as a fraction of ``lr`` (LambdaLR's factor).

        Linear warmup (the first steps' Adam moments are too noisy for the full rate), then cosine
        decay to ``min_lr`` at ``max_steps``: with warmup 2, max 4 and min_lr 0.1 x lr, steps 0..4 get
        0.5, 1.0, 1.0, 0.55 and 0.1.
        """
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        min_ratio = self.min_lr / self.lr
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
