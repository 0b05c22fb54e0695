"""What the three benchmarks share: the machine header, isolated cells, datasets, tables and plots.

Each measurement ("cell") runs in a fresh process forked from a server that has already imported
torch, so cells cannot disturb each other (allocator state, warmed caches, leaked workers) and a
cell's peak memory is its own, while a cell still starts in milliseconds rather than the seconds a
``python -c "import torch"`` takes.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import multiprocessing
import multiprocessing.connection
import os
import platform
import resource
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# The benchmarks run from a checkout (``python benchmarks/bench_x.py``): measure the package in this
# tree, installed or not.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
# Modules the cell server imports once, so that every forked cell has them for free.
_PRELOAD = ["torch", "numpy", "torchdata.stateful_dataloader", "torchdata.nodes", "resumable_data", "_common"]

# Each sample is a small int64 tensor: [index, busy-work result, index, index, ...]. Its first
# element identifies the sample, which is what the exactness checks compare.
SAMPLE_WIDTH = 16


# -- command line and header -----------------------------------------------------------------------


def parse_args(
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    *,
    fork_when_quick: bool = True,
) -> argparse.Namespace:
    """The options every benchmark takes (``--quick``, ``--out``) plus its own; with
    ``fork_when_quick=False`` a quick run's cells start from the forkserver too."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, < 1 minute: a smoke test of every method and check"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"where to write the .md table and .png plots (default: {RESULTS_DIR}; with --quick a temp dir)",
    )
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    if args.quick and fork_when_quick:
        # A smoke test times nothing that matters, so its cells may fork from this process, which
        # has imported torch already, rather than from a forkserver that imports it a second time
        # (seconds on a loaded machine).
        global _start_method
        _start_method = "fork"
    if args.out is None:
        # A quick run is a smoke test: it must not overwrite the committed results of a full run.
        args.out = Path(tempfile.mkdtemp(prefix="bench-quick-")) if args.quick else RESULTS_DIR
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _load_average() -> str:
    if not hasattr(os, "getloadavg"):
        return "unknown"
    return ", ".join(f"{load:.1f}" for load in os.getloadavg())


def machine_header(title: str) -> str:
    """A markdown heading plus the machine, the library versions, the date and the exact command."""
    import numpy
    import torchdata

    import resumable_data

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    command = shlex.join(["python", *sys.argv])
    return "\n".join(
        [
            f"# {title}",
            "",
            f"- machine: {os.cpu_count()} CPUs ({usable} usable), {_cpu_model()}, {platform.system()} {platform.release()}",
            f"- versions: python {platform.python_version()}, torch {torch.__version__}, "
            f"torchdata {torchdata.__version__}, numpy {numpy.__version__}, resumable_data {resumable_data.__version__}",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- load average at the end (1, 5, 15 min): {_load_average()} (other jobs on the machine inflate every figure)",
            f"- command: `{command}`",
            "",
        ]
    )


# -- isolated cells ------------------------------------------------------------------------------

_context: Any = None
_start_method = "forkserver"  # "fork" for --quick (see parse_args)


def _cell_context() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context(_start_method)
        if _start_method == "forkserver":
            _context.set_forkserver_preload(_PRELOAD)
    return _context


def _cell_entry(
    conn: multiprocessing.connection.Connection,
    start_method: str,
    fn: Callable[..., dict[str, Any]],
    kwargs: dict[str, Any],
) -> None:
    # A forkserver child inherits "forkserver" as its default start method; DataLoader and
    # torchdata.nodes workers must start the way they would in the user's own main process.
    multiprocessing.set_start_method(start_method, force=True)
    try:
        result = fn(**kwargs)
    except Exception as e:  # a failing cell is a result to report in the table, not a crash of the run
        result = {"error": f"{type(e).__name__}: {e}"}
    conn.send(result)
    conn.close()


def run_isolated(fn: Callable[..., dict[str, Any]], kwargs: Mapping[str, Any], *, timeout_s: float) -> dict[str, Any]:
    """Run ``fn(**kwargs)`` in a fresh process; its returned dict, or ``{"error": ...}``.

    ``fn`` must be a module-level function (it is pickled by name). The process is not a daemon, so
    the cell may start DataLoader workers of its own.
    """
    ctx = _cell_context()
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_cell_entry, args=(sender, multiprocessing.get_start_method(), fn, dict(kwargs)))
    process.start()
    sender.close()
    try:
        if receiver.poll(timeout_s):
            result = receiver.recv()
        else:
            process.kill()
            result = {"error": f"killed after {timeout_s:.0f} s without a result"}
    except EOFError:
        result = {"error": "the cell process died without a result"}
    process.join()
    if "error" not in result and process.exitcode not in (0, None):
        result["note"] = (result.get("note", "") + f" (exit code {process.exitcode})").strip()
    return result


class PeakMemory:
    """Growth of this process's peak resident memory (RSS) from :meth:`start` on, in MB.

    tracemalloc does not see torch's allocations, so this reads the kernel's high-water mark. On
    Linux the mark is reset at :meth:`start` (``/proc/self/clear_refs``), so what an earlier phase of
    the cell allocated and freed does not hide what the measured phase allocates.
    """

    def __init__(self) -> None:
        self._base_kb = 0
        self._resettable = False

    @staticmethod
    def _status_kb(field: str) -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        return int(line.split()[1])
        except OSError:
            pass
        return None

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # 5: reset the peak RSS to the current RSS
            self._resettable = True
        except OSError:
            self._resettable = False
        current = self._status_kb("VmRSS") if self._resettable else None
        self._base_kb = current if current is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def peak_mb(self) -> float:
        peak = self._status_kb("VmHWM") if self._resettable else None
        if peak is None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return max(0, peak - self._base_kb) / 1024


def timed_epoch(loader: Iterable[Any], record_ids: Callable[[Any], list[int]], n: int) -> dict[str, Any]:
    """One epoch of ``loader``, timed after a garbage collection: ``{"seconds": ...}``, or an error when its
    batches (``record_ids(batch)`` of each) did not hold each record id ``0 .. n - 1`` once."""
    gc.collect()
    start = time.perf_counter()
    seen = [i for batch in loader for i in record_ids(batch)]
    elapsed = time.perf_counter() - start
    if sorted(seen) != list(range(n)):
        return {"error": "an epoch did not yield every record once"}
    return {"seconds": elapsed}


def repeat_timed(once: Callable[[], float], *, max_reps: int, fast_s: float = 1.0) -> tuple[float, int]:
    """Median of up to ``max_reps`` runs of ``once`` (which returns its own measured seconds).

    A slow first run is not repeated: its noise is small relative to its length, and repeating it
    would multiply the runtime of the whole benchmark.
    """
    times = [once()]
    while len(times) < max_reps and times[0] < fast_s:
        times.append(once())
    return statistics.median(times), len(times)


# -- datasets ------------------------------------------------------------------------------------


def busy_work(index: int, iterations: int) -> int:
    """A deterministic compute loop (a 64-bit LCG) standing in for decoding a sample."""
    x = index
    for _ in range(iterations):
        x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
    return x >> 1  # fits an int64


def calibrate_work(target_us: float) -> int:
    """LCG iterations that take about ``target_us`` microseconds here (0 for no work)."""
    if target_us <= 0:
        return 0
    probe = 20_000
    best = min(_time_call(busy_work, 1, probe) for _ in range(3))
    return max(1, round(probe * target_us * 1e-6 / best))


def _time_call(fn: Callable[..., Any], *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


class SyntheticDataset(torch.utils.data.Dataset):
    """``length`` samples computed from their index, so 10^7 samples allocate nothing up front.

    Args:
        length: number of samples.
        work_iterations: busy-work per ``__getitem__`` (see :func:`calibrate_work`); 0 for none.
    """

    def __init__(self, length: int, work_iterations: int = 0) -> None:
        self.length = length
        self.work_iterations = work_iterations

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        sample = torch.full((SAMPLE_WIDTH,), int(index), dtype=torch.int64)
        if self.work_iterations:
            sample[1] = busy_work(int(index), self.work_iterations)
        return sample


def seeded_generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


# -- the loaders compared, built the way their documentation shows -------------------------------
# Each baseline gets an explicit seeded sampler, so that its order is reproducible and can be
# checked; that is also what a user who wants to resume has to do.


# ``loader_kwargs`` go to the loader's constructor unchanged (e.g. ``collate_fn``).


def plain_loader(
    dataset: Sized, *, batch_size: int, seed: int, workers: int, **loader_kwargs: Any
) -> torch.utils.data.DataLoader:
    sampler = torch.utils.data.RandomSampler(dataset, generator=seeded_generator(seed))
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, **loader_kwargs
    )


def stateful_loader(dataset: Sized, *, batch_size: int, seed: int, workers: int, **loader_kwargs: Any) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    sampler = RandomSampler(dataset, generator=seeded_generator(seed))
    return StatefulDataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, **loader_kwargs)


def resumable_loader(dataset: Sized, *, batch_size: int, seed: int, workers: int, **loader_kwargs: Any) -> Any:
    from resumable_data import ResumableDataLoader

    return ResumableDataLoader(
        dataset, batch_size=batch_size, shuffle=True, seed=seed, num_workers=workers, **loader_kwargs
    )


# -- tables and plots ----------------------------------------------------------------------------


def format_seconds(seconds: float) -> str:
    if seconds < 1e-6:
        return f"{seconds * 1e9:.0f} ns"
    if seconds < 1e-5:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def parse_seconds(text: str) -> float:
    """The inverse of :func:`format_seconds` ("335.7 ms" -> 0.3357), for re-reading a results table."""
    value, unit = text.split()
    return float(value) * {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1.0}[unit]


def format_count(n: int) -> str:
    """10^k for powers of ten (how the sizes are quoted), else the plain number."""
    exponent = len(str(n)) - 1
    return f"10^{exponent}" if n == 10**exponent and exponent >= 3 else f"{n:,}"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def parse_markdown_rows(text: str, first_header: str) -> list[dict[str, str]]:
    """The rows of the table in ``text`` whose first column is ``first_header``, as dicts."""
    rows: list[dict[str, str]] = []
    headers: list[str] | None = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            headers = None
        elif headers is None:
            headers = cells if cells[0] == first_header else []
        elif headers and not set(line) <= set("|-: "):
            rows.append(dict(zip(headers, cells, strict=False)))
    return rows


def write_report(out: Path, name: str, text: str) -> Path:
    path = out / f"{name}.md"
    path.write_text(text + "\n")
    print(f"\nwrote {path}")
    return path


def plot_lines(
    path: Path,
    panels: Sequence[tuple[str, Mapping[str, Sequence[tuple[float, float, bool]]]]],
    *,
    xlabel: str,
    ylabel: str,
    xscale: str = "log",
    xlim: tuple[float, float] | None = None,
    not_run: Mapping[str, Sequence[tuple[float, str]]] | None = None,
    not_run_label: str = "not run",
) -> None:
    """One panel per ``(title, {method: [(x, y, extrapolated), ...]})``, one line per method.

    All panels share one log y axis, so a panel's scale cannot make run-to-run noise (tens of
    percent on a shared machine) look like a trend: what is far apart is orders of magnitude apart.
    Extrapolated points (a baseline cell that hit its deadline) are drawn hollow, so an estimate is
    never mistaken for a measurement. ``not_run`` maps a panel title to ``(x, method)`` cells that
    were deliberately not run; they are marked with a cross at the top of the panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.lines
    import matplotlib.pyplot as plt

    # One color per method across all panels, so a method looks the same everywhere.
    colors = {method: f"C{i}" for i, method in enumerate(dict.fromkeys(m for _, series in panels for m in series))}
    columns = min(2, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.4 * columns, 4.4 * rows), squeeze=False, sharey=True)
    for ax, (title, series) in zip(axes.flat, panels, strict=False):
        for method, points in series.items():
            if not points:
                continue
            color = colors[method]
            xs, ys, hollow = zip(*sorted(points), strict=False)
            ax.plot(xs, ys, "-", color=color, label=method)
            for x, y, extrapolated in zip(xs, ys, hollow, strict=False):
                ax.plot(x, y, "o", color=color, markerfacecolor="white" if extrapolated else color)
        skipped = (not_run or {}).get(title, ())
        for i, (x, method) in enumerate(skipped):
            # y in axes coordinates: the cross sits at the top whatever the data's range.
            ax.plot(
                x,
                0.96 - 0.04 * (i % 4),
                "x",
                color=colors.get(method, "black"),
                markersize=8,
                mew=2,
                transform=ax.get_xaxis_transform(),
                clip_on=False,
            )
        if skipped:
            ax.text(0.02, 0.97, f"× {not_run_label}", transform=ax.transAxes, fontsize=8, va="top")
        if xscale == "symlog":
            ax.set_xscale("symlog", linthresh=1)
        else:
            ax.set_xscale(xscale)
        if xlim is not None:
            ax.set_xlim(*xlim)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.yaxis.set_tick_params(labelleft=True)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    # One legend for the figure (a method has one color everywhere), below the panels, so it hides no line.
    handles = [
        matplotlib.lines.Line2D([], [], color=color, marker="o", label=method) for method, color in colors.items()
    ]
    fig.legend(
        handles=handles,
        loc="lower center",
        ncol=min(4, len(handles)),
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 0.015),
    )
    fig.text(
        0.01,
        0.005,
        "hollow marker: extrapolated (the cell stopped at its deadline); all panels share one log y axis",
        fontsize=8,
    )
    legend_rows = -(-len(handles) // 4)
    fig.tight_layout(rect=(0, 0.02 + 0.03 * legend_rows * 4.4 / (4.4 * rows), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def plot_bars(
    path: Path,
    title: str,
    groups: Mapping[str, Mapping[str, float]],
    *,
    ylabel: str,
    reference: float | None = None,
    spreads: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
    value_format: str = "{:.3f}",
    ymax: float | None = None,
) -> None:
    """Grouped bars: ``{group: {method: value}}``, each bar labelled with its value.

    The y axis starts at 0, so a bar's height is proportional to its value and a few percent look
    like a few percent. ``spreads`` (``{group: {method: (low, high)}}``) draws each bar's range as
    an error bar; ``reference`` draws a dashed line (e.g. 1.0 for a ratio). ``ymax`` caps the axis
    (error bars beyond it run off the top), so one wild round does not flatten every bar.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(m for values in groups.values() for m in values))
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(7.5, 0.4 * len(groups) * len(methods) + 2), 5.2))
    for i, method in enumerate(methods):
        members = [(g, group) for g, group in enumerate(groups) if method in groups[group]]
        xs = [g + i * width for g, _ in members]
        ys = [groups[group][method] for _, group in members]
        bars = ax.bar(xs, ys, width=width, label=method, color=f"C{i}")
        if spreads is not None:
            ranges = [(spreads.get(group, {}).get(method, (y, y))) for (_, group), y in zip(members, ys, strict=False)]
            low = [max(0.0, y - lo) for (lo, _), y in zip(ranges, ys, strict=False)]
            high = [max(0.0, hi - y) for (_, hi), y in zip(ranges, ys, strict=False)]
            ax.errorbar(xs, ys, yerr=[low, high], fmt="none", ecolor="black", elinewidth=0.8, capsize=2)
        for bar, y in zip(bars, ys, strict=False):
            # On the bar's own top (not the error bar's), on white, so it reads even where a range crosses it.
            clipped = ymax is not None and y > ymax
            ax.annotate(
                value_format.format(y) + (" ↑" if clipped else ""),
                (bar.get_x() + bar.get_width() / 2, ymax * 0.85 if clipped else y),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7,
                rotation=90 if len(methods) > 3 else 0,
                bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
            )
    if reference is not None:
        ax.axhline(reference, color="black", linestyle="--", linewidth=0.8)
    ax.margins(y=0.15)
    ax.set_ylim(bottom=0, top=ymax)
    ax.set_xticks([g + width * (len(methods) - 1) / 2 for g in range(len(groups))], list(groups))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(3, len(methods)), frameon=False)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
