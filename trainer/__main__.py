"""``python -m trainer``: train (the default), verify-resume, chaos, plot, gpu-smoke.

python -m trainer                              # train the default model; Ctrl-C saves; rerun continues
python -m trainer train --max-steps 1000 --data notes.txt
python -m trainer train --data corpus/         # a folder of .jsonl or .parquet documents, streamed (--text-field)
python -m trainer verify-resume                # killed + resumed == uninterrupted, bitwise
python -m trainer verify-resume --nproc 2      # the same under torchrun, plus elastic 2->1 and 2->3
torchrun --nproc_per_node 2 -m trainer train   # data-parallel training (DDP; gloo on CPU, NCCL on CUDA)
python -m trainer chaos --kills 100            # 100 SIGKILLs (mid-write, mid-prune, with workers...) + relaunches
python -m trainer chaos --nproc 2 --checkpoint-format dcp --kills 30   # ranks and the torchrun agent too
python -m trainer plot runs/default            # runs/default/metrics.png
python -m trainer gpu-smoke                    # on a CUDA machine: default run, step time, verify-resume
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

import torch

from resumable_data import ResumeError

from .config import TrainConfig, flag
from .harness.chaos import chaos
from .harness.chaos_distributed import chaos_distributed
from .harness.gpu_smoke import gpu_smoke
from .harness.verify import VERIFY_DEFAULTS, VERIFY_KILL_AT, verify_resume
from .model import ModelConfig
from .plot import plot_run
from .train import train

# Intra-op threads. One by default: on our shared 2-core machines the default run's steps were
# several times faster with one thread than with torch's default of one per core (see README), and
# a run resumed with another thread count is not guaranteed bitwise equal on CPU. The variable
# carries the choice to the runs verify-resume starts.
THREADS_ENV = "TRAINER_THREADS"
DEFAULT_THREADS = 1


def _add_threads_flag(parser: argparse.ArgumentParser) -> None:
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


def _set_threads(threads: int) -> None:
    if threads < 0:
        raise ValueError(f"--threads should be >= 0, but got --threads {threads}")
    os.environ[THREADS_ENV] = str(threads)  # the runs verify-resume starts use the same count
    if threads:
        torch.set_num_threads(threads)


def _add_train_flags(parser: argparse.ArgumentParser, defaults: Mapping[str, Any]) -> None:
    """One ``--flag`` per TrainConfig field, typed and documented from the dataclass.

    Args:
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


def _config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train_cmd = commands.add_parser("train", help="train (resumes from RUN_DIR's newest checkpoint by default)")
    _add_train_flags(train_cmd, {})
    _add_threads_flag(train_cmd)

    verify = commands.add_parser(
        "verify-resume", help="check that a SIGKILLed and resumed run equals an uninterrupted one"
    )
    _add_train_flags(verify, VERIFY_DEFAULTS)
    verify.add_argument(
        "--kill-at-step", type=int, default=VERIFY_KILL_AT, help="the step during which to SIGKILL the run"
    )
    verify.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="run each job under torchrun with this many ranks, plus elastic resumes on 1 and NPROC+1 ranks",
    )
    _add_threads_flag(verify)
    _add_harness_commands(commands)
    return parser


def _add_harness_commands(commands: Any) -> None:
    """chaos, plot and gpu-smoke: the subcommands that do not train a run of their own flags."""
    chaos_cmd = commands.add_parser(
        "chaos",
        help="SIGKILL a tiny run again and again (mid-write, mid-prune, with workers), relaunch at once, compare",
    )
    chaos_cmd.add_argument("--kills", type=int, default=20, help="SIGKILLs to inject (default: %(default)s)")
    chaos_cmd.add_argument(
        "--run-dir", default="runs/chaos", help="parent folder of the runs, emptied first (default: %(default)s)"
    )
    chaos_cmd.add_argument(
        "--seed", type=int, default=0, help="fixes the kill moments, to replay a session (default: %(default)s)"
    )
    chaos_cmd.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="run each job under torchrun with this many ranks and kill ranks and the agent too (needs --checkpoint-format dcp or dcp-async)",
    )
    chaos_cmd.add_argument(
        "--checkpoint-format", default="dcp", choices=("dcp", "dcp-async"), help="with --nproc (default: %(default)s)"
    )

    plot = commands.add_parser("plot", help="write a PNG of loss and lr over steps, marking resume points")
    plot.add_argument("run_dir", help="a run folder (holds metrics.jsonl)")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")

    smoke = commands.add_parser(
        "gpu-smoke", help="on CUDA: the default run's step time, then verify-resume with deterministic algorithms"
    )
    smoke.add_argument(
        "--steps",
        type=int,
        default=TrainConfig().max_steps,
        help="steps of the default run to time (default: %(default)s)",
    )
    smoke.add_argument("--run-dir", default="runs/gpu-smoke", help="parent folder of the smoke runs")


def main(argv: Sequence[str] | None = None) -> int:
    """Run a subcommand; ``train`` when none is given. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "train")
    args = _parser().parse_args(argv)
    try:
        if args.command in ("train", "verify-resume"):
            _set_threads(args.threads)
        if args.command == "train":
            train(_config(args))
            return 0
        if args.command == "verify-resume":
            return 0 if verify_resume(_config(args), args.kill_at_step, args.nproc) else 1
        if args.command == "chaos":
            report = (
                chaos(args.kills, args.run_dir, seed=args.seed)
                if args.nproc is None
                else chaos_distributed(
                    args.kills, args.run_dir, nproc=args.nproc, checkpoint_format=args.checkpoint_format, seed=args.seed
                )
            )
            print(report.table())
            for failure in report.failures:
                print(f"FAIL: {failure}")
            print("PASS" if report.ok else "FAIL")
            return 0 if report.ok else 1
        if args.command == "plot":
            print(f"wrote {plot_run(args.run_dir, args.out)}")
            return 0
        return 0 if gpu_smoke(args.steps, args.run_dir) else 1
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
