"""``skip``: move a map-style data position past a bad stretch, record it, publish a new checkpoint.

After a loss spike, the usual remedy is to go back to a checkpoint before it and skip the batches
that caused it. :func:`skip_state` moves a ``ResumableSampler`` / ``ResumableDataLoader`` state's
position forward by ``batches`` batches (or to a position) and records the stretch it jumps over in
the state (``map.skipped``): the samples there count as consumed — the rest of the epoch is still
dealt exactly once, at any world size — but not read, and ``where`` reports them as skipped. The
stretch must end within the epoch: a skip never crosses into the next one.

:func:`skip` does it to a checkpoint written by :class:`~resumable_data.CheckpointManager`: it reads
``step-N`` as ``inspect`` does, moves its data state, and saves the whole payload, unchanged but for
that state, as ``step-(N+1)`` through the manager's atomic publish (temp folder, fsync, rename), so
:meth:`~resumable_data.CheckpointManager.latest` selects it and ``step-N`` stays byte for byte as it
was: a crash at any moment leaves either no new checkpoint (``step-N`` still the latest) or a
complete one. Nothing is pruned. The training state inside the payload (the step a trainer resumes
at, its learning-rate schedule) is not touched: a trainer resuming from ``step-(N+1)`` continues at
its recorded step N with the moved data. ``skip`` refuses when a checkpoint newer than ``step-N``
exists (``latest()`` would not select the new one): resume from ``step-N`` with the trainer's own
skip instead (the reference trainer's ``--resume step-N --skip-batches K``), or move the newer ones away.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..checkpoint.manager import CheckpointManager
from ..checkpoint.manifest import STEP_RE, step_of
from ..checkpoint.weights_only import load_weights_only
from ..core import state as keys
from ..core.state import check_int_arg
from ..errors import ResumeError
from ..map.skipped import SKIPPED, SKIPPED_STATE_VERSION, add_skipped
from .layout import MapLayout, is_map_state
from .source import find_state

__all__ = ["skip", "skip_state"]


def skip_state(
    state: Mapping[str, Any],
    *,
    batches: int | None = None,
    to_position: int | None = None,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """A copy of a map-style data state moved forward, with the stretch it skips recorded.

    Args:
        state: A ``ResumableSampler`` or ``ResumableDataLoader`` state.
        batches: Skip this many batches (of every rank).
        to_position: Or skip to this global position of the epoch (at most its length).
        batch_size: For a sampler's state, which has none.

    Returns:
        The moved state (version 4, with ``"skipped"``); ``state`` is not changed.

    Raises:
        ResumeError: the skip would go past the epoch's end or backwards, the epoch is already
            over, or the state cannot be moved (a stream's); the message says what to do instead.

    Example:
        >>> from resumable_data import ResumableDataLoader
        >>> loader = ResumableDataLoader(list(range(10)), batch_size=2, seed=0)
        >>> moved = skip_state(loader.state_dict(), batches=2)
        >>> moved["position"], moved["skipped"]
        (4, [[0, 4]])
    """
    if (batches is None) == (to_position is None):
        raise ResumeError("give one of batches and to_position")
    if not is_map_state(state):
        raise ResumeError(
            "cannot move a stream's data state (StreamLoader, ShardedIterable): its position lives in "
            "per-worker slot states (a shuffle buffer's contents mid-epoch, shard cursors) that no arithmetic "
            "moves; to leave out a bad stretch, resume from this checkpoint and drop those records with "
            ".filter(...) on the stream, or let the run reach the end of the epoch"
        )
    layout = MapLayout.parse(state, batch_size=batch_size)
    epoch, start, sampler = layout.epoch, layout.position, layout.samplers[0]
    if layout.done():
        raise ResumeError(
            f"epoch {epoch} is already over (position {start} of {layout.epoch_length(epoch)}): a skip ends within "
            "the epoch; skip from a checkpoint of the next epoch"
        )
    batcher = layout.batcher(0)
    left = batcher.batch_count(epoch, start)
    if batches is not None:
        check_int_arg("batches", batches, minimum=1)
        if batches > left:
            raise ResumeError(
                f"batches: skipping {batches} batches goes past the end of epoch {epoch}, which has {left} left "
                f"(positions {start}..{layout.epoch_length(epoch) - 1}); skip at most {left}"
            )
        end = batcher.position_after(epoch, start, batches)
    else:
        length = layout.epoch_length(epoch)
        end = check_int_arg("to_position", to_position, minimum=0)
        if not start < end <= length:
            raise ResumeError(
                f"to_position should be after the state's position {start} and at most epoch {epoch}'s length "
                f"{length}, but got to_position={end}"
            )
        end = sampler.end_position(epoch, start) if end == length else end
    moved = dict(state)
    moved[keys.VERSION] = SKIPPED_STATE_VERSION
    moved[keys.POSITION] = end
    moved[SKIPPED] = [list(pair) for pair in add_skipped(layout.skipped, start, end)]
    MapLayout.parse(moved, batch_size=batch_size)  # the moved state must load as it is
    return moved


def skip(
    checkpoint: str | os.PathLike[str],
    *,
    batches: int | None = None,
    to_position: int | None = None,
    batch_size: int | None = None,
    key: str | None = None,
) -> Path:
    """Publish ``step-(N+1)``: checkpoint ``step-N`` with its data position moved (see the module docstring).

    Args:
        checkpoint: A ``step-N`` folder of a :class:`~resumable_data.CheckpointManager` run folder,
            or its ``state.pt``.
        batches: Skip this many batches.
        to_position: Or skip to this global position of the epoch.
        batch_size: For a sampler's state, which has none.
        key: Which data state, when the checkpoint holds several (the key path ``inspect`` prints).

    Returns:
        The new checkpoint folder.

    Raises:
        ResumeError: a bad checkpoint or skip, a newer checkpoint exists, or another process holds
            the run folder's lock (:class:`~resumable_data.checkpoint.CheckpointLockedError`).
        OSError: the write failed; the run folder is as it was.
    """
    found = find_state(checkpoint, key)
    report = found.report
    if report is None or report.manifest is None or not STEP_RE.match(report.payload.parent.name):
        raise ResumeError(
            f"{checkpoint}: skip publishes a new checkpoint beside the old one in its run folder: pass a "
            "CheckpointManager step-N folder (or its state.pt)"
        )
    moved = skip_state(found.state, batches=batches, to_position=to_position, batch_size=batch_size)
    folder = report.payload.parent
    step = report.manifest.step
    payload = load_weights_only(report.payload)
    with CheckpointManager(folder.parent, keep_last=2 + len(os.listdir(folder.parent)), keep_best=True) as manager:
        newer = [path.name for path in manager.checkpoints() if step_of(path) > step]
        if newer:
            raise ResumeError(
                f"{folder.name} is not the newest checkpoint ({', '.join(newer)} came after it), so latest() would "
                f"not select a skipped copy of it: resume from {folder.name} with your trainer's skip (the "
                "reference trainer: --resume step-N --skip-batches K), or move the newer checkpoints away first"
            )
        return manager.save(step + 1, _replaced(payload, found.key, moved))


def _replaced(payload: Any, key: str, state: dict[str, Any]) -> Any:
    """``payload`` with the data state at key path ``key`` (as ``inspect`` names it) replaced by ``state``."""
    if key == "<root>":
        return state
    parts = key.split("/")[1:]
    node = payload
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = state
    else:
        node[last] = state
    return payload
