"""The process-global RNGs: capture and restore them.

Model code draws from the process-global RNGs (python ``random``, numpy's legacy global RNG, torch
CPU and every CUDA device): dropout, init, sampling. :func:`capture_rng_state` stores them in a form
that loads with ``torch.load(weights_only=True)``; :func:`restore_rng_state` puts them back.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from numpy.random.mtrand import get_bit_generator, set_bit_generator  # numpy.random's, as numpy's stubs export them

from ..core.state import VERSION, brief, check_version, is_int, keys_of, require_mapping
from ..errors import ResumeError

__all__ = ["capture_rng_state", "restore_rng_state"]

RNG_STATE_VERSION = 1
# Keys of the RNG state, declared once. The top level carries VERSION and one part per RNG.
_PYTHON = "python"
_NUMPY = "numpy"
_TORCH = "torch"
_CUDA = "cuda"
# The python part: random.getstate()'s (version, internal, gauss_next); its own version number
# sits under the same key name as every state's VERSION.
_PY_VERSION = VERSION
_PY_INTERNAL = "internal"
_PY_GAUSS_NEXT = "gauss_next"
_PY_KEYS = (_PY_VERSION, _PY_INTERNAL, _PY_GAUSS_NEXT)
# The numpy part: np.random.get_state(legacy=True)'s (name, keys, pos, has_gauss, cached_gaussian)
# for MT19937; for any other bit generator its name, its ``state`` dict (arrays as lists of ints)
# and the RandomState's Gaussian cache.
_NP_NAME = "name"
_NP_KEYS = "keys"
_NP_POS = "pos"
_NP_HAS_GAUSS = "has_gauss"
_NP_CACHED_GAUSSIAN = "cached_gaussian"
_NP_FIELDS = (_NP_NAME, _NP_KEYS, _NP_POS, _NP_HAS_GAUSS, _NP_CACHED_GAUSSIAN)
_NP_BIT_GENERATOR_STATE = "bit_generator_state"
_NP_OTHER_FIELDS = (_NP_NAME, _NP_BIT_GENERATOR_STATE, _NP_HAS_GAUSS, _NP_CACHED_GAUSSIAN)
_MT19937 = "MT19937"
_WHAT = "RNG"


def capture_rng_state() -> dict[str, Any]:
    """Capture python ``random``, numpy's global RNG, torch CPU and every CUDA device's RNG.

    numpy's global RNG may run on any of numpy's bit generators (``numpy.random.set_bit_generator``):
    MT19937 (the default) is stored as ``numpy.random.get_state()``'s words, any other as its
    ``state`` dict with arrays turned into lists of ints.

    Returns:
        A dict of ints, floats, strings, lists and uint8/int32 tensors that ``torch.save`` writes
        and ``torch.load(weights_only=True)`` reads back.
    """
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        VERSION: RNG_STATE_VERSION,
        _PYTHON: {_PY_VERSION: py_version, _PY_INTERNAL: list(py_internal), _PY_GAUSS_NEXT: py_gauss},
        _NUMPY: _capture_numpy(),
        _TORCH: torch.get_rng_state(),
        _CUDA: [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }
    return state


def restore_rng_state(state: Mapping[str, Any], *, strict: bool = True) -> None:
    """Restore what :func:`capture_rng_state` captured.

    Every part is validated first (the torch and CUDA states by loading them into scratch
    generators), so a malformed state raises before any global RNG is touched.

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
            raise ResumeError(f"RNG state is missing the key {key!r}; got keys {keys_of(state)}")
    py_state = _python_state(state[_PYTHON])
    set_numpy = _numpy_setter(state[_NUMPY])
    torch_state = _torch_state(state[_TORCH])
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda_states = _cuda_states(state[_CUDA], have, strict)

    random.setstate(py_state)
    set_numpy()
    torch.set_rng_state(torch_state)
    for i, cuda_state in enumerate(cuda_states):
        torch.cuda.set_rng_state(cuda_state, i)


_MT_WORDS = 624  # words of Mersenne Twister state (python's random and numpy's legacy RNG)
_REMEDY = "pass the 'rng' part of a checkpoint written by capture_rng_state() unchanged"


def _malformed(field: str, expected: str, got: Any) -> ResumeError:
    return ResumeError(f"RNG state field {field!r} must be {expected}, but got {brief(got)}; {_REMEDY}")


def _is_cpu_tensor(value: Any, dtype: torch.dtype) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == dtype
        and value.device.type == "cpu"
        and value.layout == torch.strided
    )


def _is_finite_number(value: Any) -> bool:
    if is_int(value):
        return abs(value) <= 2**53  # exactly a float (a larger int may not even convert)
    return isinstance(value, float) and math.isfinite(value)


def _python_state(part: Any) -> tuple[int, tuple[int, ...], float | None]:
    """``random.setstate``'s argument, checked word by word and by a scratch ``random.Random``."""
    part = require_mapping(part, f"RNG {_PYTHON!r}")
    for key in _PY_KEYS:
        if key not in part:
            raise ResumeError(f"RNG {_PYTHON!r} state is missing the key {key!r}; got keys {keys_of(part)}")
    version, internal, gauss_next = (part[k] for k in _PY_KEYS)
    if not is_int(version):
        raise _malformed(f"{_PYTHON}.{_PY_VERSION}", "an int", version)
    # 624 words of 32 bits plus the index of the next word (0..624); python would silently truncate
    # larger words, so range-check them here.
    if not (
        isinstance(internal, (list, tuple))
        and len(internal) == _MT_WORDS + 1
        and all(is_int(w) and 0 <= w < 2**32 for w in internal)
        and internal[-1] <= _MT_WORDS
    ):
        raise _malformed(
            f"{_PYTHON}.{_PY_INTERNAL}", f"{_MT_WORDS} ints in [0, 2**32) and an index in [0, {_MT_WORDS}]", internal
        )
    if not any(internal[:-1]):
        raise _malformed(f"{_PYTHON}.{_PY_INTERNAL}", "a Mersenne Twister state (all zeros is degenerate)", internal)
    if gauss_next is not None and not _is_finite_number(gauss_next):
        raise _malformed(f"{_PYTHON}.{_PY_GAUSS_NEXT}", "None or a finite float", gauss_next)
    py_state = (version, tuple(internal), None if gauss_next is None else float(gauss_next))
    try:
        random.Random().setstate(py_state)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ResumeError(f"RNG state for python is malformed: {exc}; {_REMEDY}") from exc
    return py_state


def _capture_numpy() -> dict[str, Any]:
    """numpy's part of the state: see :func:`capture_rng_state`."""
    if type(get_bit_generator()) is np.random.MT19937:
        np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
        return {
            _NP_NAME: np_name,
            _NP_KEYS: torch.from_numpy(np.asarray(np_keys, dtype=np.uint32).view(np.int32).copy()),
            _NP_POS: int(np_pos),
            _NP_HAS_GAUSS: int(np_has_gauss),
            _NP_CACHED_GAUSSIAN: float(np_gauss),
        }
    full: Any = np.random.get_state(legacy=False)
    bit_generator_state = {k: v for k, v in full.items() if k not in ("has_gauss", "gauss")}
    return {
        _NP_NAME: full["bit_generator"],
        _NP_BIT_GENERATOR_STATE: _plain(bit_generator_state),
        _NP_HAS_GAUSS: int(full["has_gauss"]),
        _NP_CACHED_GAUSSIAN: float(full["gauss"]),
    }


def _plain(value: Any) -> Any:
    """A bit generator's ``state`` as plain data: arrays and numpy ints become (lists of) python ints."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return [int(v) for v in value.tolist()]
    if isinstance(value, np.integer):
        return int(value)
    return value


def _numpy_setter(part: Any) -> Callable[[], None]:
    """Validate numpy's part; return what puts it in place (nothing changes before it is called)."""
    part = require_mapping(part, f"RNG {_NUMPY!r}")
    name = part.get(_NP_NAME)
    if name == _MT19937 and _NP_BIT_GENERATOR_STATE not in part:
        return _installer(np.random.MT19937, _mt19937_state(part))
    return _other_bit_generator_setter(part)


def _installer(kind: type, state: Any) -> Callable[[], None]:
    """What puts ``state`` into numpy's global RNG, first giving it a ``kind`` bit generator if it
    runs on another type (the checkpointed run's global generator was a ``kind``)."""

    def install() -> None:
        if type(get_bit_generator()) is not kind:
            set_bit_generator(kind(np.random.SeedSequence(0)))
        np.random.set_state(state)

    return install


def _other_bit_generator_setter(part: Mapping[str, Any]) -> Callable[[], None]:
    """The setter for a non-MT19937 bit generator's state, checked on a scratch generator of its type."""
    for key in _NP_OTHER_FIELDS:
        if key not in part:
            raise ResumeError(f"RNG {_NUMPY!r} state is missing the key {key!r}; got keys {keys_of(part)}")
    name, saved, has_gauss, cached = (part[k] for k in _NP_OTHER_FIELDS)
    current = get_bit_generator()
    kind: Any = type(current) if type(current).__name__ == name else getattr(np.random, str(name), None)
    if not (isinstance(name, str) and isinstance(kind, type) and issubclass(kind, np.random.BitGenerator)):
        raise ResumeError(
            f"RNG state field '{_NUMPY}.{_NP_NAME}' names the numpy bit generator {brief(name)}, which is "
            f"neither numpy's global one ({type(current).__name__}) nor one of numpy.random's; call "
            f"numpy.random.set_bit_generator() with a {brief(name)} instance before restore_rng_state()"
        )
    if not isinstance(saved, Mapping):
        raise _malformed(f"{_NUMPY}.{_NP_BIT_GENERATOR_STATE}", f"a dict (a {name}'s state)", saved)
    if saved.get("bit_generator") != name:
        raise _malformed(f"{_NUMPY}.{_NP_BIT_GENERATOR_STATE}.bit_generator", repr(name), saved.get("bit_generator"))
    if not (is_int(has_gauss) and has_gauss in (0, 1)):
        raise _malformed(f"{_NUMPY}.{_NP_HAS_GAUSS}", "0 or 1", has_gauss)
    if not _is_finite_number(cached):
        raise _malformed(f"{_NUMPY}.{_NP_CACHED_GAUSSIAN}", "a finite float", cached)
    full = {**saved, "has_gauss": has_gauss, "gauss": float(cached)}
    # Loaded into a scratch generator and read back: a value numpy would truncate or reject
    # (a negative word, one past 64 bits, a missing field) shows up as an error or a difference.
    scratch = np.random.RandomState(kind(np.random.SeedSequence(0)))
    try:
        scratch.set_state(full)
        read_back: Any = scratch.get_state(legacy=False)
    except (TypeError, ValueError, OverflowError, KeyError, IndexError) as exc:
        raise ResumeError(
            f"RNG state field '{_NUMPY}.{_NP_BIT_GENERATOR_STATE}' is not a {name} state numpy accepts "
            f"({exc!r}), but got {brief(saved)}; {_REMEDY}"
        ) from exc
    if _plain(read_back) != _plain(full):
        raise _malformed(f"{_NUMPY}.{_NP_BIT_GENERATOR_STATE}", f"a {name} state numpy reads back unchanged", saved)
    return _installer(kind, full)


def _mt19937_state(part: Mapping[str, Any]) -> tuple[str, np.ndarray, int, int, float]:
    """``np.random.set_state``'s legacy tuple, checked and loaded into a scratch RandomState."""
    for key in _NP_FIELDS:
        if key not in part:
            raise ResumeError(f"RNG {_NUMPY!r} state is missing the key {key!r}; got keys {keys_of(part)}")
    name, keys, pos, has_gauss, cached = (part[k] for k in _NP_FIELDS)
    if not (_is_cpu_tensor(keys, torch.int32) and keys.shape == (_MT_WORDS,)):
        raise _malformed(f"{_NUMPY}.{_NP_KEYS}", f"a CPU int32 tensor of shape ({_MT_WORDS},)", keys)
    if not bool(keys.any()):
        raise _malformed(f"{_NUMPY}.{_NP_KEYS}", "a Mersenne Twister state (all zeros is degenerate)", keys)
    # numpy does not range-check pos, and reads out of its key array with a larger one.
    if not (is_int(pos) and 0 <= pos <= _MT_WORDS):
        raise _malformed(f"{_NUMPY}.{_NP_POS}", f"an int in [0, {_MT_WORDS}]", pos)
    if not (is_int(has_gauss) and has_gauss in (0, 1)):
        raise _malformed(f"{_NUMPY}.{_NP_HAS_GAUSS}", "0 or 1", has_gauss)
    if not _is_finite_number(cached):
        raise _malformed(f"{_NUMPY}.{_NP_CACHED_GAUSSIAN}", "a finite float", cached)
    words = keys.detach().contiguous().numpy().view(np.uint32).copy()
    np_state = (name, words, pos, has_gauss, float(cached))
    try:
        np.random.RandomState().set_state(np_state)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ResumeError(f"RNG state for numpy is malformed: {exc}; {_REMEDY}") from exc
    return np_state


def _torch_state(value: Any) -> torch.Tensor:
    """The torch CPU state, validated by loading it into a scratch generator."""
    if not _is_cpu_tensor(value, torch.uint8):
        raise _malformed(_TORCH, "a CPU uint8 tensor from torch.get_rng_state()", value)
    try:
        torch.Generator().set_state(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ResumeError(f"RNG state field {_TORCH!r} is not a torch CPU generator state: {exc}; {_REMEDY}") from exc
    return value


def _cuda_states(value: Any, have: int, strict: bool) -> list[torch.Tensor]:
    """The CUDA states to restore (one per device both have), each validated on a scratch generator."""
    if not (isinstance(value, (list, tuple)) and all(_is_cpu_tensor(s, torch.uint8) and s.dim() == 1 for s in value)):
        raise _malformed(_CUDA, "a list of CPU uint8 tensors from torch.cuda.get_rng_state(i)", value)
    if strict and value and len(value) != have:
        raise ResumeError(
            f"RNG state holds {len(value)} CUDA device states but this machine has {have}; "
            "pass strict=False to restore the devices both have"
        )
    states = list(value[:have])
    for i, cuda_state in enumerate(states):
        try:
            torch.Generator(device=f"cuda:{i}").set_state(cuda_state)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ResumeError(
                f"RNG state field {_CUDA!r} entry {i} is not a CUDA generator state: {exc}; {_REMEDY}"
            ) from exc
    return states
