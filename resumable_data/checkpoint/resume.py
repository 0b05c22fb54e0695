"""Which checkpoint a launch resumes from: :func:`choose_checkpoint`, for ``--resume auto|never|PATH``.

A run folder holds one history. Resuming from anything but its newest checkpoint, or starting from
scratch beside existing ones, would write new ``step-N`` folders among the old ones, and a later
"resume from the newest" would pick up a checkpoint of the other history. So both are refused while
newer checkpoints are there. So is ``auto`` when the folder holds checkpoints but none can be resumed
(all damaged, or written by a newer release): starting from scratch there would prune or replace
them, and nothing may lose a checkpoint that was complete.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from ..errors import ResumeError
from .manifest import step_folders, step_of

__all__ = ["AUTO", "NEVER", "CheckpointFolders", "choose_checkpoint"]

AUTO, NEVER = "auto", "never"


class CheckpointFolders(Protocol):
    """What :func:`choose_checkpoint` needs of a store: :class:`CheckpointManager` and ``DcpStore`` have it."""

    @property
    def directory(self) -> Path: ...

    def checkpoints(self) -> list[Path]: ...

    def latest(self) -> Path | None: ...

    def problem(self, path: Path) -> str | None: ...


def choose_checkpoint(
    store: CheckpointFolders, resume: str | os.PathLike[str], *, option: str = "resume"
) -> Path | None:
    """The checkpoint to resume from, or None to start from scratch.

    Args:
        store: the run's checkpoints (a :class:`CheckpointManager` or a ``DcpStore``).
        resume: ``"auto"``: the newest valid checkpoint (None when the store holds no ``step-N``
            folder; invalid newer ones are skipped with a warning); ``"never"``: from scratch;
            otherwise a ``step-N`` folder or a file in one, as given or relative to ``store.directory``.
        option: how the caller's user spells ``resume`` (``"--resume"``), for the error messages.

    Returns:
        The checkpoint's path, or None.

    Raises:
        ResumeError: ``"auto"`` while the store holds ``step-N`` folders of which none can be resumed
            (the message names each and why); ``"never"`` while the store holds checkpoints; a path
            that does not exist or is not named ``step-N``; a path older than checkpoints the store holds.

    Example::

        with CheckpointManager("runs/a/checkpoints") as manager:
            path = choose_checkpoint(manager, args.resume, option="--resume")
            state = manager.load(path) if path is not None else None
    """
    if resume == AUTO:
        latest = store.latest()
        unusable = step_folders(store.directory) if latest is None else []
        if unusable:
            reasons = "; ".join(f"{path.name}: {store.problem(path)}" for path in reversed(unusable))
            raise ResumeError(
                f"{option} {AUTO}: {store.directory} holds {len(unusable)} checkpoint(s), but none can be resumed "
                f"from ({reasons}). Nothing was changed. Repair them or resume with the release that wrote them; "
                f"to train from scratch instead, move them out of {store.directory} and pass {option} {NEVER}, "
                "or use another folder"
            )
        return latest
    existing = store.checkpoints()
    if resume == NEVER:
        present = existing or step_folders(store.directory)  # unreadable ones too: a fresh run would prune them
        if present:
            raise ResumeError(
                f"{option} never, but {store.directory} already holds checkpoints (newest {present[-1].name}); "
                "two runs in one folder would mix their checkpoints: use another folder or delete that one"
            )
        return None
    path = Path(resume)
    if not path.exists() and (store.directory / path).exists():
        path = store.directory / path
    if not path.exists():
        raise ResumeError(
            f"{option} {resume}: no such checkpoint, neither as given nor in {store.directory}; "
            f"pass an existing step-N folder, or {AUTO} for the newest one"
        )
    step = step_of(path)
    newer = [p.name for p in existing if step_of(p) > step]
    if newer:
        raise ResumeError(
            f"{option} {resume} (step {step}), but {store.directory} holds newer checkpoints {newer}; "
            "resuming from an older one would mix two histories: move them away or use another folder"
        )
    return path
