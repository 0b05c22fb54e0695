"""What the integration scripts train: a tiny model with dropout on synthetic data whose augmentation
draws from the global RNGs in ``__getitem__`` (torch, numpy and python's ``random``), as users' code does.

Each script logs every optimizer step's loss (as ``float.hex``) to ``losses.jsonl`` and writes its final
weights, so a test can compare a SIGKILLed-and-resumed run with an uninterrupted one bitwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

# transformers imports torchvision when it is installed; on a CPU torch with PyPI's CUDA torchvision
# (our CI) that import fails unless the tests' workaround runs first (see tests/torchvision_compat.py).
if importlib.util.find_spec("torchvision") is not None:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from torchvision_compat import load_torchvision

    load_torchvision()


class Augmented(torch.utils.data.Dataset):
    """``length`` samples of 6 features; every fetch adds noise from the three global RNGs."""

    def __init__(self, length: int = 48) -> None:
        generator = torch.Generator().manual_seed(99)
        self.x = torch.randn(length, 6, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        noise = 0.1 * torch.rand(6) * float(np.random.uniform(0.5, 1.5)) + random.gauss(0.0, 0.01)
        return {"x": self.x[index] + noise, "labels": self.y[index]}


class Net(nn.Module):
    """A two-layer regressor with dropout; returns what ``transformers.Trainer`` expects of a model."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        prediction = self.body(x)
        out = {"logits": prediction}
        if labels is not None:
            out["loss"] = nn.functional.mse_loss(prediction, labels)
        return out


def log_loss(run_dir: Path, step: int, loss: float, rank: int = 0) -> None:
    with open(run_dir / f"losses{rank or ''}.jsonl", "a") as log:
        log.write(json.dumps({"step": step, "loss": float(loss).hex()}) + "\n")
        log.flush()
        os.fsync(log.fileno())


def maybe_die(step: int, kill_at: int) -> None:
    """SIGKILL this process after step ``kill_at`` (0: never), as a preemption would."""
    if kill_at and step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)


def save_weights(run_dir: Path, model: nn.Module) -> None:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, run_dir / "weights.pt")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def read_losses(run_dir: Path, rank: int = 0) -> dict[int, Any]:
    """The last loss logged for each step (a resumed run's, for the steps it ran again)."""
    path = run_dir / f"losses{rank or ''}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {entry["step"]: entry["loss"] for entry in map(json.loads, lines)}
