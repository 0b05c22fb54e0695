"""The shared resume harness: build an uninterrupted reference, interrupt, restore, compare.

A "run" is the stream of batches a loop gets when it simply keeps iterating the loader across
epochs. A resumed run is the same stream cut at the given batch counts: at each cut the loader's
state goes through ``torch.save`` + ``torch.load(weights_only=True)`` into a freshly built loader,
exactly as a checkpoint would carry it.
"""

from __future__ import annotations

import io
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from resumable_data import SampleKey


def checkpoint_roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """What survives a checkpoint file: torch.save, then a weights_only load."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def endless(loader: Any) -> Iterator[Any]:
    """Iterate a loader across epochs the way a ``while True: for batch in loader`` loop does."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise AssertionError("an epoch yielded no batch: the configuration would loop forever")


def take(loader: Any, n: int) -> list[Any]:
    return list(itertools.islice(endless(loader), n))


def assert_batches_equal(expected: Sequence[Any], actual: Sequence[Any]) -> None:
    """Bitwise equality of two batch streams (tensors, or tuples/lists/dicts of tensors)."""
    assert len(actual) == len(expected), f"resumed run has {len(actual)} batches, reference {len(expected)}"
    for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
        _assert_equal(a, b, f"batch {i}")


def _assert_equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs: {a} vs {b}"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where} differs in length"
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}[{k}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where} keys differ"
        for k in a:
            _assert_equal(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, f"{where} differs: {a!r} vs {b!r}"


def assert_resumes_identically(
    make_loader: Callable[[], Any],
    interruptions: Sequence[int],
    total_batches: int,
    make_resumed_loader: Callable[[], Any] | None = None,
) -> None:
    """Resume at each cut (cumulative batch counts) and compare with the uninterrupted run.

    Args:
        make_loader: builds a fresh loader (the reference and the first leg).
        interruptions: batch counts at which the run is stopped and restored, in order; repeated
            values are several resumes at the same point.
        total_batches: length of the compared stream; choose it past the last cut's epoch so the
            *following* epoch is compared too.
        make_resumed_loader: builds the loader that is restored into (default: make_loader), e.g.
            with a different num_workers.
    """
    assert list(interruptions) == sorted(interruptions) and interruptions[-1] <= total_batches
    reference = take(make_loader(), total_batches)
    make_resumed_loader = make_resumed_loader or make_loader

    resumed: list[Any] = []
    loader = make_loader()
    stream = endless(loader)
    for cut in interruptions:
        resumed.extend(itertools.islice(stream, cut - len(resumed)))
        state = checkpoint_roundtrip(loader.state_dict())
        loader = make_resumed_loader()
        loader.load_state_dict(state)
        stream = endless(loader)
    resumed.extend(itertools.islice(stream, total_batches - len(resumed)))
    assert_batches_equal(reference, resumed)


class NoisyIndexDataset(torch.utils.data.Dataset):
    """Returns (index, noise, crop): the index plus per-sample random augmentation.

    The augmentation uses only the generator of the SampleKey, so it must be bitwise identical
    after any resume and for any num_workers. Picklable, so it works with worker processes.
    """

    wants_sample_key = True

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: SampleKey) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = key.generator()
        image = torch.arange(64, dtype=torch.float32).reshape(8, 8) + key.index
        top, left = torch.randint(0, 4, (2,), generator=g).tolist()
        crop = image[top : top + 4, left : left + 4]
        noise = torch.randn(3, generator=g)
        return torch.tensor(key.index), noise, crop


def run_with_snapshots(make: Callable[[], Any], epochs: int, cuts: set[tuple[str, int]]) -> tuple[list, dict]:
    """Iterate ``epochs`` epochs like a user loop; snapshot the state at the given points.

    ("in", k): inside the loop right after the k-th batch (k = 0: before the first iteration);
    ("after", e): after the ``for`` loop of epoch e has ended.
    """
    loader = make()
    batches: list[Any] = []
    states: dict[tuple[str, int], Any] = {}
    if ("in", 0) in cuts:
        states[("in", 0)] = checkpoint_roundtrip(loader.state_dict())
    for epoch in range(epochs):
        for batch in loader:
            batches.append(batch)
            if ("in", len(batches)) in cuts:
                states[("in", len(batches))] = checkpoint_roundtrip(loader.state_dict())
        if ("after", epoch) in cuts:
            states[("after", epoch)] = checkpoint_roundtrip(loader.state_dict())
    return batches, states


def resume_from(make: Callable[[], Any], state: Any, count: int) -> list[Any]:
    """A fresh loader restored from ``state``, iterated epoch loop by epoch loop for ``count`` batches."""
    loader = make()
    loader.load_state_dict(state)
    out: list[Any] = []
    while len(out) < count:
        before = len(out)
        for batch in loader:
            out.append(batch)
            if len(out) == count:
                break
        if len(out) == before:
            raise AssertionError("the resumed loader yielded an empty epoch")
    return out


class GlobalRandomAugment(torch.utils.data.Dataset):
    """A torchvision-style dataset: crop and flip from torch's global RNG, plus numpy and random draws."""

    def __init__(self, length: int) -> None:
        self.images = torch.arange(length * 3 * 8 * 8, dtype=torch.float32).reshape(length, 3, 8, 8)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        top, left = torch.randint(0, 3, (2,)).tolist()
        image = image[:, top : top + 6, left : left + 6]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        image = image * float(np.random.uniform(0.9, 1.1)) + random.gauss(0.0, 0.01)
        return image, torch.tensor(index)
