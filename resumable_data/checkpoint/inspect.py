"""What ``inspect`` reports about a checkpoint, read safely from untrusted files.

A checkpoint handed to ``inspect`` may be anything: empty, cut off, random bytes, a pickle bomb, a
folder whose payload no longer matches its manifest. It is verified the way the manager verifies it
(typed manifest, size, sha256), loaded with ``weights_only`` only (nothing in it is ever executed),
and every problem becomes one :class:`~resumable_data.ResumeError` line naming the file.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.state import EPOCH, POSITION, VERSION, WORLD_SIZE
from ..errors import ResumeError
from .manifest import (
    MANIFEST_NAME,
    PAYLOAD_NAME,
    STEP_RE,
    DcpManifest,
    Manifest,
    checkpoint_problem,
    dcp_checkpoint_problem,
    is_dcp_folder,
    read_dcp_manifest,
    read_manifest,
    step_of,
    verify_payload,
)
from .weights_only import load_weights_only

__all__ = ["DcpReport", "Report", "inspect_checkpoint"]
# A DCP folder holds a file per rank: the report names the first few.
_FILES_SHOWN = 8


@dataclass
class TensorBytes:
    """Tensors under one top-level key: how many, and their bytes (shared storage counted once)."""

    count: int = 0
    nbytes: int = 0


@dataclass
class Report:
    """A verified checkpoint's summary.

    Attributes:
        payload: The ``state.pt`` (or a DCP folder's payload, e.g. ``trainer.pt``) that was loaded.
        verified: Whether a manifest vouched for the payload (size and sha256 checked).
        manifest: The manifest, when there is one.
        step: From the manifest, else from a ``step-N`` folder name, else None.
        payload_bytes: Size of the payload file.
        data_states: Every nested dict with ``version``, ``epoch`` and ``position`` (a sampler, loader
            or stream state), by its key path.
        sizes: Per top-level key, tensors and their bytes.
    """

    payload: Path
    verified: bool
    manifest: Manifest | None
    step: int | None
    payload_bytes: int
    data_states: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    sizes: dict[str, TensorBytes] = field(default_factory=dict)
    dcp_manifest: DcpManifest | None = None  # the DCP folder's, when the payload is one of its payloads

    def lines(self) -> list[str]:
        """The human-readable report."""
        out = [f"checkpoint {self.payload.parent if self.manifest else self.payload}"]
        out.append(f"  step          {'unknown' if self.step is None else self.step}")
        if self.dcp_manifest is not None:
            sha256 = self.dcp_manifest.files[self.payload.name][1]
            out.append(
                f"  integrity     ok: the DCP folder's {MANIFEST_NAME} matches {self.payload.name} (size and "
                f"sha256 {sha256[:16]}...); the DCP files were not checked: inspect the folder for that"
            )
            out.append(f"  written by    resumable_data {self.dcp_manifest.library_version or '?'}")
        elif self.manifest is not None:
            out.append(
                f"  integrity     ok: {MANIFEST_NAME} matches {PAYLOAD_NAME} (size and sha256 {self.manifest.sha256[:16]}...)"
            )
            if self.manifest.created is not None:
                created = datetime.datetime.fromtimestamp(self.manifest.created, datetime.timezone.utc)
                out.append(f"  created       {created.isoformat(timespec='seconds')}")
            out.append(f"  written by    resumable_data {self.manifest.library_version or '?'}")
            if self.manifest.metric is not None:
                out.append(f"  metric        {self.manifest.metric}")
        else:
            out.append(f"  integrity     NOT VERIFIED: no {MANIFEST_NAME} beside the file")
        if not self.data_states:
            out.append("  data position none found (no dict with version, epoch and position)")
        for where, state in self.data_states.items():
            world = state.get(WORLD_SIZE, "?")
            out.append(f"  data position {where}: epoch {state[EPOCH]}, position {state[POSITION]}, world size {world}")
        out.append(f"  size          {self.payload_bytes:,} bytes in {self.payload.name}")
        for key, sizes in self.sizes.items():
            out.append(
                f"    {key:<20} {sizes.nbytes:>14,} bytes in {sizes.count} tensor{'s' if sizes.count != 1 else ''}"
            )
        return out

    def as_json(self) -> dict[str, Any]:
        """The same report as plain data (for scripts)."""
        manifest = self.manifest or self.dcp_manifest
        return {
            "payload": str(self.payload),
            "verified": self.verified,
            "step": self.step,
            "created": None if manifest is None else manifest.created,
            "library_version": None if manifest is None else manifest.library_version,
            "metric": None if self.manifest is None else self.manifest.metric,
            "payload_bytes": self.payload_bytes,
            "data_states": {where: _plain(state) for where, state in self.data_states.items()},
            "tensor_bytes": {key: {"count": s.count, "bytes": s.nbytes} for key, s in self.sizes.items()},
        }


@dataclass
class DcpReport:
    """A verified DCP step folder's summary (:class:`~resumable_data.checkpoint.DcpStore`).

    Attributes:
        folder: The step folder.
        manifest: Its manifest; every file it lists matched its size and sha256.
        payload_states: Per weights-only payload (e.g. ``trainer.pt``), the data states found in it.
        payload_sizes: Per payload, tensors and their bytes by top-level key.
    """

    folder: Path
    manifest: DcpManifest
    payload_states: dict[str, dict[str, Mapping[str, Any]]] = field(default_factory=dict)
    payload_sizes: dict[str, dict[str, TensorBytes]] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """The human-readable report."""
        files = self.manifest.files
        out = [f"DCP checkpoint {self.folder}", f"  step          {self.manifest.step}"]
        out.append(
            f"  integrity     ok: {MANIFEST_NAME} matches all {len(files)} files (size and sha256), "
            f"{self.manifest.total_bytes:,} bytes"
        )
        if self.manifest.created is not None:
            created = datetime.datetime.fromtimestamp(self.manifest.created, datetime.timezone.utc)
            out.append(f"  created       {created.isoformat(timespec='seconds')}")
        out.append(f"  written by    resumable_data {self.manifest.library_version or '?'}")
        names = sorted(files)
        for name in names[:_FILES_SHOWN]:
            kind = "payload, weights_only" if name in self.manifest.payloads else "DCP"
            out.append(f"    {name:<20} {files[name][0]:>14,} bytes ({kind})")
        if len(names) > _FILES_SHOWN:
            out.append(f"    ... and {len(names) - _FILES_SHOWN} more files")
        for payload in self.manifest.payloads:
            for where, state in self.payload_states.get(payload, {}).items():
                world = state.get(WORLD_SIZE, "?")
                out.append(
                    f"  data position {payload}{where}: epoch {state[EPOCH]}, position {state[POSITION]}, world size {world}"
                )
        out.append("  trust         DCP loads its files with pickle: load them only from a source you trust")
        return out

    def as_json(self) -> dict[str, Any]:
        """The same report as plain data (for scripts)."""
        return {
            "folder": str(self.folder),
            "format": "dcp",
            "verified": True,
            "step": self.manifest.step,
            "created": self.manifest.created,
            "library_version": self.manifest.library_version,
            "files": {name: {"bytes": size, "sha256": sha} for name, (size, sha) in self.manifest.files.items()},
            "payloads": list(self.manifest.payloads),
            "data_states": {
                payload + where: _plain(state)
                for payload, states in self.payload_states.items()
                for where, state in states.items()
            },
            "tensor_bytes": {
                payload: {key: {"count": s.count, "bytes": s.nbytes} for key, s in sizes.items()}
                for payload, sizes in self.payload_sizes.items()
            },
        }


def inspect_checkpoint(path: str | os.PathLike[str]) -> Report | DcpReport:
    """Verify and summarize a checkpoint: a ``step-N`` folder (of ``CheckpointManager`` or
    ``DcpStore``), or a state file (in one or alone).

    A folder must be a complete checkpoint (manifest and payload; for DCP, every file the manifest
    lists, with its size and sha256). A file is verified against the ``manifest.json`` beside it
    when there is one (a DCP folder's payload, e.g. ``trainer.pt``, against its entry), and reported
    as not verified otherwise. DCP's own files are never loaded (they unpickle); its weights-only
    payloads are. A DCP folder is recognized by DCP's ``.metadata`` or by its manifest, so one
    that lost its ``.metadata`` is reported as such.

    Raises:
        ResumeError: one line naming the path and what is wrong with it.
    """
    path = Path(path)
    if not path.exists():
        raise ResumeError(f"{path}: no such file or folder")
    if path.is_dir() and is_dcp_folder(path):
        return _inspect_dcp(path)
    dcp_manifest = None
    if not path.is_dir() and is_dcp_folder(path.parent):
        try:
            dcp_manifest = verify_payload(path.parent, path.name)
        except ResumeError as e:
            raise ResumeError(str(e).replace("cannot load ", "", 1)) from e
    if path.is_dir():
        if not (path / MANIFEST_NAME).exists() and not (path / PAYLOAD_NAME).exists():
            runs = sorted(p.name for p in path.iterdir() if STEP_RE.match(p.name))
            hint = f"; it holds {', '.join(runs[-3:])}: pass one of those" if runs else ""
            raise ResumeError(f"{path}: not a checkpoint folder (expected {PAYLOAD_NAME} and {MANIFEST_NAME}){hint}")
        folder, payload = path, path / PAYLOAD_NAME
        with_manifest = True
    else:
        folder, payload = path.parent, path
        with_manifest = dcp_manifest is None and payload.name == PAYLOAD_NAME and (folder / MANIFEST_NAME).exists()
    manifest = None
    if with_manifest:
        # A folder copied out of a run folder under another name is judged by its manifest alone.
        problem = checkpoint_problem(folder, verify=True, check_name=STEP_RE.match(folder.name) is not None)
        if problem is not None:
            raise ResumeError(f"{folder}: {problem}")
        manifest = read_manifest(folder)
    if not payload.is_file():
        raise ResumeError(f"{payload}: not a regular file")
    try:
        size = payload.stat().st_size
    except OSError as e:
        raise ResumeError(f"{payload}: {e.strerror}") from None
    if size == 0:
        raise ResumeError(f"{payload}: empty file (0 bytes)")
    try:
        state = load_weights_only(payload)
    except ResumeError as e:
        raise ResumeError(str(e).replace("cannot load checkpoint ", "", 1)) from e
    if not isinstance(state, Mapping):
        raise ResumeError(f"{payload}: not a checkpoint state: it holds a {type(state).__name__}, expected a dict")
    known = manifest or dcp_manifest
    return Report(
        payload=payload,
        verified=known is not None,
        manifest=manifest,
        step=known.step if known is not None else _step_from_name(payload),
        payload_bytes=size,
        data_states=dict(_data_states(state)),
        sizes=_tensor_bytes(state),
        dcp_manifest=dcp_manifest,
    )


def _inspect_dcp(folder: Path) -> DcpReport:
    problem = dcp_checkpoint_problem(folder, verify=True, check_name=STEP_RE.match(folder.name) is not None)
    if problem is not None:
        raise ResumeError(f"{folder}: {problem}")
    report = DcpReport(folder=folder, manifest=read_dcp_manifest(folder))
    for name in report.manifest.payloads:
        try:
            state = load_weights_only(folder / name)
        except ResumeError as e:
            raise ResumeError(str(e).replace("cannot load checkpoint ", "", 1)) from e
        if not isinstance(state, Mapping):
            raise ResumeError(f"{folder / name}: holds a {type(state).__name__}, expected a dict")
        report.payload_states[name] = {where.removeprefix("<root>"): s for where, s in _data_states(state)}
        report.payload_sizes[name] = _tensor_bytes(state)
    return report


def _step_from_name(payload: Path) -> int | None:
    try:
        return step_of(payload)
    except ResumeError:
        return None


def _walk(state: Any) -> Iterator[tuple[str, Any]]:
    """Every node under ``state`` with its key path, depth first, without recursion (a payload may
    nest arbitrarily deep)."""
    stack: list[tuple[str, Any]] = [("", state)]
    while stack:
        path, node = stack.pop()
        yield path, node
        if isinstance(node, Mapping):
            children = [(f"{path}/{key}", value) for key, value in node.items()]
        elif isinstance(node, (list, tuple)):
            children = [(f"{path}/{i}", value) for i, value in enumerate(node)]
        else:
            continue
        stack.extend(reversed(children))


def _data_states(state: Any) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for path, node in _walk(state):
        if isinstance(node, Mapping) and {VERSION, EPOCH, POSITION} <= node.keys():
            yield path or "<root>", node


def _tensor_bytes(state: Mapping[str, Any]) -> dict[str, TensorBytes]:
    sizes = {}
    seen: set[int] = set()
    for key, value in state.items():
        total = TensorBytes()
        for _, node in _walk(value):
            if not isinstance(node, torch.Tensor):
                continue
            total.count += 1
            storage = node.untyped_storage()
            if storage.data_ptr() not in seen or storage.nbytes() == 0:
                seen.add(storage.data_ptr())
                total.nbytes += storage.nbytes()
        if total.count:
            sizes[str(key)] = total
    return sizes


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return f"<tensor {tuple(obj.shape)} {obj.dtype}>"
    return obj
