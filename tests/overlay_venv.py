"""A virtual environment for a peer that conflicts with the dev environment, made once per machine.

torchtitan 0.3 pins ``datasets<4.8``, which the dev environment is past, so its tests run in an
*overlay*: a fresh venv whose site-packages come first and which then sees every package of the
dev venv (a ``.pth`` file adds the dev venv's site-packages, its own ``.pth`` files included, so
``resumable_data`` is this checkout's editable install). ``pip install`` into it adds only what the
peer needs and the dev venv lacks or has at another version; what the dev venv already satisfies
(torch above all, pinned on the command line to the dev venv's version) is not installed again,
and pip leaves the dev venv itself alone ("outside environment").

The venv lives under ``$RESUMABLE_DATA_TEST_ENVS`` (default ``~/.cache/resumable_data/test-envs``)
in a folder named by the peer's requirements, torch's and Python's versions and the dev venv's
path, so every checkout makes it once per machine; a ``ready`` file marks a venv whose install and
import check passed. Making it is serialized by a lock file (two test processes may ask at once).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch

PIP_TIMEOUT_S = 900
READY = "ready"


class OverlayError(Exception):
    """The overlay venv could not be made; the message holds the failing command's output, trimmed."""


def location(name: str, requirements: Sequence[str]) -> Path:
    """Where the overlay for ``requirements`` lives on this machine, for this dev venv."""
    root = Path(os.environ.get("RESUMABLE_DATA_TEST_ENVS", Path.home() / ".cache" / "resumable_data" / "test-envs"))
    dev = sysconfig.get_paths()["purelib"]
    key = hashlib.sha256(json.dumps([list(requirements), torch.__version__, sys.version, dev]).encode()).hexdigest()
    return root / f"{name}-py{sys.version_info[0]}{sys.version_info[1]}-{key[:12]}"


def python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_ready(venv: Path) -> bool:
    return (venv / READY).is_file()


def _run(command: list[str], log: Path, what: str) -> None:
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise OverlayError(f"{what} did not finish in {PIP_TIMEOUT_S} s: {' '.join(command)}") from exc
    log.write_text(completed.stdout + completed.stderr)
    if completed.returncode != 0:
        lines = [line for line in (completed.stdout + completed.stderr).splitlines() if line.strip()]
        raise OverlayError(f"{what} failed (exit {completed.returncode}): " + " | ".join(lines[-12:]))


def make(venv: Path, requirements: Sequence[str], check: str) -> None:
    """Make the overlay at ``venv`` unless it is ready: venv, ``.pth``, ``pip install``, then ``check``.

    ``check`` is Python code run by the overlay's interpreter; it must exit 0 (e.g. import the peer
    and assert where torch comes from).

    Raises:
        OverlayError: a step failed (its output trimmed into the message; the whole of it in the
            venv's ``pip.log`` / ``check.log``).
    """
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other test process waits here, then finds it ready
        if is_ready(venv):
            return
        shutil.rmtree(venv, ignore_errors=True)  # a half-made one from an interrupted run
        _run([sys.executable, "-m", "venv", str(venv)], venv.parent / f"{venv.name}.venv.log", "python -m venv")
        purelib = subprocess.run(
            [str(python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dev = sysconfig.get_paths()["purelib"]
        # addsitedir (not a bare path line) so the dev venv's own .pth files run: the editable install.
        Path(purelib, "_resumable_data_dev_venv.pth").write_text(f"import site; site.addsitedir({dev!r})\n")
        pip = [str(python(venv)), "-m", "pip", "install", "--disable-pip-version-check"]
        _run([*pip, *requirements], venv / "pip.log", f"pip install {' '.join(requirements)}")
        _run([str(python(venv)), "-c", check], venv / "check.log", "the import check")
        (venv / READY).write_text(json.dumps({"requirements": list(requirements), "torch": torch.__version__}))
