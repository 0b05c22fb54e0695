"""Pending records of a source state checked in bulk: the same verdicts as the checks entry by entry.

Specification: ``parse_pending`` accepts a list of ``[shard index, offset]`` exactly when every entry
is two plain ints naming an existing shard and an offset read already (below the shard's cursor when
it has one), with no record twice; it then returns the entries as a read-only ``(n, 2)`` int64 array,
in order. Anything else is left (None) to the per-entry loop, which names what it refuses. Likewise
the keys a stage above hands a layout change become records in one array exactly when each is three
plain ints of the state's epoch; a key of another epoch is refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable
from resumable_data.streams.pending import keys_as_records, parse_pending

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
        assert parsed is not None
        assert parsed.dtype == np.int64 and parsed.shape == (len(raw), 2) and not parsed.flags.writeable
        assert parsed.tolist() == [list(entry) for entry in raw]
    else:
        assert parsed is None


EPOCH = 3


def plain_record_of_epoch(key: object) -> bool:
    """The rule for a pending key handed to a source's layout change, one key at a time."""
    if type(key) not in (list, tuple) or len(key) != 3 or any(type(v) is not int for v in key):
        return False
    return key[0] == EPOCH and all(-(2**63) <= v < 2**63 for v in key)


key_values = st.one_of(st.integers(-2, 8), st.just(EPOCH), st.just(2**70), st.booleans(), st.just(1.0))
record_keys = st.one_of(st.tuples(st.just(EPOCH), key_values, key_values), st.lists(key_values, min_size=1, max_size=4))


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(record_keys, max_size=8))
def test_keys_become_records_exactly_when_each_is_three_plain_ints_of_the_epoch(keys: list) -> None:
    records = keys_as_records(keys, EPOCH)
    if all(plain_record_of_epoch(key) for key in keys):
        assert records is not None and not records.flags.writeable
        assert records.tolist() == [[key[1], key[2]] for key in keys]
    else:
        assert records is None


def test_a_layout_change_refuses_a_pending_key_of_another_epoch_naming_it() -> None:
    source = ShardedIterable(["a", "b"], read_shard=lambda shard, start: iter(range(start, 4)), seed=0, sizes=[4, 4])
    state = source.state_dict()
    with pytest.raises(ResumeError, match=r"pending record \[1, 0, 2\] is not a record of epoch 0"):
        source.rebalance([state], 2, [(0, 1, 0), (1, 0, 2)])
    states = source.rebalance([state], 2, [(0, 1, 0), (0, 0, 2)])
    assert [s["pending"] for s in states] == [[[1, 0]], [[0, 2]]]
