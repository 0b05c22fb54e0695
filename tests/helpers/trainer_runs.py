"""The trainer's tiny run (one preset for every trainer test and the chaos harness), and what a
test reads back from a run folder: its final checkpoint, its losses, every rank's final weights."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from resumable_data import CheckpointManager
from trainer.checkpointing import CHECKPOINT_FOLDER
from trainer.config import TrainConfig
from trainer.metrics import read_metrics

__all__ = ["TINY", "end_weights", "final_checkpoint", "losses", "text_corpus", "tiny"]

# The trainer's smallest run, in one process and under torchrun: one layer, 20 steps, dropout on
# (so the RNG restore matters), a checkpoint every 4 steps. Tests change single fields of it.
TINY: dict[str, Any] = dict(
    n_layer=1,
    n_head=2,
    n_embd=16,
    block_size=16,
    dropout=0.1,
    batch_size=4,
    max_steps=20,
    lr=1e-2,
    min_lr=1e-3,
    warmup_steps=3,
    eval_every=6,
    eval_batches=1,
    checkpoint_every=4,
    progress=False,
)


def text_corpus(folder: Path, size: int = 2000) -> Path:
    """The first ``size`` bytes of a Python source file as ``folder/text.txt``; written once, since
    a rewritten corpus would be tokenized again. With 2,000 bytes, block 16 and a global batch of 8
    (2 ranks) an epoch is 14 steps; with 1,000 bytes and batch 4 too."""
    corpus = folder / "text.txt"
    if not corpus.exists():
        corpus.parent.mkdir(parents=True, exist_ok=True)
        corpus.write_bytes(Path(random.__file__).read_bytes()[:size])
    return corpus


def tiny(base: Path, name: str, *, data: Path | None = None, **overrides: Any) -> TrainConfig:
    """The TINY run in ``base/name`` on ``data`` (default :func:`text_corpus` of ``base``), its
    corpus cache in ``base/cache``; ``overrides`` replace TINY's fields."""
    corpus = text_corpus(base) if data is None else data
    return TrainConfig(
        run_dir=str(base / name), data=str(corpus), cache_dir=str(base / "cache"), **{**TINY, **overrides}
    )


def final_checkpoint(run_dir: str | Path) -> dict[str, Any]:
    """The newest checkpoint of a run written in the file format, loaded whole."""
    with CheckpointManager(Path(run_dir) / CHECKPOINT_FOLDER, lock=False) as manager:
        return manager.load()


def losses(run_dir: str | Path) -> dict[int, float]:
    """The last logged loss of every step (a step run twice, before and after a kill, counts once)."""
    return {e["step"]: e["loss"] for e in read_metrics(run_dir) if e["event"] == "step"}


def end_weights(run_dir: str | Path) -> list[str]:
    """The digests of every rank's final weights, as the run's last ``end`` event logged them."""
    return [e for e in read_metrics(run_dir) if e["event"] == "end"][-1]["rank_weights"]
