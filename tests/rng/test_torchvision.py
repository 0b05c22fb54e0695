"""torchvision v2 transforms, which draw from torch's global RNG, resume bitwise with workers.

Specification: a dataset that applies RandomResizedCrop, RandomHorizontalFlip and ColorJitter (as
users write it, no generator passed anywhere) behind ``ResumableDataLoader`` yields, after a
resume, exactly the augmented batches of the uninterrupted run, with 2 workers and when the resumed
run has another ``num_workers``. The loader's default ``global_rng="batch"`` is what makes it so.
"""

from __future__ import annotations

import pytest

from torchvision_compat import pytest_torchvision

torchvision = pytest_torchvision()

import torch  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

from harness import assert_resumes_identically, take  # noqa: E402
from resumable_data import ResumableDataLoader  # noqa: E402


class SyntheticImages(torch.utils.data.Dataset):
    """``length`` deterministic 3x32x32 uint8 images with a label, augmented by ``transform``."""

    def __init__(self, length: int, transform: v2.Transform) -> None:
        self.length = length
        self.transform = transform

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(index)  # the *image* is fixed; only augmentation is random
        image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=g)
        return self.transform(image), index % 10


def augmentation() -> v2.Transform:
    return v2.Compose(
        [
            v2.RandomResizedCrop(24, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1),
            v2.ToDtype(torch.float32, scale=True),
        ]
    )


def loader(num_workers: int) -> ResumableDataLoader:
    return ResumableDataLoader(SyntheticImages(30, augmentation()), batch_size=4, seed=0, num_workers=num_workers)


@pytest.mark.parametrize(("before", "after"), [(2, 2), (2, 0), (0, 2)])
def test_v2_augmentation_resumes_bitwise_with_workers(before: int, after: int) -> None:
    n = len(loader(0))
    assert_resumes_identically(lambda: loader(before), [3, n, n + 2], total=2 * n, make_resumed=lambda: loader(after))


def test_the_augmentation_is_really_random() -> None:
    # Not a vacuous comparison: an image's two epochs get different crops/flips/colours.
    data = ResumableDataLoader(SyntheticImages(8, augmentation()), batch_size=8, shuffle=False)
    first, second = take(data, 2)
    assert first[0].shape == (8, 3, 24, 24)
    assert not torch.equal(first[0], second[0])
