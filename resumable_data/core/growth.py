"""Growing data: what a restore does when the dataset (or shard list) has grown since the checkpoint.

An epoch's order is a function of what it was built over. When a checkpoint is loaded into a
loader whose data has grown (samples or shards appended), the policy says what happens to the new
items; it is a constructor argument, so the choice is made where the data is, and the default
refuses, as before:

* ``"error"``: refuse, naming both sizes and the other policies.
* ``"next_epoch"``: the restored epoch finishes over what the checkpoint's epoch was built over,
  in the checkpoint's order, exactly once; the next epoch's order covers the whole grown data.
* ``"append"``: the rest of the restored epoch is the rest of its order followed by a keyed
  shuffle of the new items only (a new *piece*, see
  :class:`~resumable_data.core.permutation.PiecewisePermutation`), so every unconsumed old item
  and every new item come once in this epoch. An exhausted epoch stays exhausted: the new items
  join at the next epoch.

Data that shrank (or whose old items changed place) is always refused: the positions already
consumed would no longer name the same items. The state records the piece ends of the current
epoch's order (``[L0]``, or ``[L0, L1, ...]`` after an ``"append"``), so a checkpoint taken after a
growth loads again exactly, and into data that has grown once more.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from ..errors import ResumeError
from .state import INT64_MAX, brief, is_int

__all__ = ["APPEND", "ERROR", "GROWTH_POLICIES", "NEXT_EPOCH", "check_growth", "grown_pieces", "require_pieces"]

ERROR = "error"
NEXT_EPOCH = "next_epoch"
APPEND = "append"
GROWTH_POLICIES = (ERROR, NEXT_EPOCH, APPEND)


def check_growth(growth: Any) -> str:
    """Validate a ``growth=`` argument."""
    if growth not in GROWTH_POLICIES:
        raise ResumeError(
            f"growth should be one of {', '.join(map(repr, GROWTH_POLICIES))}, but got growth={brief(growth)}"
        )
    return str(growth)


def require_pieces(state: Mapping[str, Any], key: str, what: str, *, at_most: int) -> tuple[int, ...]:
    """Read a list of piece ends: ints, strictly ascending, the first >= 1 and the last <= ``at_most``."""
    if key not in state:
        raise ResumeError(f"{what} state is missing the key {key!r} (the lengths its epoch's order was built over)")
    raw = state[key]
    if (
        not isinstance(raw, (list, tuple))
        or not raw
        or not all(is_int(v) and 1 <= v <= INT64_MAX for v in raw)
        or any(b <= a for a, b in itertools.pairwise(raw))
        or raw[-1] > at_most
    ):
        raise ResumeError(
            f"{what} state field {key!r} must be a non-empty list of strictly ascending ints >= 1, at most "
            f"{at_most} (the size the checkpoint was taken with), but got {brief(raw)}; pass a state_dict() unchanged"
        )
    return tuple(int(v) for v in raw)


def grown_pieces(growth: str, pieces: tuple[int, ...], current: int, *, exhausted: bool) -> tuple[int, ...]:
    """The piece ends of the restored epoch's order once the data has grown to ``current`` items.

    ``growth`` is ``"next_epoch"`` or ``"append"``; ``exhausted`` says the restored epoch was over.
    """
    if growth == APPEND and not exhausted and current > pieces[-1]:
        return (*pieces, current)
    return pieces
