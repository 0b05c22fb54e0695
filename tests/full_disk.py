"""A real full disk for tests: a small tmpfs mounted on a test folder, filled to ``leave`` free bytes.

Mounting needs root (CI containers run as root); elsewhere the test is skipped visibly, with the
reason. The kernel then refuses writes with ENOSPC exactly as a full disk does.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

FILLER = "filler"


@contextlib.contextmanager
def small_disk(folder: Path, size: str = "1m") -> Iterator[Path]:
    """Mount a tmpfs of ``size`` on ``folder`` (created if missing) for the block; skip if that fails."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for a real full disk: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


def fill(disk: Path, leave: int) -> Path:
    """Write a filler file on ``disk`` so that about ``leave`` bytes stay free; delete it to free them."""
    info = os.statvfs(disk)
    free = info.f_bavail * info.f_frsize
    filler = disk / FILLER
    filler.write_bytes(b"\0" * max(0, free - leave))
    return filler
