"""RNG capture/restore covers python, numpy and torch and loads with weights_only; per-sample
RNGs make random augmentation resume exactly and independently of num_workers."""

from __future__ import annotations

import dataclasses
import pickle
import random

import numpy as np
import pytest
import torch

from harness import assert_resumes_identically, checkpoint_roundtrip, take
from resumable_data import ResumableDataLoader, ResumeError, capture_rng_state, restore_rng_state
from resumable_data.rng import RandomMap, SampleKey, sample_generator


def _draw() -> tuple[float, float, float, torch.Tensor]:
    return random.random(), random.gauss(0, 1), float(np.random.rand()), torch.rand(3)


def test_restore_puts_every_global_rng_back_through_a_weights_only_checkpoint() -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.randn()  # leave cached gaussians in both
    state = checkpoint_roundtrip(capture_rng_state())
    expected = _draw()
    _draw()
    restore_rng_state(state)
    actual = _draw()
    assert actual[:3] == expected[:3] and torch.equal(actual[3], expected[3])


def test_a_malformed_state_changes_nothing() -> None:
    state = capture_rng_state()
    state["numpy"] = {**state["numpy"], "pos": "not a number"}
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    with pytest.raises(ResumeError, match=r"numpy.pos"):
        restore_rng_state(state)
    assert torch.equal(torch.rand(2), expected)


def test_cuda_states_from_another_machine_need_strict_false() -> None:
    state = capture_rng_state()
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * (have + 1)
    with pytest.raises(ResumeError, match="strict=False"):
        restore_rng_state(state)
    restore_rng_state(state, strict=False)


def test_version_is_checked() -> None:
    with pytest.raises(ResumeError, match="version 2"):
        restore_rng_state({**capture_rng_state(), "version": 2})


def test_sample_generator_is_a_pure_function_of_seed_epoch_index() -> None:
    draw = lambda *args: torch.rand(4, generator=sample_generator(*args))
    assert torch.equal(draw(0, 1, 2), draw(0, 1, 2))
    assert not torch.equal(draw(0, 1, 2), draw(0, 1, 3))
    assert not torch.equal(draw(0, 1, 2), draw(0, 2, 2))
    assert not torch.equal(draw(0, 1, 2), draw(1, 1, 2))


def _random_crop_and_noise(image: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    top, left = torch.randint(0, 5, (2,), generator=g).tolist()
    return image[top : top + 4, left : left + 4] + 0.1 * torch.randn(4, 4, generator=g)


class Images(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 50

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.arange(64, dtype=torch.float32).reshape(8, 8) * (index + 1)


def _augmented(num_workers: int) -> ResumableDataLoader:
    return ResumableDataLoader(
        RandomMap(Images(), _random_crop_and_noise), batch_size=4, seed=9, num_workers=num_workers
    )


def test_random_augmentation_resumes_bitwise() -> None:
    assert_resumes_identically(lambda: _augmented(0), [3, 13, 20], 39, make_resumed=lambda: _augmented(2))


def test_random_augmentation_differs_across_epochs_and_ignores_workers() -> None:
    loader = _augmented(0)
    two_epochs = take(loader, 26)
    assert all(torch.equal(a, b) for a, b in zip(two_epochs, take(_augmented(2), 26), strict=True))
    # The same image gets a different crop in the next epoch: the epoch is part of the key.
    key0, key1 = SampleKey(7, 0, 9), SampleKey(7, 1, 9)
    dataset = RandomMap(Images(), _random_crop_and_noise)
    assert not torch.equal(dataset[key0], dataset[key1])


def test_random_map_refuses_a_bare_index() -> None:
    with pytest.raises(TypeError, match="SampleKey"):
        RandomMap(Images(), _random_crop_and_noise)[3]


def test_sample_key_is_a_frozen_record_whose_index_is_the_sample_index() -> None:
    # As a NamedTuple, SampleKey.index was the field at runtime but tuple.index to a type checker.
    key = SampleKey(17, 3, 9)
    assert (key.index, key.epoch, key.seed) == (17, 3, 9)
    assert key == SampleKey(index=17, epoch=3, seed=9) and hash(key) == hash(SampleKey(17, 3, 9))
    assert not isinstance(key, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.index = 18  # type: ignore[misc]
    # Workers receive keys through pickle; the copy draws the same randomness.
    copy = pickle.loads(pickle.dumps(key))
    assert copy == key and torch.equal(
        torch.rand(3, generator=copy.generator()), torch.rand(3, generator=key.generator())
    )
