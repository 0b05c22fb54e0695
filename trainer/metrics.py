"""What a run reports: ``RUN_DIR/metrics.jsonl`` (one JSON event per line: ``start``, ``step``, ``eval``,
``checkpoint``, ``resume``, ``stop``, ``end``; rank 0, line-buffered so a kill -9 loses at most a
partial line), and the progress bar."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"
# The bar's width where the terminal reports none (0 columns) or the bar goes to a file or a pipe.
FALLBACK_COLUMNS = 100


class Metrics(contextlib.AbstractContextManager["Metrics"]):
    """Appends one JSON line per event to ``path``; with None (ranks other than 0) logs nothing."""

    def __init__(self, path: Path | None) -> None:
        self._file: TextIO | None = None if path is None else open(path, "a", buffering=1)  # noqa: SIM115 - for the run

    def log(self, event: str, **values: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": event, "time": time.time(), **values}) + "\n")

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()


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


def format_lr(lr: float) -> str:
    """A learning rate as every line of the trainer prints it (the bar and the resume line alike)."""
    return f"{lr:.3e}"


class Progress(contextlib.AbstractContextManager["Progress"]):
    """A tqdm bar of optimizer steps with the loss, learning rate and throughput beside it.

    Redrawn once per update, with the step count and the values together. Its fields have fixed
    widths and are there from the first draw, so the bar keeps its length; a terminal that reports
    no width (tqdm would draw nothing) or a file gets ``FALLBACK_COLUMNS``.
    """

    def __init__(self, total: int, initial: int, *, enabled: bool) -> None:
        try:
            columns = os.get_terminal_size(sys.stderr.fileno()).columns
        except (AttributeError, OSError, ValueError):  # not a terminal (a file, a pipe, a test's capture)
            columns = 0
        self._bar = tqdm(
            total=total,
            initial=initial,
            disable=not enabled,
            unit="step",
            dynamic_ncols=columns > 0,  # follows a resized terminal
            ncols=None if columns > 0 else FALLBACK_COLUMNS,
            nrows=None if columns > 0 else 24,  # tqdm would take -1 from such a terminal, and hide the bar
            postfix=self._fields("-", "-", "-"),
        )

    @staticmethod
    def _fields(loss: str, lr: str, tokens_per_second: str) -> str:
        return f"loss={loss:>7}, lr={lr:>9}, tok/s={tokens_per_second:>9}"

    def update(self, steps: int, loss: float, lr: float, tokens_per_second: float) -> None:
        """``steps`` more steps done; the last one's loss and learning rate, the current throughput."""
        self._bar.set_postfix_str(
            self._fields(f"{loss:.4f}", format_lr(lr), f"{tokens_per_second:,.0f}"), refresh=False
        )
        self._bar.update(steps)

    def close(self) -> None:
        self._bar.close()

    def __exit__(self, *exc: object) -> None:
        self.close()
