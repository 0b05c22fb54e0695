"""``skip``: move a data position past a bad stretch, record it, publish a new checkpoint.

After a loss spike, the usual remedy is to go back to a checkpoint before it and skip the batches
that caused it. :func:`skip_state` moves a ``ResumableSampler`` / ``ResumableDataLoader`` state's
position forward by ``batches`` batches (or to a position) and records the stretch it jumps over in
the state (``map.skipped``): the samples there count as consumed — the rest of the epoch is still
dealt exactly once, at any world size — but not read, and ``where`` reports them as skipped. The
stretch must end within the epoch: a skip never crosses into the next one.

:func:`skip_stream_state` does the same to a ``StreamLoader`` state, given the pipeline the loader
was built over (a state holds per-slot positions, not the pipeline): every rank it holds moves on by
``batches`` of its own batches, each slot standing where the uninterrupted run's slot stands after
them (:meth:`Stream.epoch_positions <resumable_data.streams.Stream.epoch_positions>`, its shards'
identities taken as reading leaves them) with its batch count moved on (so the global RNG seeds of
the batches after the stretch are the uninterrupted run's), and records the rank's skipped batch
numbers (``streams.skipped``). It moves a pipeline whose order follows from positions (a
ShardedIterable with known sizes, behind ``map`` and ``shuffle_window``) in an epoch that did not
change layout; a shuffle buffer's contents, a filter's or a mix's choices follow from the records
read, and no arithmetic moves them: those are refused, saying what to do instead.

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
from ..core.ranges import add_range
from ..core.state import check_int_arg
from ..errors import ResumeError
from ..map.skipped import SKIPPED, SKIPPED_STATE_VERSION
from ..streams.base import Stream
from ..streams.loader_state import BATCHES, NEXT_WORKER, SLOTS
from ..streams.skipped import SKIPPED_LOADER_VERSION
from .layout import STREAM_STATES, MapLayout, is_map_state
from .source import find_state, find_stream_state
from .stream_state import LoaderState, RankEpoch, batched_pipeline

__all__ = ["ends_a_skip", "skip", "skip_state", "skip_stream_state"]


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
        raise ResumeError(f"cannot move this state as a map-style one: {STREAM_STATES}")
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
    moved[SKIPPED] = [list(pair) for pair in add_range(layout.skipped, start, end)]
    MapLayout.parse(moved, batch_size=batch_size)  # the moved state must load as it is
    return moved


def skip_stream_state(
    state: Mapping[str, Any],
    pipeline: Stream,
    *,
    batches: int,
    batch_size: int | None = None,
    drop_last: bool = False,
) -> dict[str, Any]:
    """A copy of a StreamLoader state moved on by ``batches`` batches of every rank it holds, the
    skipped batches recorded (see the module docstring).

    Args:
        state: A ``StreamLoader`` state (one rank's, or ``merge_states`` of all ranks').
        pipeline: The stream the loader was built over, built as the training script builds it,
            not started (as ``where_stream`` takes it).
        batches: Skip this many batches of each rank, within the epoch.
        batch_size: The loader's ``batch_size`` (unless the pipeline ends in ``.batch(n)``).
        drop_last: The loader's ``drop_last``.

    Returns:
        The moved state (version 2, with ``"skipped"``); ``state`` is not changed.

    Raises:
        ResumeError: the skip goes past a rank's end of the epoch, the epoch is over, or the state
            cannot be moved (a shuffle buffer, filter or mix; an epoch whose layout changed); the
            message says what to do instead.

    Example:
        >>> from resumable_data.streams import ShardedIterable, StreamLoader
        >>> def pipeline():
        ...     read = lambda shard, start: iter(range(10 * int(shard[1:]) + start, 10 * int(shard[1:]) + 4))
        ...     return ShardedIterable(["s0", "s1"], read_shard=read, seed=0, sizes=[4, 4]).shuffle_window(3)
        >>> loader = StreamLoader(pipeline(), batch_size=2)
        >>> moved = skip_stream_state(loader.state_dict(), pipeline(), batches=2, batch_size=2)
        >>> moved["batches"], moved["skipped"]
        ({'0': 2}, {'0': [[0, 2]]})
        >>> resumed = StreamLoader(pipeline(), batch_size=2)
        >>> resumed.load_state_dict(moved)
        >>> [batch.tolist() for batch in resumed] == [batch.tolist() for batch in loader][2:]
        True
    """
    count = check_int_arg("batches", batches, minimum=1)
    batched = batched_pipeline(pipeline, batch_size, drop_last)
    layout = LoaderState.parse(state)
    if layout.epoch_done:
        raise ResumeError(
            f"epoch {layout.epoch} is already over: a skip ends within the epoch; skip from a checkpoint of the next epoch"
        )
    epochs = [RankEpoch(layout, batched, rank, layout.epoch, command="skip") for rank in layout.ranks(None)]
    short = min(epochs, key=lambda here: here.dealing.total - here.done)
    left = short.dealing.total - short.done
    if count > left:
        raise ResumeError(
            f"batches: skipping {count} batches goes past the end of epoch {layout.epoch} for rank {short.rank}, "
            f"which has {left} of its {short.dealing.total} left; skip at most {left}"
        )
    moved = {**state, keys.VERSION: SKIPPED_LOADER_VERSION}
    moved[SLOTS], moved[BATCHES] = dict(state[SLOTS]), dict(state[BATCHES])
    moved[NEXT_WORKER], moved[SKIPPED] = dict(state[NEXT_WORKER]), {}
    for here in epochs:
        end = here.done + count
        taken = here.dealing.taken(end)
        for local, g in enumerate(here.slots):
            here.prepare(local)
            here.positions[local].start_at(min(taken[local] * batched.batch_size, here.positions[local].length))
            moved[SLOTS][str(g)] = batched.state_dict()
            moved[BATCHES][str(g)] = taken[local]
        moved[NEXT_WORKER][str(here.rank)] = here.dealing.next_worker(end)
        moved[SKIPPED][str(here.rank)] = [list(pair) for pair in add_range(layout.skipped(here.rank), here.done, end)]
    for here in epochs:  # the moved state must load as it is
        RankEpoch(LoaderState.parse(moved), batched, here.rank, layout.epoch, command="skip")
    return moved


def ends_a_skip(state: Mapping[str, Any]) -> bool:
    """Whether a data state stands right after a skipped stretch (of every rank it holds, for a stream's).

    A resume check that compares the next batch with the one the checkpoint logged (the reference
    trainer's audit) must not after a skip: the batch it logged is one the skip moved past.

    Example:
        >>> from resumable_data import ResumableDataLoader
        >>> state = ResumableDataLoader(list(range(10)), batch_size=2, seed=0).state_dict()
        >>> ends_a_skip(state), ends_a_skip(skip_state(state, batches=2))
        (False, True)
    """
    skipped = state.get(SKIPPED)
    if not skipped:
        return False
    if is_map_state(state):
        return bool(skipped[-1][1] == state[keys.POSITION])
    layout = LoaderState.parse(state)
    return all(
        (ranges := layout.skipped(rank)) and ranges[-1][1] == sum(layout.yielded(rank)) for rank in layout.ranks(None)
    )


def skip(
    checkpoint: str | os.PathLike[str],
    *,
    batches: int | None = None,
    to_position: int | None = None,
    batch_size: int | None = None,
    key: str | None = None,
    pipeline: Stream | None = None,
    drop_last: bool = False,
) -> Path:
    """Publish ``step-(N+1)``: checkpoint ``step-N`` with its data position moved (see the module docstring).

    Args:
        checkpoint: A ``step-N`` folder of a :class:`~resumable_data.CheckpointManager` run folder,
            or its ``state.pt``.
        batches: Skip this many batches.
        to_position: Or skip to this global position of the epoch.
        batch_size: For a sampler's state, which has none.
        key: Which data state, when the checkpoint holds several (the key path ``inspect`` prints).
        pipeline: For a ``StreamLoader`` state: the stream the loader was built over (see
            :func:`skip_stream_state`); ``batch_size`` is then the loader's.
        drop_last: With ``pipeline``: the loader's ``drop_last``.

    Returns:
        The new checkpoint folder.

    Raises:
        ResumeError: a bad checkpoint or skip, a newer checkpoint exists, or another process holds
            the run folder's lock (:class:`~resumable_data.checkpoint.CheckpointLockedError`).
        OSError: the write failed; the run folder is as it was.
    """
    if pipeline is not None and to_position is not None:
        raise ResumeError("to_position: a stream's state has no global position; skip a number of batches")
    found = find_state(checkpoint, key) if pipeline is None else find_stream_state(checkpoint, key)
    report = found.report
    if report is None or report.manifest is None or not STEP_RE.match(report.payload.parent.name):
        raise ResumeError(
            f"{checkpoint}: skip publishes a new checkpoint beside the old one in its run folder: pass a "
            "CheckpointManager step-N folder (or its state.pt)"
        )
    if pipeline is None:
        moved = skip_state(found.state, batches=batches, to_position=to_position, batch_size=batch_size)
    else:
        if batches is None:
            raise ResumeError("batches: give the number of batches to skip")
        moved = skip_stream_state(found.state, pipeline, batches=batches, batch_size=batch_size, drop_last=drop_last)
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
