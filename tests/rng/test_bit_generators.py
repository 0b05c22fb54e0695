"""numpy's global RNG on any bit generator (``numpy.random.set_bit_generator``): the loaders seed it
per batch and resume exactly, and ``capture_rng_state``/``restore_rng_state`` carry it through a
weights_only checkpoint."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from harness import GlobalRandomAugment, assert_resumes_identically, checkpoint_roundtrip
from resumable_data import ResumableDataLoader, ResumeError, capture_rng_state, restore_rng_state

ALL = [np.random.MT19937, np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.SFC64]


@pytest.fixture
def global_bit_generator(request: pytest.FixtureRequest) -> Iterator[Any]:
    """numpy's global RNG running on a ``request.param`` bit generator for the test."""
    original = np.random.get_bit_generator()
    np.random.set_bit_generator(request.param(2024))
    yield np.random.get_bit_generator()
    np.random.set_bit_generator(original)


def draws() -> list[float]:
    return [
        *np.random.random_sample(3).tolist(),
        float(np.random.standard_normal()),
        float(np.random.randint(0, 2**31)),
        random.random(),
        torch.rand(()).item(),
    ]


def loader(num_workers: int) -> ResumableDataLoader:
    return ResumableDataLoader(
        GlobalRandomAugment(20),
        batch_size=3,
        seed=4,
        num_workers=num_workers,
        **({"timeout": 60} if num_workers else {}),
    )


@pytest.mark.parametrize(
    "global_bit_generator", [np.random.PCG64, np.random.Philox], indirect=True, ids=lambda t: t.__name__
)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_drawing_from_numpys_global_rng_resumes_exactly(global_bit_generator: Any, num_workers: int) -> None:
    # On main: every batch raised "TypeError: can only re-seed a MT19937 BitGenerator".
    assert_resumes_identically(lambda: loader(num_workers), [4, 9], 14)


@pytest.mark.parametrize("global_bit_generator", [np.random.PCG64], indirect=True, ids=lambda t: t.__name__)
def test_the_batches_do_not_depend_on_where_they_are_fetched(global_bit_generator: Any) -> None:
    def images(num_workers: int) -> list[torch.Tensor]:
        return [batch[0] for batch in loader(num_workers)]

    assert all(torch.equal(a, b) for a, b in zip(images(0), images(2), strict=True))


@pytest.mark.parametrize("global_bit_generator", ALL, indirect=True, ids=lambda t: t.__name__)
def test_capture_and_restore_carry_any_bit_generator_through_a_weights_only_checkpoint(
    global_bit_generator: Any,
) -> None:
    # On main: capture_rng_state() raised "ValueError: too many values to unpack" for non-MT19937.
    np.random.random_sample(5), np.random.standard_normal()  # a cached Gaussian, a moved generator
    state = checkpoint_roundtrip(capture_rng_state())
    expected = draws()
    draws()
    restore_rng_state(state)
    assert draws() == expected


@pytest.mark.parametrize("global_bit_generator", [np.random.PCG64], indirect=True, ids=lambda t: t.__name__)
def test_restore_gives_numpy_the_checkpoints_bit_generator_type(global_bit_generator: Any) -> None:
    state = checkpoint_roundtrip(capture_rng_state())
    expected = draws()
    np.random.set_bit_generator(np.random.MT19937(0))  # e.g. a fresh process that never set one
    restore_rng_state(state)
    assert type(np.random.get_bit_generator()) is np.random.PCG64
    assert draws() == expected


def everything() -> tuple[Any, ...]:
    return (
        repr(np.random.get_state(legacy=False)),
        np.random.get_bit_generator(),
        random.getstate(),
        torch.get_rng_state(),
    )


@pytest.mark.parametrize(
    ("global_bit_generator", "edit", "field"),
    [
        (np.random.PCG64, lambda s: s["bit_generator_state"]["state"].update(inc=-1), "bit_generator_state"),
        (
            np.random.Philox,
            lambda s: s["bit_generator_state"]["state"]["key"].__setitem__(0, 2**64),
            "bit_generator_state",
        ),
        (np.random.PCG64, lambda s: s["bit_generator_state"].pop("state"), "numpy"),
        (
            np.random.PCG64,
            lambda s: s["bit_generator_state"].update(bit_generator="SFC64"),
            "bit_generator_state.bit_generator",
        ),
        (np.random.PCG64, lambda s: s.update(name="NoSuchGenerator"), "numpy.name"),
        (np.random.PCG64, lambda s: s.update(has_gauss=2), "numpy.has_gauss"),
        (np.random.PCG64, lambda s: s.pop("bit_generator_state"), "bit_generator_state"),
    ],
    indirect=["global_bit_generator"],
    ids=[
        "negative-word",
        "word-past-64-bits",
        "missing-field",
        "other-name-inside",
        "unknown-name",
        "bad-gauss-flag",
        "missing-part",
    ],
)
def test_a_malformed_bit_generator_state_is_refused_naming_the_field_and_changes_nothing(
    global_bit_generator: Any, edit: Any, field: str
) -> None:
    state = capture_rng_state()
    edit(state["numpy"])
    draws()
    before = everything()
    with pytest.raises(ResumeError, match=field.replace(".", r"\.")):
        restore_rng_state(state)
    after = everything()
    assert after[:3] == before[:3] and torch.equal(after[3], before[3])
