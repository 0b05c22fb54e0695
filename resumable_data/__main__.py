"""Command line: ``python -m resumable_data inspect PATH`` and ``python -m resumable_data demo``.

``inspect`` prints the data-position parts of a checkpoint (every nested dict that carries a
``version``, ``epoch`` and ``position``) as JSON, without unpickling anything: the file is read with
``torch.load(weights_only=True)``. ``demo`` shows a loader stopped mid-epoch and resumed exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ._state import EPOCH, POSITION, VERSION


def _data_states(obj: Any, path: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    if isinstance(obj, Mapping):
        if {VERSION, EPOCH, POSITION} <= obj.keys():
            yield path or "<root>", obj
        for key, value in obj.items():
            yield from _data_states(value, f"{path}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _data_states(value, f"{path}/{i}")


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return f"<tensor {tuple(obj.shape)} {obj.dtype}>"
    return obj


def inspect(path: str) -> int:
    """Print every data-position state found in the checkpoint at ``path``."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    found = {where: _plain(s) for where, s in _data_states(state)}
    if not found:
        print(f"no data-position state (a dict with version, epoch, position) in {path}", file=sys.stderr)
        return 1
    print(json.dumps(found, indent=2, sort_keys=True))
    return 0


def demo() -> int:
    """Stop a shuffled loader mid-epoch, restore it in a new loader with workers, compare."""
    from .dataloader import ResumableDataLoader

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resumable_data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    inspect_parser = commands.add_parser("inspect", help="print the data position stored in a checkpoint")
    inspect_parser.add_argument("path")
    commands.add_parser("demo", help="stop a loader mid-epoch and resume it exactly")
    args = parser.parse_args(argv)
    return inspect(args.path) if args.command == "inspect" else demo()


if __name__ == "__main__":
    sys.exit(main())
