"""The one resume harness: build an uninterrupted reference, interrupt, restore, compare bitwise.

A "run" is the sequence of items (batches, records) a training loop gets. Two loops are modelled:

- ``epochs=None``: the loader keeps its own epoch (``while True: for batch in loader``), as a
  ``ResumableDataLoader`` or ``StreamLoader`` allows; ``total`` items are compared.
- ``epochs=E``: the caller drives the epochs (``for epoch in range(E): x.set_epoch(epoch); for item
  in x``) and saves the epoch it stopped in with the state, as a trainer over a bare ``Stream`` does.

A resumed run is the same loop cut after the given item counts: at each cut the state goes through
a checkpoint's round trip (JSON and ``torch.save`` + ``torch.load(weights_only=True)`` in turn) into
a freshly built object, which the loop then continues. Everything is compared with the library's
own comparator, :func:`resumable_data.testing.assert_same`.

``run_with_snapshots`` and ``resume_from`` are the pieces for what a chain of cuts cannot express:
a state taken after an epoch's ``for`` loop has ended, and several resumes from one reference run
into differently configured loaders.
"""

from __future__ import annotations

import io
import itertools
import json
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from resumable_data.rng import SampleKey
from resumable_data.testing import assert_same

Roundtrip = Callable[[dict[str, Any]], dict[str, Any]]


def checkpoint_roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """What survives a checkpoint file: torch.save, then a weights_only load."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def json_roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """What survives a JSON file (tuples come back as lists)."""
    return json.loads(json.dumps(state))


def resumed_run(make: Callable[[], Any], cut: int) -> list[Any]:
    """``cut`` items of a fresh ``make()``, a restore of its JSON state into another fresh one, then
    what that one yields to the end of the epoch."""
    first = make()
    items = list(itertools.islice(iter(first), cut))
    restored = make()
    restored.load_state_dict(json_roundtrip(first.state_dict()))
    return items + list(restored)


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


def epoch_loop(stream: Any, epochs: int, start_epoch: int = 0) -> Iterator[tuple[int, Any]]:
    """``for epoch in range(start_epoch, epochs): stream.set_epoch(epoch); for item in stream``,
    yielding ``(epoch, item)``: the epoch is what a trainer saves next to the stream's state."""
    for epoch in range(start_epoch, epochs):
        stream.set_epoch(epoch)
        for item in stream:
            yield epoch, item


def consume(stream: Any, epochs: int) -> list[Any]:
    """Every item of ``epochs`` epochs of a caller-driven epoch loop."""
    return [item for _, item in epoch_loop(stream, epochs)]


def _loop(obj: Any, epochs: int | None, start_epoch: int) -> Iterator[tuple[int, Any]]:
    if epochs is None:
        return ((0, item) for item in endless(obj))
    return epoch_loop(obj, epochs, start_epoch)


def assert_resumes_identically(
    make: Callable[[], Any],
    cuts: Sequence[int],
    total: int | None = None,
    *,
    epochs: int | None = None,
    make_resumed: Callable[[], Any] | None = None,
    roundtrips: Sequence[Roundtrip] = (json_roundtrip, checkpoint_roundtrip),
) -> None:
    """Stop after each cut, restore into a fresh object, continue; compare with the uninterrupted run.

    Args:
        make: builds a fresh loader or stream (the reference and the first leg).
        cuts: cumulative item counts at which the run is stopped and restored, in order; 0 is a
            resume before the first item, a repeated value several resumes at the same point.
        total: how many items to compare. Required when the loader keeps its own epoch (the loop
            never ends); choose it past the last cut's epoch so the *following* epoch is compared
            too. With ``epochs``, None compares the whole run.
        epochs: drive the epochs from the caller with ``set_epoch`` for this many epochs (see the
            module docstring); None: the loader's own epochs.
        make_resumed: builds what is restored into (default: ``make``), e.g. with other workers.
        roundtrips: what each cut's state goes through, used in turn from the first cut on.
    """
    if list(cuts) != sorted(cuts) or (total is not None and cuts and cuts[-1] > total):
        raise ValueError(f"cuts must be sorted and within the run: {list(cuts)}, total {total}")
    if epochs is None and total is None:
        raise ValueError("a loader that keeps its own epoch never ends: give total")
    reference = [item for _, item in itertools.islice(_loop(make(), epochs, 0), total)]
    make_resumed = make_resumed or make

    resumed: list[Any] = []
    current, epoch = make(), 0
    items = _loop(current, epochs, epoch)
    for n, cut in enumerate(cuts):
        leg = list(itertools.islice(items, cut - len(resumed)))
        resumed += [item for _, item in leg]
        epoch = leg[-1][0] if leg else epoch  # the epoch a trainer saves: that of its last item
        if len(resumed) != cut:
            raise AssertionError(f"cut {cut} is past the end of the run ({len(resumed)} items)")
        state = roundtrips[n % len(roundtrips)](current.state_dict())
        current = make_resumed()
        current.load_state_dict(state)
        items = _loop(current, epochs, epoch)
    resumed += [item for _, item in itertools.islice(items, None if total is None else total - len(resumed))]
    assert_same(reference, resumed, "resumed run")


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
    return take(loader, count)


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
