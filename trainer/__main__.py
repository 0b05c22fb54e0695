"""``python -m trainer``: train (the default) and plot; the system checks run from ``tests/system/``.

python -m trainer                              # train the default model; Ctrl-C saves; rerun continues
python -m trainer train --max-steps 1000 --data notes.txt
python -m trainer train --data corpus/         # a folder of .jsonl or .parquet documents, streamed (--text-field)
python -m trainer train --data s3://bucket/tokens/   # token shards from write-shards (index.json), streamed
torchrun --nproc_per_node 2 -m trainer train   # data-parallel training (DDP; gloo on CPU, NCCL on CUDA)
python -m trainer plot runs/default            # runs/default/metrics.png

The system checks are test instrumentation and live with the tests, off this reading path; these
commands start them (``python tests/system --help``) in a process of their own:

python -m trainer verify-resume                # killed + resumed == uninterrupted, bitwise
python -m trainer verify-resume --nproc 2      # the same under torchrun, plus elastic 2->1 and 2->3
python -m trainer chaos --kills 100            # 100 SIGKILLs (mid-write, mid-prune, with workers...) + relaunches
python -m trainer gpu-smoke                    # on a CUDA machine: default run, step time, verify-resume
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from resumable_data import ResumeError

from .config import TrainConfig, flag
from .model import ModelConfig
from .plot import plot_run
from .train import train

# Intra-op threads. One by default: on our shared 2-core machines the default run's steps were
# several times faster with one thread than with torch's default of one per core (see README), and
# a run resumed with another thread count is not guaranteed bitwise equal on CPU. The variable
# carries the choice to the runs verify-resume starts.
THREADS_ENV = "TRAINER_THREADS"
DEFAULT_THREADS = 1
# The commands of the system checks (tests/system/__main__.py), started as `python tests/system ...`.
SYSTEM_CHECKS = ("verify-resume", "chaos", "gpu-smoke")
SYSTEM_CHECKS_DIR = Path(__file__).resolve().parents[1] / "tests" / "system"


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    """``--threads``, whose default ``$TRAINER_THREADS`` overrides."""
    raw = os.environ.get(THREADS_ENV)
    try:
        default = DEFAULT_THREADS if raw is None else int(raw)
    except ValueError:
        parser.error(f"${THREADS_ENV} should be an integer, but got {raw!r}")
    parser.add_argument(
        "--threads",
        type=int,
        default=default,
        help=f"torch intra-op CPU threads (default: %(default)s; ${THREADS_ENV} overrides). Keep it the same "
        "across a resume for bitwise equal CPU runs; 0 lets torch choose (one per core)",
    )


def set_threads(threads: int) -> None:
    """Use ``threads`` intra-op threads here and in the trainer processes started from here.

    Raises:
        ValueError: ``threads`` is negative.
    """
    if threads < 0:
        raise ValueError(f"--threads should be >= 0, but got --threads {threads}")
    os.environ[THREADS_ENV] = str(threads)  # the runs verify-resume starts use the same count
    if threads:
        torch.set_num_threads(threads)


def add_train_flags(parser: argparse.ArgumentParser, defaults: Mapping[str, Any]) -> None:
    """One ``--flag`` per TrainConfig field, typed and documented from the dataclass.

    Args:
        parser: the (sub)command's parser.
        defaults: values that replace the dataclass defaults for this subcommand.
    """
    hints = typing.get_type_hints(TrainConfig)
    new_model = {f.name: f.default for f in fields(ModelConfig)}
    for f in fields(TrainConfig):
        name = flag(f.name)
        kind = hints[f.name]
        default = defaults.get(f.name, f.default)
        if default is None and f.name in new_model:
            shown = f" (default: the checkpoint's on resume, else {new_model[f.name]})"
        else:
            shown = "" if default is None else f" (default: {default})"
        if kind is bool:
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"])
            continue
        # "int | None" -> int: None is the default, never typed on the command line.
        value_type = next(t for t in typing.get_args(kind) if t is not type(None)) if typing.get_args(kind) else kind
        parser.add_argument(name, type=value_type, default=default, help=f.metadata["help"] + shown)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed :func:`add_train_flags` flags."""
    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train_cmd = commands.add_parser("train", help="train (resumes from RUN_DIR's newest checkpoint by default)")
    add_train_flags(train_cmd, {})
    add_threads_flag(train_cmd)

    plot = commands.add_parser("plot", help="write a PNG of loss and lr over steps, marking resume points")
    plot.add_argument("run_dir", help="a run folder (holds metrics.jsonl)")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    for name in SYSTEM_CHECKS:
        commands.add_parser(name, help="a system check: see python tests/system --help", add_help=False)
    return parser


def _run_system_check(argv: list[str]) -> int:
    """``python tests/system ARGV``: the trainer never imports its test instrumentation."""
    with subprocess.Popen([sys.executable, str(SYSTEM_CHECKS_DIR), *argv]) as check:
        while True:
            try:
                return check.wait()
            except KeyboardInterrupt:  # Ctrl-C reaches the check too; its exit code answers it
                continue


def main(argv: Sequence[str] | None = None) -> int:
    """Run a subcommand; ``train`` when none is given. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "train")
    if argv[0] in SYSTEM_CHECKS:
        return _run_system_check(argv)
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            set_threads(args.threads)
            train(config_from_args(args))
        else:
            print(f"wrote {plot_run(args.run_dir, args.out)}")
        return 0
    except (ResumeError, ValueError, OSError) as e:
        # ResumeError covers a locked run folder (CheckpointLockedError) and corrupt checkpoints;
        # OSError a checkpoint that cannot be written (disk full, read-only) or a missing file.
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C while training: the user chose not to wait for the save
        print("interrupted without saving; the newest checkpoint is the last one written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
