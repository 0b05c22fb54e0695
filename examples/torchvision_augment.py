"""torchvision augmentation with worker processes, stopped mid-epoch and resumed bitwise.

The v2 transforms (RandomResizedCrop, RandomHorizontalFlip, ColorJitter) draw from torch's global
RNG inside the DataLoader workers, as users write them: no generator anywhere. The loader's
``global_rng="batch"`` (the default) seeds the global RNGs of whichever worker fetches a batch from
``(seed, epoch, position)``, so every augmented batch is the same after a resume, with any
``num_workers``. A small CNN is trained on ``torchvision.datasets.FakeData``; the per-step losses
and final weights of a straight run and a stopped-and-resumed run are compared bitwise.

    python examples/torchvision_augment.py            # CPU only, under a minute
    python examples/torchvision_augment.py --smoke    # what the test suite runs
"""

from __future__ import annotations

import argparse

import torch
import torchvision
from torch import nn
from torchvision.transforms import v2

from resumable_data import ResumableDataLoader, capture_rng_state, restore_rng_state

AUGMENT = v2.Compose(
    [
        v2.ToImage(),
        v2.RandomResizedCrop(24, scale=(0.5, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1),
        v2.ToDtype(torch.float32, scale=True),
    ]
)


def build(images: int, num_workers: int) -> tuple[nn.Module, torch.optim.Optimizer, ResumableDataLoader]:
    torch.manual_seed(0)
    data = torchvision.datasets.FakeData(size=images, image_size=(3, 32, 32), num_classes=10, transform=AUGMENT)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = ResumableDataLoader(data, batch_size=16, shuffle=True, seed=0, num_workers=num_workers)
    return model, optimizer, loader


def train(
    images: int, num_epochs: int, *, num_workers: int = 2, stop_at: int | None = None, checkpoint: dict | None = None
):
    """Returns (losses, final weights or None, checkpoint or None)."""
    model, optimizer, loader = build(images, num_workers)
    losses: list[float] = []
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loader.load_state_dict(checkpoint["dataloader"])
        restore_rng_state(checkpoint["rng"])
        losses = list(checkpoint["losses"])
    for epoch in range(loader.epoch, num_epochs):
        loader.set_epoch(epoch)
        for images_batch, labels in loader:
            loss = nn.functional.cross_entropy(model(images_batch), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == stop_at:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "dataloader": loader.state_dict(),
                    "rng": capture_rng_state(),
                    "losses": losses,
                }
                return losses, None, state
    return losses, model.state_dict(), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a smaller run, for the test suite")
    args = parser.parse_args()
    images, num_epochs = (64, 2) if args.smoke else (192, 3)
    steps_per_epoch = images // 16
    stop_at = steps_per_epoch + steps_per_epoch // 2  # in the middle of the second epoch

    reference, final_reference, _ = train(images, num_epochs)
    _, _, checkpoint = train(images, num_epochs, stop_at=stop_at)
    # Resume with a different number of workers: the augmented batches do not depend on it.
    resumed, final_resumed, _ = train(images, num_epochs, num_workers=1, checkpoint=checkpoint)
    same_weights = all(
        torch.equal(a, b) for a, b in zip(final_reference.values(), final_resumed.values(), strict=False)
    )
    print(f"{len(reference)} steps with 2 workers; stopped after step {stop_at}, resumed with 1 worker")
    print(f"final loss {reference[-1]:.6f} (uninterrupted) vs {resumed[-1]:.6f} (resumed)")
    identical = resumed == reference and same_weights
    print(f"identical: {identical}")
    raise SystemExit(0 if identical else 1)


if __name__ == "__main__":
    main()
