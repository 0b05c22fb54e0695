"""Kill points: run the trainer and SIGKILL it at a chosen moment of a step, a checkpoint write or a prune.

    python -m system.killpoints [KILLPOINT N] train [train flags...]     # tests/ and the root on PYTHONPATH
    TRAINER_INDEX_LOG=FOLDER python -m system.killpoints ...     # also log every batch's indices

Like failpoints in storage engines: the process kills itself (SIGKILL, nothing flushed, no handler
run) at the N-th time it reaches ``KILLPOINT``, so verify-resume and the chaos harness can aim at
the few milliseconds that random timing rarely hits. The moments are recognized from the outside of
the library and of the trainer's loop, which carry no test hooks: by wrapping the calls every
checkpoint write makes (``torch.save``, ``os.fsync``, ``os.rename``, ``shutil.rmtree``) and looking
at the paths involved, by a global optimizer step pre-hook, and by a global forward pre-hook on the
model in training mode (the micro-batches of a gradient-accumulation window). Only the trainer's own process
kills itself: forked DataLoader workers inherit the wrappers but never fire; under torchrun only
rank 0 is armed (torchrun then stops the other ranks). ``$TRAINER_INDEX_LOG``, read once here,
installs :mod:`system.index_log`.

Kill points (in the order a step and a save reach them):

    micro             micro-batch N + 1 of this process about to run its forward: micro-batches
                      1..N trained, their gradients accumulated; with --grad-accum G and N not a
                      multiple of G, inside a window, after its micro-batch N % G - 1 (0-based)
    micro-sigterm     the same moment, but a SIGTERM to itself (a graceful stop) instead of SIGKILL
    step              optimizer step N of this process, after its backward, before the update
                      (step N of a run started from scratch)

    payload-half      half of state.pt written into the temp folder (DCP: of the first torch.save,
                      DCP's own or trainer.pt)
    payload-synced    state.pt (DCP: trainer.pt) complete and fsynced, no manifest yet
    manifest-synced   manifest.json fsynced, temp folder not yet renamed
    before-publish    about to rename .tmp-step-N to step-N
    after-publish     step-N in place, run folder not yet fsynced, nothing pruned
    prune-aside       an old step folder renamed to .tmp-deleted-*, not yet deleted
    prune-half        an old step folder half deleted
    after-seconds     N is a float: that many seconds after the trainer is imported (any moment)
"""

from __future__ import annotations

import functools
import io
import os
import shutil
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["ENTRY", "KILLPOINTS", "main"]

# How a harness starts the trainer armed: ``[sys.executable, *ENTRY, KILLPOINT, N, "train", ...]``,
# with :func:`system.verify.child_env`'s PYTHONPATH.
ENTRY = ("-m", "system.killpoints")

KILLPOINTS = (
    "micro",
    "micro-sigterm",
    "step",
    "payload-half",
    "payload-synced",
    "manifest-synced",
    "before-publish",
    "after-publish",
    "prune-aside",
    "prune-half",
    "after-seconds",
)
_MAIN_PID = os.getpid()


def _die(signum: int = signal.SIGKILL) -> None:
    if os.getpid() == _MAIN_PID:  # never in a forked DataLoader worker
        os.kill(os.getpid(), signum)


class _Counter:
    """Fires on the ``n``-th hit of the armed kill point."""

    def __init__(self, armed: str, n: int) -> None:
        self.armed, self.n, self.hits = armed, n, 0
        self._lock = threading.Lock()

    def reached(self, point: str) -> bool:
        if point != self.armed:
            return False
        with self._lock:
            self.hits += 1
            return self.hits == self.n


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _install(counter: _Counter) -> None:
    """Wrap the calls a checkpoint write makes; each wrapper dies when its kill point comes due."""
    real_save, real_fsync, real_rename, real_rmtree = torch.save, os.fsync, os.rename, shutil.rmtree

    @functools.wraps(real_save)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not counter.reached("payload-half"):
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        _die()

    @functools.wraps(real_fsync)
    def fsync(fd: Any) -> None:
        real_fsync(fd)
        path = _fd_path(fd if isinstance(fd, int) else fd.fileno())
        if ".tmp-step-" in path:
            name = Path(path).name
            if (name in ("state.pt", "trainer.pt") and counter.reached("payload-synced")) or (
                name == "manifest.json" and counter.reached("manifest-synced")
            ):
                _die()

    @functools.wraps(real_rename)
    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        publishing = Path(src).name.startswith(".tmp-step-") and Path(dst).name.startswith("step-")
        if publishing and counter.reached("before-publish"):
            _die()
        real_rename(src, dst, *args, **kwargs)
        if publishing and counter.reached("after-publish"):
            _die()
        if Path(dst).name.startswith(".tmp-deleted-step-") and counter.reached("prune-aside"):
            _die()

    @functools.wraps(real_rmtree)
    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).name.startswith(".tmp-deleted-step-") and counter.reached("prune-half"):
            entries = sorted(Path(path).iterdir())
            if entries:
                entries[0].unlink()
            _die()
        real_rmtree(path, *args, **kwargs)

    torch.save, os.fsync, os.rename, shutil.rmtree = save, fsync, rename, rmtree


def _arm(point: str, n: str) -> None:
    if point == "after-seconds":
        timer = threading.Timer(float(n), _die)
        timer.daemon = True
        timer.start()
    elif point == "step":
        counter = _Counter(point, int(n))

        def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if counter.reached("step"):
                _die()

        register_optimizer_step_pre_hook(before_step)
    elif point in ("micro", "micro-sigterm"):
        from trainer.model import GPT

        forwards = _Counter(point, int(n) + 1)
        signum = signal.SIGKILL if point == "micro" else signal.SIGTERM

        # Every module's forward passes here; only the model's own, in training mode, is a micro-batch
        # (evaluation runs in eval mode; DDP's wrapper calls the GPT inside it).
        def before_forward(module: torch.nn.Module, args: Any) -> None:
            if isinstance(module, GPT) and module.training and forwards.reached(point):
                _die(signum)

        register_module_forward_pre_hook(before_forward)
    else:
        _install(_Counter(point, int(n)))


def main(argv: Sequence[str] | None = None) -> int:
    """Arm ``argv[0]`` at count ``argv[1]`` (when ``argv[0]`` is a kill point), install the index
    log when ``$TRAINER_INDEX_LOG`` names a folder, then run the trainer's command line on the rest."""
    args = list(sys.argv[1:] if argv is None else argv)
    armed = bool(args) and args[0] in KILLPOINTS
    if not args or (armed and len(args) < 3):
        raise SystemExit(f"usage: python -m system.killpoints [KILLPOINT N] COMMAND [FLAGS...]\n{__doc__}")
    # Imported before arming, so "after-seconds" counts from a trainer ready to run, not from imports.
    from trainer.__main__ import main as trainer_main

    from . import index_log

    if os.environ.get(index_log.ENV):
        index_log.install(os.environ[index_log.ENV])
    if not armed:
        return trainer_main(args)
    if os.environ.get("RANK", "0") == "0":
        _arm(args[0], args[1])
    return trainer_main(args[2:])


if __name__ == "__main__":
    sys.exit(main())
