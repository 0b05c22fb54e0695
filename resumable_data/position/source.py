"""Which data state a question is about: a state dict given directly, or the one in a checkpoint.

A checkpoint is read exactly as ``python -m resumable_data inspect`` reads it
(:func:`~resumable_data.checkpoint.inspect.inspect_checkpoint`: verified against its manifest, loaded
``weights_only``), and its data states are the ones ``inspect`` lists, by key path (``/dataloader``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..checkpoint.inspect import DcpReport, Report, inspect_checkpoint
from ..checkpoint.weights_only import load_weights_only
from ..core.state import EPOCH, VERSION
from ..errors import ResumeError
from ..streams.loader_state import NUM_WORKERS, SLOTS
from .layout import STREAM_STATES, is_map_state

__all__ = ["Found", "Source", "find_state", "find_stream_state"]

Source = Mapping[str, Any] | str | os.PathLike[str]
_STREAM_KEYS = {VERSION, EPOCH, SLOTS, NUM_WORKERS}  # what every StreamLoader state holds


@dataclass(frozen=True)
class Found:
    """A data state and where it was found.

    Attributes:
        state: The data state.
        key: Its key path in the checkpoint (``/dataloader``), or ``<root>``.
        report: The checkpoint's ``inspect`` report, when it came from a checkpoint.
    """

    state: Mapping[str, Any]
    key: str
    report: Report | None = None


def find_stream_state(source: Source, key: str | None = None) -> Found:
    """The StreamLoader state of ``source``: itself when it is a state dict, else the checkpoint's.

    A checkpoint's payload is verified and loaded as ``inspect`` does; its StreamLoader states are
    the dicts with ``version``, ``epoch``, ``slots`` and ``num_workers``, by key path.

    Raises:
        ResumeError: the checkpoint is bad, holds no StreamLoader state, or several and ``key`` names none.
    """
    if isinstance(source, Mapping):
        return Found(source, "<root>")
    report = _report(source)
    states = dict(_stream_states(load_weights_only(report.payload)))
    if key is not None:
        if key not in states:
            raise ResumeError(
                f"--state {key}: not a StreamLoader state of {source}; it has {', '.join(states) or 'none'}"
            )
        return Found(states[key], key, report)
    if len(states) != 1:
        which = f"several ({', '.join(states)}): pick one with --state" if states else "none"
        raise ResumeError(
            f"{source}: StreamLoader states (a dict with version, epoch, slots, num_workers) found: {which}"
        )
    (path, state), *_ = states.items()
    return Found(state, path, report)


def _stream_states(payload: Any) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every StreamLoader state in ``payload``, by key path, without recursion (a payload may nest deeply)."""
    stack: list[tuple[str, Any]] = [("", payload)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, Mapping):
            if node.keys() >= _STREAM_KEYS:
                yield path or "<root>", node
                continue
            stack.extend((f"{path}/{name}", value) for name, value in node.items())


def _report(source: str | os.PathLike[str]) -> Report:
    report = inspect_checkpoint(source)
    if isinstance(report, DcpReport):
        raise ResumeError(
            f"{source}: a DCP checkpoint keeps its data state in DCP's own files, which are never loaded here "
            "(they unpickle); pass a checkpoint written by CheckpointManager, or the data state itself"
        )
    return report


def find_state(source: Source, key: str | None = None) -> Found:
    """The data state of ``source``: itself when it is a state dict, else the checkpoint's.

    Args:
        source: A state dict, or a checkpoint path as ``inspect`` takes it.
        key: Which of the checkpoint's data states (a key path ``inspect`` prints); needed only when
            it holds more than one map-style state.

    Raises:
        ResumeError: the checkpoint is bad, holds no data state, or several and ``key`` names none.
    """
    if isinstance(source, Mapping):
        return Found(source, "<root>")
    report = _report(source)
    states = report.data_states
    if key is not None:
        if key not in states:
            raise ResumeError(f"--state {key}: not a data state of {source}; it has {', '.join(states) or 'none'}")
        return Found(states[key], key, report)
    candidates = {path: state for path, state in states.items() if is_map_state(state)}
    if not candidates and next(_stream_states(load_weights_only(report.payload)), None) is not None:
        raise ResumeError(f"{source}: its data state is a StreamLoader's, without a map-style one; {STREAM_STATES}")
    candidates = candidates or states
    if not candidates:
        raise ResumeError(
            f"{source}: no map-style data state found (a ResumableSampler or ResumableDataLoader state: a dict with "
            f"version, epoch, position, dataset_length, ...); {STREAM_STATES}"
        )
    if len(candidates) > 1:
        raise ResumeError(f"{source} holds several data states ({', '.join(candidates)}): pick one with --state")
    (path, state), *_ = candidates.items()
    return Found(state, path, report)
