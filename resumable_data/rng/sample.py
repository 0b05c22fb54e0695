"""Per-sample randomness: RNGs derived from ``(seed, epoch, sample index)``.

Randomness inside data loading (random crops, noise) can be made exact without touching the global
RNGs: derive an RNG from ``(seed, epoch, sample index)`` with :func:`sample_generator`, or let the
loader hand your dataset a :class:`SampleKey`. Those RNGs are bitwise identical after a resume and
whatever ``num_workers`` is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core.hash import hash_ints

__all__ = ["RandomMap", "SampleKey", "sample_generator", "sample_numpy_rng", "sample_seed"]


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed that is a pure function of ``(seed, epoch, index)``."""
    return hash_ints(seed, epoch, index) >> 1


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from ``(seed, epoch, index)``.

    Example:
        >>> g = sample_generator(0, epoch=3, index=17)
        >>> noise = torch.randn(4, generator=g)  # the same after any resume
    """
    g = torch.Generator()
    g.manual_seed(sample_seed(seed, epoch, index))
    return g


def sample_numpy_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """A numpy ``Generator`` seeded from ``(seed, epoch, index)``."""
    return np.random.default_rng(sample_seed(seed, epoch, index))


@dataclass(frozen=True, slots=True)
class SampleKey:
    """What a :class:`ResumableDataLoader` passes to ``dataset[...]`` when the dataset asks for it.

    A dataset that sets the class attribute ``wants_sample_key = True`` receives a ``SampleKey``
    instead of a bare index, so it can draw per-sample randomness that survives a resume::

        class Noisy(torch.utils.data.Dataset):
            wants_sample_key = True

            def __getitem__(self, key: SampleKey) -> torch.Tensor:
                x = self.data[key.index]
                return x + 0.1 * torch.randn(x.shape, generator=key.generator())

    A plain frozen record, not a tuple: ``key.index`` is the sample's index (a tuple's ``index``
    would be its search method).

    Args:
        index: the sample's index in the dataset.
        epoch: the epoch it is drawn in.
        seed: the loader's seed.

    Example:
        >>> key = SampleKey(index=17, epoch=3, seed=0)
        >>> torch.equal(torch.rand(2, generator=key.generator()), torch.rand(2, generator=key.generator()))
        True
    """

    index: int
    epoch: int
    seed: int

    def __reduce__(self) -> tuple[type[SampleKey], tuple[int, int, int]]:
        # Rebuild through the constructor: python 3.10 cannot unpickle a frozen slots dataclass.
        return SampleKey, (self.index, self.epoch, self.seed)

    def generator(self) -> torch.Generator:
        """A torch CPU generator for this sample (see :func:`sample_generator`)."""
        return sample_generator(self.seed, self.epoch, self.index)

    def numpy_rng(self) -> np.random.Generator:
        """A numpy generator for this sample (see :func:`sample_numpy_rng`)."""
        return sample_numpy_rng(self.seed, self.epoch, self.index)


class RandomMap(torch.utils.data.Dataset):
    """Apply ``transform(sample, generator)`` with a per-sample generator: random augmentation
    that resumes exactly.

    Args:
        dataset: any map-style dataset indexed by int.
        transform: called as ``transform(dataset[index], generator)``; must draw its randomness
            only from ``generator``.

    Example::

        ds = RandomMap(images, lambda x, g: random_crop(x, 24, generator=g))
        loader = ResumableDataLoader(ds, batch_size=32, seed=0)  # crops resume exactly
    """

    wants_sample_key = True

    def __init__(self, dataset: Any, transform: Callable[[Any, torch.Generator], Any]) -> None:
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: SampleKey) -> Any:
        if not isinstance(key, SampleKey):
            raise TypeError(
                "RandomMap must be indexed with a SampleKey (ResumableDataLoader does this); "
                f"got {type(key).__name__}. Use SampleKey(index, epoch, seed) to index it by hand."
            )
        return self.transform(self.dataset[key.index], key.generator())
