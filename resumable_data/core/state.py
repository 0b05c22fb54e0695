"""State conventions shared by every resumable object: the keys, their checks, a safe short repr.

Every state dict the library produces is plain data (ints, floats, bools, strings, lists, dicts;
tensors only where they must be) so it round-trips through ``json.dumps`` and
``torch.load(..., weights_only=True)``. Every top-level state carries a ``"version"`` that
``load_state_dict`` checks before touching anything.
"""

from __future__ import annotations

import itertools
import math
import reprlib
import struct
from collections.abc import Mapping
from typing import Any, TypeGuard

from ..errors import ResumeError

# Keys of the sampler / loader state, declared once.
VERSION = "version"
EPOCH = "epoch"
POSITION = "position"
DATASET_LENGTH = "dataset_length"
SEED = "seed"
SHUFFLE = "shuffle"
WORLD_SIZE = "world_size"
DROP_LAST = "drop_last"
BATCH_SIZE = "batch_size"
EPOCH_LENGTHS = "epoch_lengths"  # the lengths the epoch's order was built over, when it grew (core.growth)


def is_int(value: Any) -> TypeGuard[int]:
    """Whether untrusted ``value`` is an int proper (a bool is an int to python, not to a state)."""
    return isinstance(value, int) and not isinstance(value, bool)


def require_mapping(state: Any, what: str) -> Mapping[str, Any]:
    """Return ``state`` if it is a mapping, else raise a ResumeError naming ``what``."""
    if not isinstance(state, Mapping):
        raise ResumeError(f"{what} state must be a dict, but got {type(state).__name__}")
    return state


class _Brief(reprlib.Repr):
    """``repr`` bounded in depth, length and digits: a hostile state must not crash its own error."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, 80, 80, 40

    def repr_float(self, x: float, level: int) -> str:
        if math.isnan(x):  # NaNs differ only in their bits, which a comparison must show
            return f"nan (bits {struct.pack('>d', x).hex()})"
        return repr(x)

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:  # repr() itself refuses ints of more than 4300 digits
            return f"<int of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_BRIEF = _Brief()


def brief(value: Any) -> str:
    """A short ``repr`` of untrusted state data, safe for error messages (any nesting, any size)."""
    return _BRIEF.repr(value)


def keys_of(state: Mapping[Any, Any]) -> str:
    """The (first 20) keys of an untrusted mapping, for an error message; keys may be of any type."""
    names = sorted(brief(key) for key in itertools.islice(state, 20))
    return "[" + ", ".join(names) + (", ...]" if len(state) > 20 else "]")


INT64_MAX = 2**63 - 1
"""The largest epoch, position, length or size a state may hold: no real run comes near it, and a
bound keeps a hostile state from carrying ints that break ``json.dumps`` or error messages."""


def require_int(
    state: Mapping[str, Any], key: str, what: str, *, minimum: int | None = None, maximum: int = INT64_MAX
) -> int:
    """Read ``state[key]`` as an int (bools refused), at least ``minimum`` and at most ``maximum``."""
    if key not in state:
        raise ResumeError(f"{what} state is missing the key {key!r}; got keys {keys_of(state)}")
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ResumeError(f"{what} state field {key!r} must be an int, but got {brief(value)}")
    if minimum is not None and value < minimum:
        raise ResumeError(f"{what} state field {key!r} must be >= {minimum}, but got {brief(value)}")
    if value > maximum:
        bound = "2**63 - 1" if maximum == INT64_MAX else str(maximum)
        raise ResumeError(f"{what} state field {key!r} must be at most {bound}, but got {brief(value)}")
    return value


def require_bool(state: Mapping[str, Any], key: str, what: str) -> bool:
    """Read ``state[key]`` as a bool."""
    if key not in state:
        raise ResumeError(f"{what} state is missing the key {key!r}; got keys {keys_of(state)}")
    value = state[key]
    if not isinstance(value, bool):
        raise ResumeError(f"{what} state field {key!r} must be a bool, but got {brief(value)}")
    return value


def check_version(state: Mapping[str, Any], expected: int, what: str) -> None:
    """Refuse a state written by an incompatible version of ``what``."""
    version = require_int(state, VERSION, what)
    if version != expected:
        raise ResumeError(
            f"{what} state has version {brief(version)}, but this resumable_data reads version {expected}; "
            f"load the checkpoint with the resumable_data release that wrote it"
        )


def check_int_arg(name: str, value: Any, *, minimum: int) -> int:
    """Validate a constructor argument the way PyTorch's samplers word it, as a ResumeError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ResumeError(f"{name} should be an integer >= {minimum}, but got {name}={brief(value)}")
    return value
