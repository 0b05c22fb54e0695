"""The library's error and warning types, and the protocol every resumable object follows."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["ResumeError", "ResumeWarning", "Stateful"]


class ResumeError(ValueError):
    """A state cannot be loaded (or an object cannot be built) so that a resume would be exact.

    The message names the field, both values and the remedy. Raised before any mutation: the
    object that refused a state is unchanged.
    """


class ResumeWarning(UserWarning):
    """A resume that will run, but probably not the way the caller meant (e.g. an epoch loop that
    throws a restored position away). The message says what happens and the fix."""


@runtime_checkable
class Stateful(Protocol):
    """Anything with PyTorch-style ``state_dict()`` / ``load_state_dict()``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
