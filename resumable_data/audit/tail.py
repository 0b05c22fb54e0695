"""Follow a running launch's audit files, to SIGKILL it once it has reached a given step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from .compare import Launch
from .records import BATCH, LOG

__all__ = ["Point", "Watch"]

Point = tuple[str, Any]  # (LOG, step) or (BATCH, a batch's key): one step of rank 0, in the reference's order


class Watch:
    """How far a launch has come, in the reference run's steps, from the lines its rank 0 has written."""

    def __init__(self, folder: Path, points: list[Point], target: int) -> None:
        self._folder = folder
        self._index = {point: i for i, point in enumerate(points)}
        self._target = target
        self._files: dict[Path, tuple[IO[str], list[str]]] = {}  # each file, and its unfinished line
        self._kind = points[0][0]
        self.furthest = -1
        self.killed = False

    @property
    def reached(self) -> str:
        return f"{'step' if self._kind == LOG else 'batch'} {self.furthest + 1}"

    @staticmethod
    def points(reference: Launch) -> list[Point]:
        """Rank 0's steps in the reference: its logged steps, else the batches of its busiest loader."""
        steps = sorted(key[0] for key in reference.units if key[1] == 0)
        if steps:
            return [(LOG, step) for step in steps]
        streams = [batches for (rank, _), batches in sorted(reference.streams.items()) if rank == 0]
        return [(BATCH, batch.key) for batch in max(streams, key=len)] if streams else []

    def reached_target(self) -> bool:
        """Read the lines written since the last call; True once rank 0 reached the target step."""
        self._read()
        return self.furthest >= self._target

    def finish(self) -> None:
        """Read what the launch wrote up to its end, then close: a kill lands a little after the target
        was seen (a loaded machine runs a step or two more), and :attr:`reached` says where it landed."""
        self._read()
        self.close()

    def _read(self) -> None:
        for path in self._folder.glob("rank0-*.jsonl") if self._folder.is_dir() else []:
            if path not in self._files:
                self._files[path] = (open(path, encoding="utf-8"), [""])  # noqa: SIM115  # closed in close()
            handle, partial = self._files[path]
            text = partial[0] + handle.read()
            *lines, partial[0] = text.split("\n")  # a line cut by the kill stays unfinished: not seen
            for line in lines:
                self._see(json.loads(line))

    def _see(self, record: dict[str, Any]) -> None:
        if record.get("kind") == LOG and self._kind == LOG:
            point: Point = (LOG, int(record["step"]))
        elif record.get("kind") == BATCH and self._kind == BATCH:
            position = json.dumps(record["position"])
            point = (BATCH, (record.get("loader"), int(record["rank"]), int(record["epoch"]), position))
        else:
            return
        self.furthest = max(self.furthest, self._index.get(point, -1))

    def close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files.clear()
