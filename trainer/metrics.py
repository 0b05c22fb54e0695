"""``RUN_DIR/metrics.jsonl``: one JSON event per line (``start``, ``step``, ``eval``, ``checkpoint``,
``resume``, ``stop``, ``end``), written by rank 0, line-buffered so a kill -9 loses at most a partial line."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["METRICS_FILE", "Metrics", "NoMetrics", "read_metrics"]

METRICS_FILE = "metrics.jsonl"


class Metrics:
    """Appends one JSON line per event to ``path``."""

    def __init__(self, path: Path) -> None:
        self._file: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the run; close() ends it

    def log(self, event: str, **values: Any) -> None:
        self._file.write(json.dumps({"event": event, "time": time.time(), **values}) + "\n")

    def close(self) -> None:
        self._file.close()


class NoMetrics(Metrics):
    """What ranks other than 0 log to: nothing (rank 0 writes the run's one metrics file)."""

    def __init__(self) -> None:
        pass

    def log(self, event: str, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a run's metrics log, oldest first (a line cut off by a kill is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics log at {path}; is {run_dir} a run folder?")
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            events.append(json.loads(line))
    return events
