"""What both checkpoint stores do with ``step-N`` folders, written once: :class:`StepFolderStore`.

:class:`CheckpointManager` (one ``state.pt`` per folder) and ``DcpStore`` (DCP's files written by
every rank) differ in what goes into a folder and how its manifest reads; the rest is this base:

- **Publishing** (:meth:`StepFolderStore._swap_in`): a complete ``.tmp-*`` folder is renamed to
  ``step-N`` and the run folder fsynced. ``rename()`` cannot replace a non-empty folder, so an
  existing ``step-N`` (saved again after a resume from an older checkpoint) is moved aside first and
  deleted once the new one is in place; a failure puts everything back as it was.
- **Pruning**: keep the newest ``keep_last`` *valid* checkpoints (and whatever the store adds, such as
  the best one); never one a newer release wrote, which this release cannot judge.
- **Deleting** renames a folder to ``.tmp-*`` first, so a crash mid-delete leaves a leftover that the
  next write removes, never half a ``step-N``; a removal that fails warns instead of failing a save.
- **The validity cache**: full verifications are remembered per folder while the inode, size and
  mtime of every file in it are unchanged, so pruning does not re-read every kept checkpoint.
"""

from __future__ import annotations

import abc
import os
import uuid
import warnings
from pathlib import Path
from types import TracebackType
from typing import ClassVar, TypeVar

from ..errors import ResumeError
from . import durable
from .manifest import refuse_to_replace_newer, step_folders, written_by_newer

__all__ = ["TMP_PREFIX", "StepFolderStore"]

TMP_PREFIX = ".tmp-"
# A folder's identity for the validity cache: inode, size and mtime of every file in it.
_StatKey = tuple[int, ...]
_Store = TypeVar("_Store", bound="StepFolderStore")


class StepFolderStore(abc.ABC):
    """The ``step-N`` folders of one run: publish with rollback, prune, verify with a cache.

    Args:
        directory: The run folder.
        keep_last: How many of the newest *valid* checkpoints to keep (at least 2, so a checkpoint
            found corrupt still leaves one to fall back to). Invalid ones never count.

    Raises:
        ResumeError: ``keep_last`` is below 2.
    """

    # The manifest version this store writes and reads, and the most bytes one may hold: a folder
    # whose manifest is of a higher version was written by a newer release and is never touched.
    manifest_version: ClassVar[int]
    max_manifest_bytes: ClassVar[int]
    # When a leftover that could not be removed is tried again (named in the warning).
    retried_at: ClassVar[str]

    def __init__(self, directory: str | os.PathLike[str], keep_last: int) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 2:
            raise ResumeError(
                f"keep_last must be an int >= 2 so a corrupt newest checkpoint still leaves one to "
                f"resume from, but got keep_last={keep_last!r}"
            )
        self.directory = Path(directory)
        self.keep_last = keep_last
        self._verified: dict[Path, tuple[_StatKey, bool]] = {}

    def __enter__(self: _Store) -> _Store:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @abc.abstractmethod
    def close(self) -> None:
        """Finish what is in flight and release the folder's lock. Safe to call twice."""

    @abc.abstractmethod
    def _folder_problem(self, path: Path, *, verify: bool) -> str | None:
        """What makes ``path`` unusable (sizes only, or with ``verify`` checksums too), or None."""

    def _settle(self) -> None:
        """Wait for a write in flight before reading the folder (a store with background writes)."""
        return  # by default, every write is done when the call that made it returns

    def _also_keep(self, folders: list[Path]) -> Path | None:
        """A checkpoint that pruning keeps beyond the newest valid ones (the manager's best)."""
        return None

    # -- reading ---------------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first.

        Complete means: a ``step-N`` folder whose manifest parses and is well-typed, names step N,
        and whose files have the sizes the manifest records. Checksums are not read here (see
        :meth:`latest`).
        """
        self._settle()
        return [path for path in self._step_folders() if self._folder_problem(path, verify=False) is None]

    def latest(self) -> Path | None:
        """The newest checkpoint whose manifest is valid and whose checksums all match.

        Newer folders that are incomplete, corrupt or odd (a zero-length or missing file, a changed
        byte) are skipped with a ``warnings.warn`` naming each and the problem. ``.tmp-*`` folders
        (writes in progress or cut off by a crash) are ignored.
        """
        self._settle()
        for path in reversed(self._step_folders()):
            problem = self._problem(path)
            if problem is None:
                return path
            warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
        return None

    def problem(self, path: str | os.PathLike[str]) -> str | None:
        """What makes the checkpoint folder ``path`` unusable (manifest, sizes and checksums are
        checked), or None when it can be loaded."""
        self._settle()
        return self._problem(Path(path))

    def _step_folders(self) -> list[Path]:
        """Every ``step-N`` folder (or symlink to one), complete or not, ordered by step."""
        return step_folders(self.directory)

    # -- validity --------------------------------------------------------------------------------

    def _problem(self, path: Path) -> str | None:
        """Verify ``path`` fully and remember the verdict for pruning."""
        problem = self._folder_problem(path, verify=True)
        self._remember(path, valid=problem is None)
        return problem

    def _is_valid(self, path: Path) -> bool:
        """Whether ``path`` is a valid checkpoint, verified once per version of its files."""
        key = _stat_key(path)
        cached = self._verified.get(path)
        if key is not None and cached is not None and cached[0] == key:
            return cached[1]
        return self._problem(path) is None

    def _remember(self, path: Path, *, valid: bool) -> None:
        key = _stat_key(path)
        if key is not None:
            self._verified[path] = (key, valid)

    # -- writing ---------------------------------------------------------------------------------

    def _swap_in(self, tmp: Path, target: Path) -> None:
        """Rename the complete folder ``tmp`` to ``target``, durably; on failure, put both back."""
        replaced: Path | None = None
        published = False
        try:
            # A crash between the two renames loses the old step-N (resume falls back to the step
            # before it); the old copy is only deleted once the new one is in place.
            replaced = self._move_aside(target) if os.path.lexists(target) else None
            os.rename(tmp, target)
            published = True
            durable.fsync_dir(self.directory)
        except BaseException:
            # Undo in reverse order: the new step-N (if it landed but could not be made durable)
            # goes back to its temp name, the old one comes back.
            if published:
                os.rename(target, tmp)
            if replaced is not None:
                os.rename(replaced, target)
            raise
        if replaced is not None:
            self._remove_quietly(replaced)
        self._remember(target, valid=True)

    def _prune(self, keep: Path) -> None:
        """Keep the newest ``keep_last`` valid checkpoints, ``keep`` and :meth:`_also_keep`'s; delete the rest.

        Invalid checkpoints never count towards ``keep_last``: one newer than the K-th valid one
        stays (skipped with a warning when reading; replaced when its step is saved again), older
        ones go with the valid ones there, except those a newer release wrote, which always stay.
        """
        folders = self._step_folders()
        survivors = {keep}
        valid_kept = 0
        doomed: list[Path] = []
        for path in reversed(folders):
            if valid_kept >= self.keep_last:
                doomed.append(path)
            elif path == keep or self._is_valid(path):
                valid_kept += 1
                survivors.add(path)
        if (also := self._also_keep(folders)) is not None:
            survivors.add(also)
        for path in doomed:
            if path in survivors or self._written_by_newer(path):
                continue
            try:
                durable.remove_tree(self._move_aside(path))
            except OSError as e:
                # The new checkpoint is safe; only space is at stake, so say so and go on.
                warnings.warn(f"could not prune checkpoint {path}: {e}", stacklevel=3)
            self._verified.pop(path, None)

    def _written_by_newer(self, folder: Path) -> bool:
        return written_by_newer(folder, self.manifest_version, max_bytes=self.max_manifest_bytes) is not None

    def _refuse_to_replace_newer(self, target: Path) -> None:
        """Refuse to save ``target`` when a newer release wrote it (it is never replaced).

        Raises:
            ResumeError: naming the folder, both manifest versions and what to do.
        """
        refuse_to_replace_newer(target, self.manifest_version, max_bytes=self.max_manifest_bytes)

    def _move_aside(self, path: Path) -> Path:
        """Rename a step folder to a .tmp-* name, durably, before deleting it.

        The rename is atomic, so a crash mid-delete leaves a .tmp-* leftover, never half a step-N.
        """
        doomed = self.directory / f"{TMP_PREFIX}deleted-{path.name}-{uuid.uuid4().hex[:12]}"
        os.rename(path, doomed)
        durable.fsync_dir(self.directory)
        return doomed

    def _remove_leftovers(self) -> None:
        """Delete ``.tmp-*`` entries: with the lock held nobody else writes here, so each is a
        leftover of a crash (a symlink is unlinked, never followed)."""
        for path in self.directory.glob(f"{TMP_PREFIX}*"):
            self._remove_quietly(path)

    def _remove_quietly(self, path: Path) -> None:
        """Remove a temp entry; if that fails, warn (it is tried again) rather than fail a save."""
        try:
            durable.remove_tree(path)
        except OSError as e:
            warnings.warn(
                f"could not remove the leftover {path}: {e}; the next {self.retried_at} tries again", stacklevel=4
            )


def _stat_key(folder: Path) -> _StatKey | None:
    """Inode, size and mtime of every entry of a folder (links followed), or None if one cannot be read."""
    try:
        infos = [entry.stat() for entry in sorted(folder.iterdir())]
    except OSError:
        return None
    return tuple(value for info in infos for value in (info.st_ino, info.st_size, info.st_mtime_ns))
