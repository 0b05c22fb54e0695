"""A training script written the way users write them, used by tests/map/test_user_code.py.

torchvision-style transform classes draw from the *global* RNGs (torch, numpy, random) inside
DataLoader workers; the epoch loop is the user's own; the checkpoint holds model, AdamW, LR schedule,
loader and RNG state. Run it, SIGKILL it (``--kill-at``), run it again: the losses and final weights
must equal an uninterrupted run bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import torch
from torch import nn

from resumable_data import ResumableDataLoader, capture_rng_state, restore_rng_state


class RandomCrop:
    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        top = int(torch.randint(0, image.shape[-2] - self.size + 1, (1,)))
        left = int(torch.randint(0, image.shape[-1] - self.size + 1, (1,)))
        return image[..., top : top + self.size, left : left + self.size]


class RandomHorizontalFlip:
    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.flip(-1) if torch.rand(1) < 0.5 else image


class RandomBrightness:  # numpy's global RNG, as many older pipelines do
    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image * float(np.random.uniform(0.8, 1.2))


class GaussianNoise:  # python's random module
    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image + random.gauss(0.0, 0.05)


class Compose:
    def __init__(self, transforms: list) -> None:
        self.transforms = transforms

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        for transform in self.transforms:
            image = transform(image)
        return image


class Images(torch.utils.data.Dataset):
    def __init__(self, transform: Compose) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.images = torch.rand(48, 3, 12, 12, generator=generator)
        self.labels = torch.arange(48) % 4
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(self.images[index]), self.labels[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=0, help="SIGKILL itself after this step")
    args = parser.parse_args()
    torch.set_num_threads(1)

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Dropout(0.2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    dataset = Images(Compose([RandomCrop(8), RandomHorizontalFlip(), RandomBrightness(), GaussianNoise()]))
    loader = ResumableDataLoader(
        dataset,
        batch_size=5,
        shuffle=True,
        seed=0,
        num_workers=args.workers,
        persistent_workers=args.persistent and args.workers > 0,
    )

    checkpoint_path = args.run_dir / "checkpoint.pt"
    step, losses = 0, []
    if checkpoint_path.exists():
        checkpoint = torch.load(checkpoint_path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        loader.load_state_dict(checkpoint["loader"])
        restore_rng_state(checkpoint["rng"])
        step, losses = checkpoint["step"], checkpoint["losses"]

    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            losses.append(loss.item())
            if step % 3 == 0:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "loader": loader.state_dict(),
                    "rng": capture_rng_state(),
                    "step": step,
                    "losses": losses,
                }
                torch.save(state, checkpoint_path.with_suffix(".tmp"))
                os.replace(checkpoint_path.with_suffix(".tmp"), checkpoint_path)
            if step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    torch.save(model.state_dict(), args.run_dir / "final.pt")
    (args.run_dir / "losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
