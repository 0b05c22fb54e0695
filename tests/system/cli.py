"""The system checks' command line: verify-resume, chaos and gpu-smoke.

python tests/system verify-resume                # killed + resumed == uninterrupted, bitwise
python tests/system verify-resume --nproc 2      # the same under torchrun, plus elastic 2->1 and 2->3
python tests/system chaos --kills 100            # 100 SIGKILLs (mid-write, mid-prune, with workers...) + relaunches
python tests/system chaos --nproc 2 --checkpoint-format dcp --kills 30   # ranks and the torchrun agent too
python tests/system gpu-smoke                    # on a CUDA machine: default run, step time, verify-resume

``python -m trainer verify-resume|chaos|gpu-smoke`` starts the same. ``verify-resume`` takes every
``python -m trainer train`` flag, with smaller defaults.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from resumable_data import ResumeError
from trainer.__main__ import add_threads_flag, add_train_flags, config_from_args, set_threads
from trainer.config import TrainConfig

from .chaos import chaos
from .chaos_distributed import chaos_distributed
from .gpu_smoke import gpu_smoke
from .verify import VERIFY_DEFAULTS, VERIFY_KILL_AT, verify_resume

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python tests/system", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser(
        "verify-resume", help="check that a SIGKILLed and resumed run equals an uninterrupted one"
    )
    add_train_flags(verify, VERIFY_DEFAULTS)
    verify.add_argument(
        "--kill-at-step", type=int, default=VERIFY_KILL_AT, help="the step during which to SIGKILL the run"
    )
    verify.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="run each job under torchrun with this many ranks, plus elastic resumes on 1 and NPROC+1 ranks",
    )
    verify.add_argument(
        "--random-kills",
        type=int,
        default=0,
        metavar="K",
        help="then also run `python -m resumable_data verify` on the same run with K SIGKILLs at random steps",
    )
    add_threads_flag(verify)
    _add_chaos_and_smoke(commands)
    return parser


def _add_chaos_and_smoke(commands: Any) -> None:
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


def _chaos(args: argparse.Namespace) -> int:
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run a check: 0 when it passed, 1 when it failed, 2 for bad input."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "verify-resume":
            set_threads(args.threads)
            return 0 if verify_resume(config_from_args(args), args.kill_at_step, args.nproc, args.random_kills) else 1
        if args.command == "chaos":
            return _chaos(args)
        return 0 if gpu_smoke(args.steps, args.run_dir) else 1
    except (ResumeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
