"""AccumulationWindow: a state saved inside a gradient-accumulation window resumes to the same optimizer steps.

The property: a run of optimizer steps over accumulated micro-batches (a model with dropout, AdamW, a
warmup LR schedule), saved after any micro-batch and resumed in fresh objects from the window's state,
ends with the uninterrupted run's weights, bitwise, and trains every window on the same micro-batches.
"""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from resumable_data import ResumableDataLoader, ResumeError, capture_rng_state
from resumable_data.accumulation import REWIND, AccumulationWindow


class Augmented(torch.utils.data.Dataset):
    """Samples whose augmentation draws from the global RNGs (as torchvision transforms do)."""

    def __init__(self, n: int) -> None:
        self.x = torch.linspace(-1, 1, n * 4).reshape(n, 4)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        noise = torch.rand(4) + float(np.random.rand()) + random.random()
        return self.x[i] + 0.01 * noise


def build(
    n: int, batch_size: int, steps: int
) -> tuple[AccumulationWindow, torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    loader = ResumableDataLoader(Augmented(n), batch_size=batch_size, seed=3)
    return AccumulationWindow(loader, steps), model, optimizer, scheduler


def train(
    n: int,
    batch_size: int,
    steps: int,
    micro_batches: int,
    *,
    stop_after: int | None = None,
    resume: dict | None = None,
):
    """Train ``micro_batches`` micro-batches; return (losses by micro-batch, weights, saved state or None)."""
    window, model, optimizer, scheduler = build(n, batch_size, steps)
    done, losses = 0, {}
    if resume is not None:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        scheduler.load_state_dict(resume["scheduler"])
        window.load_state_dict(resume["window"])
        done = resume["micro"] - resume["window"][REWIND]  # the window's drawn micro-batches are read again
    while done < micro_batches:  # each pass of the window goes on with the loader's epoch, or starts the next
        for batch in window:
            loss = model(batch).pow(2).mean()
            (loss / steps).backward()
            losses[done] = loss.item()
            done += 1
            if window.taken == 0:  # the window's last micro-batch: the optimizer step
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if done == stop_after:
                saved = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "window": window.state_dict(),
                    "micro": done,
                }
                return losses, None, saved
            if done == micro_batches:
                break
    return losses, [p.detach().clone() for p in model.parameters()], None


@given(
    n=st.integers(5, 23),
    batch_size=st.integers(1, 4),
    steps=st.integers(1, 4),
    data=st.data(),
)
def test_a_save_inside_a_window_resumes_to_the_uninterrupted_weights_bitwise(n, batch_size, steps, data):
    total = steps * 6
    stop = data.draw(st.integers(1, total - 1), label="stop after micro-batch")
    reference_losses, reference_weights, _ = train(n, batch_size, steps, total)
    _, _, saved = train(n, batch_size, steps, total, stop_after=stop)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)  # plain state, as a checkpoint holds it
    assert saved["window"][REWIND] == stop % steps
    resumed_losses, resumed_weights, _ = train(n, batch_size, steps, total, resume=saved)
    for micro, loss in resumed_losses.items():
        assert loss == reference_losses[micro], f"micro-batch {micro}"
    assert all(torch.equal(a, b) for a, b in zip(resumed_weights, reference_weights, strict=True))


def test_the_loaders_own_state_saved_inside_a_window_resumes_to_other_weights():
    """Why the window exists: the state at the save loses the gradient accumulated since the window began."""
    n, batch_size, steps, total, stop = 12, 2, 3, 12, 4
    _, reference_weights, _ = train(n, batch_size, steps, total)
    _, _, saved = train(n, batch_size, steps, total, stop_after=stop)
    naive = {**saved["window"], REWIND: 0}  # the position and RNGs of the save itself, as a loader alone saves
    naive["dataloader"] = {**naive["dataloader"], "position": stop * batch_size}
    naive["rng"] = capture_rng_state()
    _, naive_weights, _ = train(n, batch_size, steps, total, resume={**saved, "window": naive})
    assert not all(torch.equal(a, b) for a, b in zip(naive_weights, reference_weights, strict=True))


def test_a_refused_state_leaves_the_loader_and_the_rngs_unchanged():
    window, *_ = build(10, 2, 3)
    batches = iter(window)
    next(batches)
    saved = window.state_dict()
    before_loader, before_rng = window.loader.state_dict(), capture_rng_state()
    other_steps = AccumulationWindow(window.loader, steps=2)
    with pytest.raises(ResumeError, match=r"steps=3 micro-batches per optimizer step, this window has steps=2"):
        other_steps.load_state_dict(saved)
    with pytest.raises(ResumeError, match=r"rewind=3, expected fewer than its steps=3"):
        window.load_state_dict({**saved, REWIND: 3})
    with pytest.raises(ResumeError, match=r"missing the key 'rng'"):
        window.load_state_dict({k: v for k, v in saved.items() if k != "rng"})
    bad_loader_state = {**saved, "dataloader": {**saved["dataloader"], "dataset_length": 11}}
    with pytest.raises(ResumeError, match="dataset length"):
        window.load_state_dict(bad_loader_state)
    assert window.loader.state_dict() == before_loader
    after = capture_rng_state()
    assert torch.equal(after["torch"], before_rng["torch"]) and after["python"] == before_rng["python"]
    with pytest.raises(ResumeError, match=r"steps should be an integer >= 1"):
        AccumulationWindow(window.loader, steps=0)
