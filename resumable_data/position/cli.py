"""The ``where`` and ``skip`` commands of ``python -m resumable_data``: their arguments and handlers.

A bad input (a bad checkpoint, a skip past the epoch's end, a malformed argument) gives one
``error:`` line naming the field and exit code 1, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from ..errors import ResumeError
from ..streams.base import Stream
from .skip import skip
from .stream import StreamWhereReport, where_stream
from .where import WhereReport, locate, where

__all__ = ["add_skip", "add_where", "load_pipeline", "run_skip", "run_where"]

CHECKPOINT_HELP = "a step-N checkpoint folder or a state file, as `inspect` takes it"


# Numbers are parsed here rather than by argparse, whose refusal is a usage block and exit code 2.
_INTS = {"next": 1, "previous": 1, "step": 0, "sample": 0, "epoch": 0, "rank": 0, "batch_size": 1}
_SKIP_INTS = {"batches": 1, "to_position": 0, "batch_size": 1}
PIPELINE_HELP = (
    "for a StreamLoader state: FUNCTION() (importable from the current folder) returns the stream the loader was "
    "built over, as the training script builds it; this RUNS that code. Needs --batch-size (unless the stream "
    "ends in .batch(n))"
)


def _ints(args: argparse.Namespace, minimums: dict[str, int]) -> dict[str, int | None]:
    """The numeric options of ``args`` as ints; a bad one raises a ResumeError naming its flag."""
    out: dict[str, int | None] = {}
    for name, minimum in minimums.items():
        text = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        try:
            value = None if text is None else int(text)
        except ValueError:
            raise ResumeError(f"{flag}: expected an integer, got {text!r}") from None
        if value is not None and value < minimum:
            raise ResumeError(f"{flag}: expected an integer >= {minimum}, got {value}")
        out[name] = value
    return out


def _positions(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    a, sep, b = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(a), int(b)
    except ValueError:
        raise ResumeError(f"--positions: expected A:B (two integers), got {text!r}") from None


def add_where(commands: Any) -> None:
    """Register ``where`` with a subparsers object."""
    command = commands.add_parser(
        "where",
        help="which samples the next/previous batches read, or where a sample is read",
        description="For a map-style data state (ResumableSampler, ResumableDataLoader) in a checkpoint: the "
        "sample indices of the next or previous N batches of every rank, of a step, or of a range of positions; "
        "or, with --sample, in which epoch, position, step and rank a sample is read. Skipped batches (see "
        "`skip`) are shown as skipped. O(1) per batch at any dataset size. For a StreamLoader state, with "
        "--pipeline: the shard and record of each record of the next or previous N batches of every rank, or of "
        "its batch S of the run.",
    )
    command.add_argument("checkpoint", metavar="CHECKPOINT", help=CHECKPOINT_HELP)
    query = command.add_mutually_exclusive_group()
    query.add_argument("--next", metavar="N", help="the next N batches (default: 1)")
    query.add_argument("--previous", metavar="N", help="the last N batches before the position")
    query.add_argument("--step", metavar="S", help="batch S of the run (epochs before counted in full)")
    query.add_argument("--positions", metavar="A:B", help="global positions A..B-1 of the epoch")
    query.add_argument("--sample", metavar="I", help="where sample I is read in the epoch")
    command.add_argument("--epoch", metavar="E", help="with --sample: this epoch (default: the state's)")
    command.add_argument("--rank", metavar="R", help="only rank R's indices")
    command.add_argument(
        "--batch-size", metavar="B", help="for a sampler's state, which has none; with --pipeline, the loader's"
    )
    command.add_argument("--state", metavar="KEY", help="which data state, by the key path `inspect` prints")
    command.add_argument("--json", action="store_true", help="print the answer as JSON")
    command.add_argument("--pipeline", metavar="MODULE:FUNCTION", help=PIPELINE_HELP)
    command.add_argument("--drop-last", action="store_true", help="with --pipeline: the loader's drop_last")


def add_skip(commands: Any) -> None:
    """Register ``skip`` with a subparsers object."""
    command = commands.add_parser(
        "skip",
        help="publish a copy of a checkpoint whose data position skips N batches",
        description="Write step-(N+1), a copy of checkpoint step-N whose data position is moved past N batches "
        "(or to a position) within the epoch, with the skipped range recorded in the state; published "
        "atomically by CheckpointManager, so latest() selects it, and step-N is left as it was. A StreamLoader "
        "state moves with --pipeline (N batches of every rank).",
    )
    command.add_argument("checkpoint", metavar="CHECKPOINT", help="a CheckpointManager step-N folder")
    amount = command.add_mutually_exclusive_group(required=True)
    amount.add_argument("--batches", metavar="N", help="skip N batches (of every rank)")
    amount.add_argument("--to-position", metavar="P", help="skip to global position P of the epoch")
    command.add_argument(
        "--batch-size", metavar="B", help="for a sampler's state, which has none; with --pipeline, the loader's"
    )
    command.add_argument("--state", metavar="KEY", help="which data state, by the key path `inspect` prints")
    command.add_argument("--pipeline", metavar="MODULE:FUNCTION", help=PIPELINE_HELP)
    command.add_argument("--drop-last", action="store_true", help="with --pipeline: the loader's drop_last")


def run_where(args: argparse.Namespace) -> int:
    """Print ``where``'s answer; one ``error:`` line and 1 for a bad input."""
    try:
        n = _ints(args, _INTS)
        positions = _positions(args.positions)
        if n["epoch"] is not None and n["sample"] is None:
            raise ResumeError("--epoch: only with --sample")
        if args.pipeline is not None:
            others = [flag for flag in ("positions", "sample", "epoch") if getattr(args, flag) is not None]
            if others:
                raise ResumeError(
                    f"--{others[0]}: not with --pipeline (a stream's state answers --next N, --previous N and --step S)"
                )
            report: WhereReport | StreamWhereReport = where_stream(
                args.checkpoint,
                load_pipeline(args.pipeline),
                batch_size=n["batch_size"],
                drop_last=args.drop_last,
                next=n["next"],
                previous=n["previous"],
                step=n["step"],
                rank=n["rank"],
                key=args.state,
            )
        elif args.drop_last:
            raise ResumeError("--drop-last: only with --pipeline (a map-style state holds its own)")
        elif n["sample"] is not None:
            report = locate(args.checkpoint, n["sample"], epoch=n["epoch"], batch_size=n["batch_size"], key=args.state)
        else:
            report = where(
                args.checkpoint,
                next=n["next"],
                previous=n["previous"],
                step=n["step"],
                positions=positions,
                rank=n["rank"],
                batch_size=n["batch_size"],
                key=args.state,
            )
    except ResumeError as e:
        return _error(e)
    print(json.dumps(report.as_json(), indent=2) if args.json else "\n".join(report.lines()))
    return 0


def load_pipeline(spec: str) -> Stream:
    """Call ``MODULE:FUNCTION`` (the module imported from the current folder or the path) for a stream."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ResumeError(f"--pipeline: expected MODULE:FUNCTION (e.g. train:build_stream), got {spec!r}")
    if os.getcwd() not in sys.path:  # as `python -m` and `python script.py` find the user's modules
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ResumeError(f"--pipeline: cannot import {module_name!r}: {e}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ResumeError(f"--pipeline: {module_name} has no function {name!r}")
    pipeline = factory()
    if not isinstance(pipeline, Stream):
        raise ResumeError(f"--pipeline: {spec}() returned a {type(pipeline).__name__}, expected a Stream")
    return pipeline


def run_skip(args: argparse.Namespace) -> int:
    """Publish the skipped checkpoint and print its folder; one ``error:`` line and 1 for a bad input."""
    try:
        n = _ints(args, _SKIP_INTS)
        if args.drop_last and args.pipeline is None:
            raise ResumeError("--drop-last: only with --pipeline (a map-style state holds its own)")
        path = skip(
            args.checkpoint,
            batches=n["batches"],
            to_position=n["to_position"],
            batch_size=n["batch_size"],
            key=args.state,
            pipeline=None if args.pipeline is None else load_pipeline(args.pipeline),
            drop_last=args.drop_last,
        )
    except (ResumeError, OSError) as e:
        return _error(e)
    print(f"wrote {path}")
    return 0


def _error(error: Exception) -> int:
    print(f"error: {error}", file=sys.stderr)
    return 1
