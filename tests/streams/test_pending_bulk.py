"""Pending records of a source state checked in bulk: the same verdicts as the checks entry by entry.

Specification: ``parse_pending`` accepts a list of ``[shard index, offset]`` exactly when every entry
is two plain ints naming an existing shard and an offset read already (below the shard's cursor when
it has one), with no record twice; it then returns the entries as lists, in order. Anything else is
left (None) to the per-entry loop, which names what it refuses.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_data.streams.pending import parse_pending

NO_CURSOR = -1
NUM_SHARDS = 4
CURSORS = np.array([NO_CURSOR, 3, 0, 5], dtype=np.int64)  # shard 0 finished, shard 2 not begun


def acceptable(raw: list) -> bool:
    """The rules, one entry at a time."""
    seen = set()
    for entry in raw:
        if type(entry) not in (list, tuple) or len(entry) != 2 or any(type(v) is not int for v in entry):
            return False
        index, offset = entry
        if not 0 <= index < NUM_SHARDS or not 0 <= offset < 2**63:
            return False
        if CURSORS[index] != NO_CURSOR and offset >= CURSORS[index]:
            return False
        if (index, offset) in seen:
            return False
        seen.add((index, offset))
    return True


values = st.one_of(st.integers(-2, 8), st.just(2**70), st.booleans(), st.just(1.0))
entries = st.one_of(st.lists(values, min_size=1, max_size=3), st.tuples(values, values))


@settings(max_examples=300, deadline=None)
@given(raw=st.lists(entries, max_size=8))
def test_accepts_exactly_what_the_entry_by_entry_checks_accept(raw: list) -> None:
    parsed = parse_pending(raw, NUM_SHARDS, CURSORS, NO_CURSOR)
    if acceptable(raw):
        assert parsed == [list(entry) for entry in raw]
        assert all(type(v) is int for entry in parsed for v in entry)
    else:
        assert parsed is None
