"""``python -m resumable_data verify [options] -- COMMAND ...``: the command line of :func:`verify`."""

from __future__ import annotations

import argparse
from typing import Any

from .verifier import verify

__all__ = ["add_verify", "run_verify"]


def add_verify(commands: Any) -> None:
    """Add the ``verify`` subcommand to an argparse subparsers object."""
    command = commands.add_parser(
        "verify",
        help="run a training command uninterrupted and SIGKILLed + relaunched; compare every step bitwise",
        description="Run COMMAND once uninterrupted, then SIGKILL it at random steps and relaunch it (it must "
        "resume by itself, e.g. --resume auto), each run in a fresh folder ({run_dir} in COMMAND is replaced by "
        "it, and it is the working directory). The loaders record what each step consumed; values logged "
        "with resumable_data.audit.log(step, loss=..., lr=...) are compared too. Prints PASS, or the first "
        "step that differs and its likely cause, and exits 1.",
    )
    command.add_argument("--kills", type=int, default=3, metavar="K", help="SIGKILLs in the interrupted series (3)")
    command.add_argument("--seed", type=int, default=0, metavar="S", help="chooses the kill steps (0)")
    command.add_argument(
        "--workers-flag",
        default=None,
        metavar="FLAG",
        help="arguments that turn DataLoader workers on, e.g. '--num-workers 2': a second series runs with them",
    )
    command.add_argument("--timeout", type=float, default=600.0, metavar="T", help="seconds per launch (600)")
    command.add_argument("--work-dir", default=None, help="an empty or new folder for the runs (a temporary one)")
    command.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="the training command")


def run_verify(args: argparse.Namespace) -> int:
    """Run ``verify`` for parsed arguments; 0 on PASS, 1 on FAIL, 2 on a bad command line."""
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print("error: verify needs a command after --, e.g. verify -- python train.py --resume auto")
        return 2
    try:
        result = verify(
            argv,
            kills=args.kills,
            seed=args.seed,
            workers_flag=args.workers_flag,
            timeout=args.timeout,
            work_dir=args.work_dir,
        )
    except ValueError as e:
        print(f"error: {e}")
        return 2
    return 0 if result.passed else 1
