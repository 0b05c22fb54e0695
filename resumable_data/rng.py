"""Random number state: capture and restore the global RNGs, and derive per-sample RNGs.

Two kinds of randomness matter for an exact resume:

* The process-global RNGs (python ``random``, numpy's legacy global RNG, torch CPU and every CUDA
  device) that model code draws from (dropout, init, sampling). :func:`capture_rng_state` stores
  them in a form that loads with ``torch.load(weights_only=True)``; :func:`restore_rng_state` puts
  them back.
* Randomness inside data loading (random crops, noise). Global RNGs cannot make that exact: workers
  are re-seeded on every ``iter()`` and each worker sees a different slice of the stream. Instead
  derive an RNG from ``(seed, epoch, sample index)`` with :func:`sample_generator`, or let the
  loader hand your dataset a :class:`SampleKey`. Those RNGs are bitwise identical after a resume
  and whatever ``num_workers`` is.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from ._hash import hash_ints
from ._state import ResumeError, check_version, require_mapping

__all__ = [
    "RandomMap",
    "SampleKey",
    "capture_rng_state",
    "restore_rng_state",
    "sample_generator",
    "sample_numpy_rng",
    "sample_seed",
]

RNG_STATE_VERSION = 1
_PYTHON = "python"
_NUMPY = "numpy"
_TORCH = "torch"
_CUDA = "cuda"
_WHAT = "RNG"


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


class SampleKey(NamedTuple):
    """What a :class:`ResumableDataLoader` passes to ``dataset[...]`` when the dataset asks for it.

    A dataset that sets the class attribute ``wants_sample_key = True`` receives a ``SampleKey``
    instead of a bare index, so it can draw per-sample randomness that survives a resume::

        class Noisy(torch.utils.data.Dataset):
            wants_sample_key = True

            def __getitem__(self, key: SampleKey) -> torch.Tensor:
                x = self.data[key.index]
                return x + 0.1 * torch.randn(x.shape, generator=key.generator())
    """

    index: int
    epoch: int
    seed: int

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

    Example:
        >>> ds = RandomMap(images, lambda x, g: random_crop(x, 24, generator=g))
        >>> loader = ResumableDataLoader(ds, batch_size=32, seed=0)  # crops resume exactly
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


def capture_rng_state() -> dict[str, Any]:
    """Capture python ``random``, numpy's global RNG, torch CPU and every CUDA device's RNG.

    Returns:
        A dict of ints, floats, lists and uint8 tensors that ``torch.save`` writes and
        ``torch.load(weights_only=True)`` reads back.
    """
    py_version, py_internal, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "version": RNG_STATE_VERSION,
        _PYTHON: {"version": py_version, "internal": list(py_internal), "gauss_next": py_gauss},
        _NUMPY: {
            "name": np_name,
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.uint32).view(np.int32).copy()),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        _TORCH: torch.get_rng_state(),
        _CUDA: [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }
    return state


def restore_rng_state(state: Mapping[str, Any], *, strict: bool = True) -> None:
    """Restore what :func:`capture_rng_state` captured.

    Args:
        state: a dict from :func:`capture_rng_state` (possibly after ``torch.load``).
        strict: when True, a checkpoint whose number of CUDA devices differs from this machine's
            is refused; when False, the CUDA part is restored for the devices both have.

    Raises:
        ResumeError: the state is malformed or does not fit this machine. Nothing was changed.
    """
    state = require_mapping(state, _WHAT)
    check_version(state, RNG_STATE_VERSION, _WHAT)
    for key in (_PYTHON, _NUMPY, _TORCH, _CUDA):
        if key not in state:
            raise ResumeError(f"RNG state is missing the key {key!r}; got keys {sorted(state)}")
    py = require_mapping(state[_PYTHON], "RNG 'python'")
    try:
        py_state = (int(py["version"]), tuple(int(v) for v in py["internal"]), py["gauss_next"])
        np_part = state[_NUMPY]
        np_state = (
            str(np_part["name"]),
            torch.as_tensor(np_part["keys"]).numpy().view(np.uint32).copy(),
            int(np_part["pos"]),
            int(np_part["has_gauss"]),
            float(np_part["cached_gaussian"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ResumeError(f"RNG state for python/numpy is malformed: {exc!r}") from exc
    torch_state = state[_TORCH]
    if not isinstance(torch_state, torch.Tensor) or torch_state.dtype != torch.uint8:
        raise ResumeError(f"RNG state field 'torch' must be a uint8 tensor, got {type(torch_state).__name__}")
    cuda_states = list(state[_CUDA])
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if strict and cuda_states and len(cuda_states) != have:
        raise ResumeError(
            f"RNG state holds {len(cuda_states)} CUDA device states but this machine has {have}; "
            "pass strict=False to restore the devices both have"
        )
    # Validate numpy's part by loading it into a scratch RandomState before touching globals.
    scratch = np.random.RandomState()
    try:
        scratch.set_state(np_state)
        random.Random().setstate(py_state)
    except (TypeError, ValueError) as exc:
        raise ResumeError(f"RNG state for python/numpy is malformed: {exc!r}") from exc

    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.set_rng_state(torch_state)
    for i, cuda_state in enumerate(cuda_states[:have]):
        torch.cuda.set_rng_state(cuda_state, i)
