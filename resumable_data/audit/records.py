"""The audit records: one append-only JSONL file per process, a line per batch or per logged step.

When ``RESUMABLE_DATA_AUDIT`` names a folder, each iterator of ``ResumableDataLoader`` and
``StreamLoader`` asks :func:`recorder` once (not once per batch) for a :class:`Recorder`, and then
writes a line for each batch it hands out, in the main process: the loader, rank, epoch, position in
the epoch, the sample indices when known, and a digest of the batch's bytes (so "same samples,
different augmentation" shows). :func:`log_values` adds the user's per-step values (``loss``,
``lr``). Each line is written and flushed on its own, so a SIGKILL keeps every line before it.
``python -m resumable_data verify`` reads these files back (:mod:`resumable_data.audit.compare`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

__all__ = ["AUDIT_ENV", "Recorder", "digest", "loader_id", "log_values", "recorder"]

AUDIT_ENV = "RESUMABLE_DATA_AUDIT"
"""The environment variable naming the folder audit files go to; unset, nothing is recorded."""
BATCH = "batch"  # a line's "kind": a batch a loader handed out
LOG = "log"  # a line's "kind": the values the user logged for a step

_lock = threading.Lock()
_loader_ids = itertools.count()
# (the pid and folder it was opened for, the file): a forked worker, or another folder, gets a file of its own.
_file: tuple[int, str, IO[str]] | None = None


def _folder() -> str | None:
    return os.environ.get(AUDIT_ENV) or None


def _write(record: dict[str, Any]) -> None:
    """Append ``record`` as one line of this process's file, flushed at once (line buffering)."""
    global _file
    folder = _folder()
    if folder is None:
        return
    line = json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n"
    with _lock:
        if _file is None or _file[:2] != (os.getpid(), folder):
            if _file is not None and _file[0] == os.getpid():
                _file[2].close()
            Path(folder).mkdir(parents=True, exist_ok=True)
            # The rank (torchrun's), the start time and the pid: relaunches and ranks never share a file.
            name = f"rank{os.environ.get('RANK', '0')}-{time.time_ns()}-{os.getpid()}.jsonl"
            handle = open(Path(folder) / name, "a", buffering=1, encoding="utf-8")  # noqa: SIM115  # kept open
            _file = (os.getpid(), folder, handle)
        _file[2].write(line)


def loader_id() -> int | None:
    """The next loader's number in this process (its creation order), or None without an audit.

    Relaunches of one script create their loaders in the same order, so the number matches a
    loader across launches; a loader made only on resume (a peek) gets a number of its own.
    """
    return next(_loader_ids) if _folder() is not None else None


class Recorder:
    """Writes the batch lines of one loader iterator."""

    def __init__(self, loader: int | None, rank: int) -> None:
        self.loader = loader
        self.rank = rank

    def batch(self, batch: Any, *, epoch: int, position: Any, indices: list[int] | None = None) -> None:
        """Record a batch handed out at ``position`` of ``epoch`` (the loader's key for it)."""
        record = {"kind": BATCH, "loader": self.loader, "rank": self.rank, "epoch": epoch, "position": position}
        if indices is not None:
            record["indices"] = indices
        _write({**record, "digest": digest(batch)})


def recorder(loader: int | None, rank: int) -> Recorder | None:
    """A :class:`Recorder` when the audit is on (``RESUMABLE_DATA_AUDIT`` set), else None."""
    return Recorder(loader, rank) if _folder() is not None else None


def log_values(step: int, values: Mapping[str, Any]) -> None:
    """Record the user's ``values`` for ``step``; floats (and one-element tensors) as exact hex."""
    if _folder() is None:
        return
    record = {"kind": LOG, "rank": int(os.environ.get("RANK", "0")), "step": int(step)}
    _write({**record, "values": {name: _exact(value) for name, value in values.items()}})


def _exact(value: Any) -> Any:
    """A float as ``float.hex`` (bitwise comparable, a float32 exactly too); other values as JSON."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.detach().cpu().item()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return {"hex": value.hex()}
    return value if isinstance(value, (int, str, bool)) or value is None else repr(value)


def digest(batch: Any) -> str:
    """A sha256 of a batch's bytes: tensors and arrays (dtype, shape, contents), nested mappings,
    sequences and dataclasses, and plain values. Equal batches give equal digests, in any process."""
    hasher = hashlib.sha256()
    _feed(hasher, batch)
    return hasher.hexdigest()[:32]


def _feed(hasher: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        hasher.update(f"tensor {tensor.dtype} {tuple(tensor.shape)};".encode())
        if tensor.layout is torch.strided:
            hasher.update(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:  # sparse and other layouts: their dense value
            hasher.update(tensor.to_dense().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        hasher.update(f"array {value.dtype.str} {value.shape};".encode())
        hasher.update(np.ascontiguousarray(value).tobytes() if value.dtype != object else repr(value).encode())
    elif isinstance(value, Mapping):
        hasher.update(f"map {len(value)};".encode())
        for key in sorted(value, key=repr):
            _feed(hasher, key)
            _feed(hasher, value[key])
    elif isinstance(value, (list, tuple)):
        hasher.update(f"seq {len(value)};".encode())
        for item in value:
            _feed(hasher, item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        _feed(hasher, {f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    else:  # str, bytes, numbers, None, other objects: their type and repr
        hasher.update(f"{type(value).__qualname__} {value!r};".encode())
