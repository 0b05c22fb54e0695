"""A StreamLoader state's fields, and one state merged from every rank's (see :mod:`.loader`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..core.state import EPOCH, VERSION, WORLD_SIZE, brief, require_bool, require_int, require_mapping
from ..errors import ResumeError
from .base import position_keys
from .ledger import slot_states
from .skipped import PLAIN_LOADER_VERSION, SKIPPED, check_loader_version, skipped_by_rank

__all__ = [
    "BATCHES",
    "EPOCH_DONE",
    "LOADER_STATE_VERSION",
    "NEXT_WORKER",
    "NUM_WORKERS",
    "SLOTS",
    "merge_loader_states",
    "pipeline_fields",
]

_WHAT = "StreamLoader"
LOADER_STATE_VERSION = PLAIN_LOADER_VERSION  # 2 with skipped batches (streams.skipped)
EPOCH_DONE = "epoch_done"
NUM_WORKERS = "num_workers"
NEXT_WORKER = "next_worker"
SLOTS = "slots"
BATCHES = "batches"  # batches each slot has yielded in the epoch: what seeds the global RNGs for the next


def merge_loader_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """:meth:`StreamLoader.merge_states <resumable_data.streams.StreamLoader.merge_states>`."""
    if not isinstance(states, Sequence) or not states:
        raise ResumeError(f"merge_states needs a non-empty list of states, but got {brief(states)}")
    first = require_mapping(states[0], _WHAT)
    merged: dict[str, Any] = {**first, EPOCH_DONE: True, NEXT_WORKER: {}, SLOTS: {}, BATCHES: {}, SKIPPED: {}}
    version = PLAIN_LOADER_VERSION
    for state in states:
        state = require_mapping(state, _WHAT)
        version = max(version, check_loader_version(state, _WHAT))
        for key in (EPOCH, WORLD_SIZE, NUM_WORKERS):
            value = require_int(state, key, _WHAT, minimum=0)
            if value != first.get(key):
                raise ResumeError(
                    f"cannot merge states with different {key!r}: {brief(first.get(key))} and {brief(value)}"
                )
        slots = require_mapping(state.get(SLOTS), f"{_WHAT} {SLOTS!r}")
        overlap = set(merged[SLOTS]) & set(slots)
        if overlap:
            raise ResumeError(f"cannot merge states that both hold slots {sorted(map(brief, overlap))[:20]}")
        merged[SLOTS].update(slots)
        merged[NEXT_WORKER].update(require_mapping(state.get(NEXT_WORKER), f"{_WHAT} {NEXT_WORKER!r}"))
        merged[BATCHES].update(require_mapping(state.get(BATCHES, {}), f"{_WHAT} {BATCHES!r}"))
        merged[SKIPPED].update(skipped_by_rank(state, _WHAT))
        merged[EPOCH_DONE] = merged[EPOCH_DONE] and require_bool(state, EPOCH_DONE, _WHAT)
    _check_same_pipeline(slot_states(merged, SLOTS, _max_slots(merged), _WHAT), max(1, merged[NUM_WORKERS]))
    merged[VERSION] = version
    if version == PLAIN_LOADER_VERSION:
        del merged[SKIPPED]
    return merged


def _max_slots(state: Mapping[str, Any]) -> int:
    return require_int(state, WORLD_SIZE, _WHAT, minimum=1) * max(1, require_int(state, NUM_WORKERS, _WHAT, minimum=0))


def pipeline_fields(state: Any, path: str = "", positions: frozenset[str] | None = None) -> dict[str, Any]:
    """What a pipeline state says the pipeline is: ``{"source.seed": 0, ...}``, positions left out.

    A position is a field that a stage declares in its :attr:`Stream.POSITION_KEYS` (``positions``:
    all of them, :func:`position_keys`); every other field says what the pipeline is (seeds, shard
    list, sizes, weights, the number of slots), which all ranks must agree on.
    """
    positions = position_keys() if positions is None else positions
    fields: dict[str, Any] = {}
    if isinstance(state, Mapping):
        for key, value in state.items():
            if key not in positions:
                fields.update(pipeline_fields(value, f"{path}.{key}" if path else str(key), positions))
    elif isinstance(state, list) and any(isinstance(item, Mapping) for item in state):  # mix's sources
        for i, item in enumerate(state):
            fields.update(pipeline_fields(item, f"{path}[{i}]", positions))
    else:
        fields[path] = state
    return fields


def _check_same_pipeline(slots: Mapping[int, Any], local: int) -> None:
    """Refuse slot states of ranks whose pipelines were built differently (seed, shards, sizes...).

    Each slot is read with its own rank's pipeline arguments: merged, slots of differently built
    pipelines would read some records twice and others never.
    """
    order = sorted(slots)
    positions = position_keys()
    reference = pipeline_fields(slots[order[0]], positions=positions)
    for g in order[1:]:
        fields = pipeline_fields(slots[g], positions=positions)
        if fields != reference:
            differ = sorted(
                k for k in set(fields) | set(reference) if fields.get(k, "<absent>") != reference.get(k, "<absent>")
            )
            detail = "; ".join(
                f"{k}: {brief(reference.get(k, '<absent>'))} vs {brief(fields.get(k, '<absent>'))}" for k in differ[:5]
            )
            raise ResumeError(
                f"cannot merge the states of rank {order[0] // local} (slot {order[0]}) and rank {g // local} "
                f"(slot {g}): their pipelines were built differently ({detail}); merged, some records would be "
                "read twice and others never. Build the pipeline with the same arguments (seeds, shard list, "
                "buffer sizes, weights) on every rank"
            )
