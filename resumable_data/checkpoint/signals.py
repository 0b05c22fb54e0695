"""Stop at the next step boundary on SIGTERM or Ctrl-C: :class:`GracefulStop`.

A scheduler that preempts a job (SLURM's ``--signal=TERM@120``, Kubernetes, torchrun passing the
signal on to its ranks) sends SIGTERM and waits a little before SIGKILL. A training loop that reads
:attr:`GracefulStop.reason` after each optimizer step can then save a checkpoint and exit, so
the next launch resumes from that step instead of the last periodic checkpoint.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["GracefulStop"]


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class GracefulStop(contextlib.AbstractContextManager["GracefulStop"]):
    """While entered, SIGTERM and SIGINT set :attr:`reason` instead of ending the process.

    A second Ctrl-C raises ``KeyboardInterrupt`` at once (a save that hangs can still be
    aborted). Handlers can only be installed from the main thread: created in another one (a
    notebook's, a test's), it installs nothing and :attr:`reason` stays None. The previous handlers
    are put back on exit.

    Under torchrun a signal may reach only some ranks: reduce the flag across ranks (with the loss
    you already all-reduce, for instance) so that every rank stops after the same step.

    Args:
        announce: called with one line when a signal arrives (default: printed to stderr); a
            progress bar's ``tqdm.write`` keeps the bar intact.

    Example::

        with GracefulStop() as stop:
            for step in range(start, max_steps):
                train_step()
                if stop.reason is not None:
                    manager.save(step + 1, state)
                    break
    """

    def __init__(self, announce: Callable[[str], None] = _to_stderr) -> None:
        self.reason: str | None = None
        self._announce = announce
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name
        self._announce(f"received {self.reason}: finishing this step, then saving (Ctrl-C again aborts without saving)")
