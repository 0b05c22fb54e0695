"""Command line: ``inspect PATH``, ``where`` and ``skip`` (``position.cli``), ``verify`` (``audit.cli``),
``write-shards`` and ``demo``.

``inspect`` verifies a checkpoint (manifest, size, sha256) and prints its step, data position (epoch,
position, world size) and sizes; it loads with ``torch.load(weights_only=True)`` only, so nothing in
the file is ever executed, and a bad input gives one ``error:`` line and exit code 1, never a
traceback. ``write-shards`` writes JSONL documents as token shards and their index
(:func:`~resumable_data.streams.write_token_shards`). ``demo`` shows a loader stopped mid-epoch
and resumed exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from .audit.cli import add_verify, run_verify
from .checkpoint.inspect import inspect_checkpoint
from .errors import ResumeError
from .position import cli as position_cli
from .streams.write import SHARD_NAME, jsonl_documents, write_token_shards

DESCRIPTION = (
    "Inspect resumable_data checkpoints, see which batch reads which sample (where), skip a bad stretch "
    "(skip), prove a training script resumes exactly (verify), write token shards, or watch a loader resume "
    "exactly (demo)."
)


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


def write_shards(args: argparse.Namespace) -> int:
    """Write the ``--input`` JSONL files' documents as token shards in ``--dest``; one error line if bad.

    Returns:
        0 when the shards and their index are written, 1 otherwise (nothing indexed then).
    """
    tokenize = (lambda text: list(str(text).encode())) if args.bytes else None  # UTF-8 bytes as tokens
    documents = jsonl_documents(args.input, field=args.field, tokenize=tokenize)
    try:
        index = write_token_shards(
            documents,
            args.dest,
            shard_tokens=args.shard_tokens,
            dtype=args.dtype,
            format=args.format,
            eos=args.eos,
            name=args.name,
            overwrite=args.overwrite,
        )
    except (ValueError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(index)
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
    _add_write_shards(commands)
    commands.add_parser("demo", help="stop a loader mid-epoch and resume it exactly")
    position_cli.add_where(commands)
    position_cli.add_skip(commands)
    add_verify(commands)
    args = parser.parse_args(argv)
    if args.command == "verify":
        return run_verify(args)
    if args.command == "inspect":
        return inspect(args.path, as_json=args.json)
    if args.command in ("where", "skip"):
        return position_cli.run_where(args) if args.command == "where" else position_cli.run_skip(args)
    return write_shards(args) if args.command == "write-shards" else demo()


def _add_write_shards(commands: Any) -> None:
    command = commands.add_parser(
        "write-shards",
        help="write JSONL documents as token shards and their index file",
        description="Write the documents of JSONL files as token shards of --shard-tokens tokens each (a "
        "document may span two shards), then an index.json that ShardedIterable.from_index reads. A "
        "folder whose writing stopped part way has no index. Prints the index's location.",
    )
    command.add_argument("--input", nargs="+", required=True, metavar="FILE", help="JSONL files, read in order")
    command.add_argument(
        "--field", required=True, help="the field holding each document's token ids (or its text, with --bytes)"
    )
    command.add_argument("--dest", required=True, help="a folder, or a URL through fsspec (the remote extra)")
    command.add_argument("--shard-tokens", type=int, required=True, metavar="N", help="tokens per shard")
    command.add_argument("--eos", type=int, default=None, metavar="ID", help="a token appended after each document")
    command.add_argument("--dtype", choices=("uint8", "uint16", "uint32", "int32", "int64"), default="uint16")
    command.add_argument("--format", choices=("bin", "npy"), default="bin")
    command.add_argument(
        "--bytes",
        action="store_true",
        help="the field is text: its UTF-8 bytes are the tokens (0..255; e.g. --eos 256, as the reference trainer)",
    )
    command.add_argument("--name", default=SHARD_NAME, help="shard file name pattern, without suffix")
    command.add_argument("--overwrite", action="store_true", help="replace the dataset in --dest")


if __name__ == "__main__":
    sys.exit(main())
