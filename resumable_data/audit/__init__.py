"""Audit what a training run consumed, and prove that it resumes exactly.

With ``RESUMABLE_DATA_AUDIT=<folder>`` in the environment, ``ResumableDataLoader`` and
``StreamLoader`` record every batch they hand out (no user code), and :func:`log` records the
script's per-step values; :func:`verify` (``python -m resumable_data verify -- COMMAND``) runs a
command uninterrupted and SIGKILLed, relaunched, and compares the two step by step, bitwise.
Without the variable nothing is recorded and nothing costs anything.

Example::

    from resumable_data import audit

    for step, (x, y) in enumerate(loader, start=first_step):
        loss = train_step(x, y)
        audit.log(step, loss=loss, lr=scheduler.get_last_lr()[0])  # a no-op unless verify runs
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ResumeError
from . import compare as _compare  # the package's `compare` stays the module
from .compare import Finding, read_launch
from .records import AUDIT_ENV, log_values
from .verifier import RUN_DIR, VerifyResult, verify

__all__ = ["AUDIT_ENV", "RUN_DIR", "Finding", "VerifyResult", "compare_launches", "log", "verify"]


def log(step: int, **values: Any) -> None:
    """Record the values of training step ``step`` (``loss=``, ``lr=``, ...) for ``verify`` to compare.

    A no-op unless ``RESUMABLE_DATA_AUDIT`` is set. Floats, and tensors of one element (a loss
    tensor), are kept as the exact bits of the float (``float.hex``), so the comparison is bitwise.
    Log every step on each rank, right after the step: the batches a loader handed out since the
    previous call are counted as this step's.

    Args:
        step: the step number, as the script counts it (it continues after a resume).
        **values: the step's values: ``loss``, ``lr``, or any others (numbers, strings).
    """
    log_values(step, values)


def compare_launches(reference: str | os.PathLike[str], launches: Sequence[str | os.PathLike[str]]) -> Finding | None:
    """The first step where an interrupted series differs from the uninterrupted run, or None: the
    comparison :func:`verify` reports, for a harness that starts, kills and relaunches the runs
    itself (each launch with ``RESUMABLE_DATA_AUDIT`` set to a folder of its own).

    Args:
        reference: the audit folder of the uninterrupted run.
        launches: the audit folders of the series' launches, in the order they ran.

    Returns:
        None when every step of the reference was run by the series with the same batches (their
        fingerprints) and logged values, bitwise; else where it first differs, what and the likely
        cause (``Finding.lines()``). A launch folder without records (a launch killed before its
        first step) is a launch that ran nothing: the steps no launch ran are a finding.

    Raises:
        ResumeError: a folder that does not exist, or a reference without records: a comparison
            with nothing proves nothing, so it is refused rather than passed.
    """
    folders = [Path(reference), *map(Path, launches)]
    missing = [str(folder) for folder in folders if not folder.is_dir()]
    if missing:
        raise ResumeError(
            f"compare_launches: no such audit folder: {', '.join(missing)}; pass the folders the runs wrote "
            f"with {AUDIT_ENV}=<folder> in their environment"
        )
    expected = read_launch(folders[0])
    if not expected.units and not expected.streams:
        raise ResumeError(
            f"compare_launches: the reference folder {folders[0]} holds no audit records: nothing to compare "
            f"with; run the uninterrupted run with {AUDIT_ENV}={folders[0]} in its environment (it must read "
            "through ResumableDataLoader or StreamLoader, or call resumable_data.audit.log)"
        )
    return _compare.compare(expected, [read_launch(folder) for folder in folders[1:]])
