"""One data state for all ranks, and a ``Stateful`` for ``torch.distributed.checkpoint`` (DCP).

Why a global state. A checkpoint of a data-parallel job must resume on every rank, possibly with
a different number of ranks. :class:`~resumable_data.ResumableDataLoader` counts positions
globally, so every rank's state is already the same; :func:`global_state` proves it with one
small collective (a digest of each rank's state) and refuses ranks that disagree — it never
averages or picks one. :class:`~resumable_data.StreamLoader` holds only its own rank's slots, so
:func:`global_state` gathers every rank's state and merges them
(:meth:`~resumable_data.StreamLoader.merge_states`); the merged state resumes at any world size.

Why fixed keys. DCP writes each key once across ranks (identical keys are deduplicated: a value
that differs per rank is silently replaced by one rank's copy), and a load at another world size
needs exactly the keys it saved: a state keyed by rank (``dp_rank_3``) fails with "Missing key".
:class:`DataLoaderState` therefore writes the global state as one JSON string under fixed keys,
the same on every rank and at every world size::

    >>> from resumable_data import ResumableDataLoader
    >>> loader = ResumableDataLoader(torch.arange(10), batch_size=4, seed=0)
    >>> state = DataLoaderState(loader).state_dict()  # without a process group: this process's state
    >>> sorted(state), state["version"], json.loads(state["state_json"]) == loader.state_dict()
    (['state_json', 'version'], 1, True)

Trust. DCP stores non-tensor values with ``torch.save`` and loads them with full unpickling
(``weights_only=False``), and it reads its ``.metadata`` file with ``pickle``. A DCP checkpoint can
therefore run code when loaded: load only checkpoints you wrote. The JSON string adds no risk of
its own (it is parsed with ``json.loads``), but it cannot remove DCP's.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .core import state as keys
from .core.dist import distributed_defaults
from .core.state import check_version, require_mapping
from .errors import ResumeError, Stateful
from .streams import StreamLoader

__all__ = [
    "DataLoaderState",
    "check_world_size",
    "dcp_errors",
    "decide_on_rank_zero",
    "fail_together",
    "global_state",
    "require_agreement",
]

T = TypeVar("T")

DATA_STATE_VERSION = 1
STATE_JSON = "state_json"
_WHAT = "DataLoaderState"
# Under this many free bytes a failed write is most likely a full disk (a DCP shard is larger).
_NEARLY_FULL = 1 << 20


def _digest(state: Any) -> int:
    """A 62-bit digest of a JSON-able state (key order does not matter)."""
    text = json.dumps(state, sort_keys=True, default=repr)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    # NCCL reduces only CUDA tensors; gloo (and the others) CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def decide_on_rank_zero(choose: Callable[[], T]) -> T:
    """Run ``choose`` on rank 0 only and give every rank its result, or its failure (a collective).

    What must be decided once for the whole job (which checkpoint to resume from, taking the run
    folder's lock) is decided by rank 0: ranks that each looked for themselves could disagree (a save
    can land between two look-ups). When ``choose`` raises, every other rank raises too, instead of
    waiting in the next collective until its timeout. Without a process group it just calls ``choose``.

    Args:
        choose: what rank 0 runs; its result must be picklable (``broadcast_object_list``).

    Returns:
        ``choose()``'s result, on every rank.

    Raises:
        Exception: on rank 0, whatever ``choose`` raised; on the others a :class:`ResumeError`
            ``"rank 0 stopped the job: <its message>"``.

    Example::

        path = decide_on_rank_zero(lambda: choose_checkpoint(manager, "auto"))
    """
    if not (dist.is_available() and dist.is_initialized()):
        return choose()
    box: list[Any] = [None]
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", choose())
        except Exception as e:  # re-raised below, after the others have been told
            failure, box[0] = e, ("error", str(e))
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if box[0][0] == "error":
        raise ResumeError(f"rank 0 stopped the job: {box[0][1]}")
    return box[0][1]


def fail_together(what: str, attempt: Callable[[], T]) -> T:
    """Run ``attempt`` on every rank; if it fails on any rank, raise on every rank (a collective: call it on all).

    For a step that every rank does on its own and that all must survive, such as reading its copy
    of a checkpoint: a rank that failed alone would leave the others waiting in a later collective
    until its timeout.

    Args:
        what: the step, for the message (``"reading checkpoint runs/a/step-00000040"``).
        attempt: what this rank does.

    Returns:
        ``attempt()``'s result, when it succeeded on every rank.

    Raises:
        ResumeError: ``"<what> failed on 1 of 4 ranks, so the job stops: rank 2: <its message>"``, on
            every rank. Without a process group, whatever ``attempt`` raised.

    Example::

        state = fail_together(f"reading {path}", lambda: manager.load(path))
    """
    if not (dist.is_available() and dist.is_initialized()):
        return attempt()
    result: T | None = None
    error: Exception | None = None
    try:
        result = attempt()
    except Exception as e:  # re-raised below, on every rank
        error = e
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else str(error))
    failed = [f"rank {rank}: {message}" for rank, message in enumerate(messages) if message is not None]
    if failed:
        raise ResumeError(
            f"{what} failed on {len(failed)} of {len(messages)} ranks, so the job stops: {'; '.join(failed)}"
        ) from error
    return result  # type: ignore[return-value]


def require_agreement(state: Any, *, group: dist.ProcessGroup | None = None, what: str = "data state") -> None:
    """Refuse unless every rank of ``group`` holds the same ``state`` (a collective: call it on all).

    One all-reduce of a digest (O(1) traffic, whatever the world size); only when the digests
    differ are the states gathered, to name the ranks and the fields that differ.

    Args:
        state: this rank's JSON-able state.
        group: the data-parallel process group (the default group when None).
        what: what the state is, for the message.

    Raises:
        ResumeError: on every rank, when any two ranks disagree.
    """
    _, world = distributed_defaults(group)
    if world == 1:
        return
    digest = _digest(state)
    extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if extremes[0].item() == -extremes[1].item():
        return
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, state, group=group)
    reference = gathered[0]
    differing = [r for r, s in enumerate(gathered) if _digest(s) != _digest(reference)]
    fields = sorted(
        {k for r in differing for k in set(reference) | set(gathered[r]) if reference.get(k) != gathered[r].get(k)}
        if isinstance(reference, Mapping) and all(isinstance(gathered[r], Mapping) for r in differing)
        else set()
    )
    detail = "; ".join(
        f"{field}: rank 0 has {reference.get(field)!r}, rank {differing[0]} has {gathered[differing[0]].get(field)!r}"
        for field in fields
    )
    raise ResumeError(
        f"the ranks disagree on the {what}: ranks {differing} differ from rank 0 ({detail or 'values differ'}). "
        "Data-parallel ranks must advance in lockstep (the same number of batches each) and be built with the "
        "same dataset, seed, shuffle and batch size; a state that differs is refused rather than averaged or "
        "picked, because any choice would repeat or skip samples"
    )


def global_state(
    loader: Stateful, *, group: dist.ProcessGroup | None = None, state: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The loader's state for the whole data-parallel group: the same on every rank.

    A collective when a process group is initialized: call it on every rank of ``group``.

    Args:
        loader: a :class:`~resumable_data.ResumableDataLoader` (its state is already global; the
            ranks' agreement is checked), a :class:`~resumable_data.StreamLoader` (every rank's
            slots are gathered and merged), or any ``Stateful`` whose state must agree across ranks.
        group: the data-parallel process group (the default group when None).
        state: this rank's state of ``loader`` to make global, taken earlier (an accumulation
            window's start, :class:`~resumable_data.accumulation.AccumulationWindow`); the
            loader's present state when None.

    Returns:
        A plain dict that any rank, at this or another world size, can ``load_state_dict``.

    Raises:
        ResumeError: the ranks' states disagree, or stream states cannot be merged.

    Example::

        state = global_state(loader)  # on every rank
        if dist.get_rank() == 0:
            torch.save({"dataloader": state, ...}, path)
    """
    state = loader.state_dict() if state is None else dict(state)
    _, world = distributed_defaults(group)
    if isinstance(loader, StreamLoader):
        if world == 1:
            return state
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, state, group=group)
        return StreamLoader.merge_states(gathered)
    require_agreement(state, group=group, what=f"{type(loader).__name__} state")
    return state


def check_world_size(state: Mapping[str, Any], world_size: int) -> None:
    """Refuse a data state saved at another world size, for jobs that must not change it.

    Resuming at another world size is exact in the sense that the rest of the epoch is read
    exactly once, but batches are cut differently; call this when that is not acceptable.

    Raises:
        ResumeError: naming both sizes.
    """
    state = require_mapping(state, "data")
    saved = state.get(keys.WORLD_SIZE)
    if saved != world_size:
        raise ResumeError(
            f"world size changed: the checkpoint was written by {saved!r} data-parallel ranks, this job has "
            f"{world_size}; restart with {saved!r} ranks (torchrun --nproc_per_node ...), or allow the change "
            "(DataLoaderState(..., allow_world_size_change=True)) to continue the epoch exactly once over the new ranks"
        )


class DataLoaderState:
    """A ``Stateful`` for ``torch.distributed.checkpoint`` whose keys never depend on the world size.

    ``state_dict()`` is a collective (see :func:`global_state`): DCP calls it on every rank in
    ``dcp.save``/``dcp.async_save`` (at call time, so an async save keeps the position of the
    call) and in ``dcp.load`` (for the template). The global state is stored as one JSON string,
    identical on every rank, so DCP's deduplication keeps the right value and a checkpoint written
    at world size W loads at any W'.

    Args:
        loader: a :class:`~resumable_data.ResumableDataLoader`, a
            :class:`~resumable_data.StreamLoader`, or any ``Stateful`` with JSON-able state.
        group: the data-parallel process group (the default group when None).
        allow_world_size_change: when False, loading a state saved at another world size raises
            :class:`~resumable_data.ResumeError` naming both sizes.

    Example::

        import torch.distributed.checkpoint as dcp

        app = {"model": model_state, "dataloader": DataLoaderState(loader)}
        dcp.save(app, checkpoint_id=path)  # every rank
        dcp.load(app, checkpoint_id=path)  # every rank, any world size
    """

    def __init__(
        self,
        loader: Stateful,
        *,
        group: dist.ProcessGroup | None = None,
        allow_world_size_change: bool = True,
    ) -> None:
        if not isinstance(loader, Stateful):
            raise TypeError(
                f"DataLoaderState takes an object with state_dict/load_state_dict, got {type(loader).__name__}"
            )
        self.loader = loader
        self.group = group
        self.allow_world_size_change = allow_world_size_change

    def state_dict(self) -> dict[str, Any]:
        """``{"version": 1, "state_json": <the global state as JSON>}``; a collective.

        Examples:
            >>> from resumable_data import ResumableDataLoader
            >>> loader = ResumableDataLoader(torch.arange(10), batch_size=4, seed=0)
            >>> _ = next(iter(loader))
            >>> DataLoaderState(loader).state_dict()  # without a process group: this process's state
            {'version': 1, 'state_json': '{"batch_size": 4, "dataset_length": 10, "drop_last": false, "epoch": 0,
             "position": 4, "seed": 0, "shuffle": true, "version": 2, "world_size": 1}'}
        """
        state = global_state(self.loader, group=self.group)
        try:
            text = json.dumps(state, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise ResumeError(
                f"{_WHAT}: the loader's state is not JSON-able, so it cannot be stored safely: {e}"
            ) from e
        return {keys.VERSION: DATA_STATE_VERSION, STATE_JSON: text}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Parse and check the stored state, then load it into the loader (which validates it too).

        Raises:
            ResumeError: malformed, another version, or (when refused) another world size; the
                loader is unchanged.
        """
        state_dict = require_mapping(state_dict, _WHAT)
        check_version(state_dict, DATA_STATE_VERSION, _WHAT)
        text = state_dict.get(STATE_JSON)
        if not isinstance(text, str):
            raise ResumeError(f"{_WHAT} field {STATE_JSON!r} must be a JSON string, got {type(text).__name__}")
        try:
            state = json.loads(text)
        except ValueError as e:
            raise ResumeError(f"{_WHAT} field {STATE_JSON!r} is not valid JSON: {e}") from e
        if not self.allow_world_size_change:
            _, world = distributed_defaults(self.group)
            check_world_size(require_mapping(state, _WHAT), world)
        self.loader.load_state_dict(state)


@contextlib.contextmanager
def dcp_errors(action: str, checkpoint_id: Any) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` (a ``BaseException``) into a :class:`ResumeError`.

    ``except Exception`` does not catch a ``CheckpointException``; inside this block a failed
    ``dcp.save``/``dcp.load`` becomes a ``ResumeError`` naming the action, the path and each
    failing rank's error. A failed write is reported as what the OS said (``[Errno 28] No space
    left on device``), not as torch's serializer's ``[enforce fail at inline_container.cc]
    unexpected pos``: DCP's writer ``torch.save``-s into each file, and torch keeps the ``OSError``
    only as the context of its own error. Under a process group DCP pickles each rank's error,
    which drops that context; the message then says how much space the folder's file system has
    left on this host, and points at ``ErrnoFileSystemWriter`` (what ``DcpStore.writer`` returns), a
    writer that raises the ``OSError`` itself and so keeps the errno and the file on every rank.

    Example::

        with dcp_errors("save", path):
            dcp.save(app, storage_writer=ErrnoFileSystemWriter(path))
        with dcp_errors("load", path):
            dcp.load(app, checkpoint_id=path)
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        failures = getattr(e, "failures", {}) or {}
        detail = "; ".join(
            f"rank {rank}: {_describe(err, checkpoint_id)}" for rank, err in sorted(failures.items())
        ) or str(e)
        raise ResumeError(f"torch.distributed.checkpoint could not {action} {checkpoint_id}: {detail}") from e


def _describe(error: Any, checkpoint_id: Any) -> str:
    """One failing rank's error: the OS error behind it where one is known, else its first line."""
    exc = error[0] if isinstance(error, tuple) else error
    os_error = _os_error_behind(exc)
    if os_error is not None and os_error.errno is not None:
        if os_error.filename is not None:  # ErrnoFileSystemWriter's: it names the file
            return f"{type(os_error).__name__}: {os_error}"
        return f"{type(os_error).__name__}: [Errno {os_error.errno}] {os_error.strerror}: writing into {checkpoint_id}"
    line = _first_line(exc)
    if isinstance(exc, RuntimeError) and "unexpected pos" in line:
        return (
            f"a write failed ({line}: how torch.save reports a file write the OS refused; "
            f"{_free_space(checkpoint_id)}; save with storage_writer=ErrnoFileSystemWriter(path), from "
            "resumable_data.checkpoint.dcp_writer, for the OS error and the file on every rank)"
        )
    return line


def _os_error_behind(exc: BaseException) -> OSError | None:
    """The first ``OSError`` in ``exc``'s chain (itself, its cause, its context), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _free_space(checkpoint_id: Any) -> str:
    """How many bytes the file system holding ``checkpoint_id`` has free, as this process sees it."""
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return "its free space is unknown (not a local path)"
    folder = Path(checkpoint_id)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        info = os.statvfs(folder)
    except OSError as e:
        return f"its free space is unknown ({e})"
    free = info.f_bavail * info.f_frsize
    full = f": no space left on device (errno {errno.ENOSPC}) is the likely cause" if free < _NEARLY_FULL else ""
    return f"the file system holding {folder} has {free} bytes free on this host{full}"


def _first_line(error: Any) -> str:
    exc = error[0] if isinstance(error, tuple) else error
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
