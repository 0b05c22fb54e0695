"""Command line: ``inspect PATH`` and ``demo``.

``inspect`` verifies a checkpoint (manifest, size, sha256) and prints its step, data position (epoch,
position, world size) and sizes; it loads with ``torch.load(weights_only=True)`` only, so nothing in
the file is ever executed, and a bad input gives one ``error:`` line and exit code 1, never a
traceback. ``demo`` shows a loader stopped mid-epoch and resumed exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from .checkpoint.inspect import inspect_checkpoint
from .errors import ResumeError

DESCRIPTION = "Inspect resumable_data checkpoints, or watch a loader resume exactly (demo)."


def inspect(path: str, *, as_json: bool = False) -> int:
    """Print the verified summary of the checkpoint at ``path``; one error line if it is bad.

    Returns:
        0 for a readable checkpoint, 1 for a bad one.
    """
    try:
        report = inspect_checkpoint(path)
        text = json.dumps(report.as_json(), indent=2, sort_keys=True) if as_json else "\n".join(report.lines())
    except ResumeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RecursionError:  # a payload that loads but nests deeper than Python can print
        print(f"error: {path}: the state nests too deeply to print", file=sys.stderr)
        return 1
    print(text)
    return 0


def demo() -> int:
    """Stop a shuffled loader mid-epoch, restore it in a new loader with workers, compare."""
    from .map.dataloader import ResumableDataLoader

    dataset = torch.arange(40)
    reference = [b.tolist() for b in ResumableDataLoader(dataset, batch_size=8, seed=0)]
    loader = ResumableDataLoader(dataset, batch_size=8, seed=0)
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(2)]
    state = loader.state_dict()
    print("stopped after 2 batches:", head)
    print("state:", json.dumps(state))
    resumed = ResumableDataLoader(dataset, batch_size=8, seed=0, num_workers=2)
    resumed.load_state_dict(state)
    tail = [b.tolist() for b in resumed]
    print("resumed with num_workers=2:", tail)
    identical = head + tail == reference
    print("identical to the uninterrupted epoch:", identical)
    return 0 if identical else 1


def _program_name() -> str:
    """``resumable-data`` when run as the console script, ``python -m resumable_data`` otherwise."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m resumable_data" if name in ("", "__main__.py", "-c") else name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=_program_name(), description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    inspect_parser = commands.add_parser(
        "inspect",
        help="verify a checkpoint and print its step, data position and sizes",
        description="Verify a checkpoint (manifest, size, sha256) and print its step, epoch, position, "
        "world size and sizes. PATH is a step-N folder or a state file; a bad one gives one error line "
        "and exit code 1. Loading uses weights_only, so nothing in the file is executed.",
    )
    inspect_parser.add_argument(
        "path", metavar="PATH", help="a step-N checkpoint folder (CheckpointManager or DcpStore) or a state.pt file"
    )
    inspect_parser.add_argument("--json", action="store_true", help="print the report as JSON")
    commands.add_parser("demo", help="stop a loader mid-epoch and resume it exactly")
    args = parser.parse_args(argv)
    return inspect(args.path, as_json=args.json) if args.command == "inspect" else demo()


if __name__ == "__main__":
    sys.exit(main())
