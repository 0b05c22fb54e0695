"""A checkpoint inside a gradient-accumulation window: re-read the window from its start, or save the gradient.

A checkpoint written after micro-batch ``k`` of a window of ``GA`` holds the weights, optimizer and
scheduler of the window's start (nothing stepped since); two routes make its resume exact:

1. **window start** (:class:`resumable_data.accumulation.AccumulationWindow`): save the loader
   state and the RNG states of the window's start; the resumed run reads the window's first ``k``
   micro-batches again and recomputes the gradient before the remaining ``GA - k``.
2. **saved gradient**: save every ``param.grad`` (the gradient accumulated over ``k`` micro-batches)
   with the loader and RNG states of the save; the resumed run loads them and trains only the
   remaining ``GA - k`` micro-batches.

For the reference trainer's GPT at two sizes and ``GA`` in {2, 4, 8}, this measures the checkpoint's
bytes beyond a boundary checkpoint's (model, AdamW, loader, RNGs) and its save time (``torch.save``
plus ``fsync``), which do not depend on ``GA`` or ``k``, and the resume cost: from ``torch.load``
of the checkpoint file to the end of the open window's optimizer step, at the median phase and the
worst (``k = GA - 1``). Every resume's weights after that step are compared bitwise with the
uninterrupted run's; a route that differs gets no figure. Rounds interleave the routes (their order
alternating), medians with min-max; one intra-op thread (the trainer's default). The checkpoint
files are read back right after being written, so the page cache serves them: resume times are
compute and deserialization, not disk reads.

    python benchmarks/bench_accumulation.py            # 5 rounds, writes benchmarks/results/accumulation.md
    python benchmarks/bench_accumulation.py --quick    # the small model, 1 round, to a temp dir
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import format_seconds, machine_header, markdown_table, parse_args, plot_bars, write_report

from resumable_data import ResumableDataLoader, capture_rng_state, restore_rng_state
from resumable_data.accumulation import AccumulationWindow
from trainer.model import GPT, ModelConfig

# Checkpoint keys, declared once: a boundary checkpoint has the first four; route 1 replaces the
# loader and RNG states by the window's state, route 2 adds the gradients.
MODEL, OPTIMIZER, LOADER, RNG, WINDOW, GRADS = "model", "optimizer", "dataloader", "rng", "window", "grads"
WINDOW_START, SAVED_GRADS = "1 window start", "2 saved gradient"
ROUTES = (WINDOW_START, SAVED_GRADS)
SEQUENCES = 256  # rows of random tokens: more than the two windows of GA 8 read


@dataclass(frozen=True)
class Shape:
    name: str
    model: ModelConfig
    batch_size: int  # sequences per micro-batch


SHAPES = (
    Shape("GPT 0.12M, micro-batch 8x64", ModelConfig(block_size=64, n_layer=2, n_head=2, n_embd=64, dropout=0.1), 8),
    Shape("GPT 24M, micro-batch 2x64", ModelConfig(block_size=64, n_layer=6, n_head=8, n_embd=576, dropout=0.1), 2),
)


def phases(grad_accum: int) -> list[int]:
    """The median and the worst number of micro-batches of the window trained before the save."""
    return sorted({statistics.median_low(range(1, grad_accum)), grad_accum - 1})


class Tokens(torch.utils.data.Dataset):
    """Fixed random token rows, as ``(input, target)`` shifted by one."""

    def __init__(self, block_size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, 256, (SEQUENCES, block_size + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[index, :-1], self.rows[index, 1:]


@dataclass
class Run:
    model: GPT
    optimizer: torch.optim.AdamW
    loader: ResumableDataLoader


def build(shape: Shape) -> Run:
    """Model, AdamW and a shuffled loader, as the trainer builds them (the weights seeded alike every time)."""
    torch.manual_seed(0)
    model = GPT(shape.model)
    optimizer = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95))
    loader = ResumableDataLoader(Tokens(shape.model.block_size), batch_size=shape.batch_size, shuffle=True, seed=0)
    return Run(model, optimizer, loader)


def train_micro(run: Run, batch: tuple[torch.Tensor, torch.Tensor], grad_accum: int) -> None:
    _, loss = run.model(*batch)
    (loss / grad_accum).backward()  # the mean over micro-batches, as the trainer accumulates


def step(run: Run) -> None:
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)


def save(state: dict[str, Any], path: Path) -> float:
    """``torch.save`` then ``fsync``, as a durable checkpoint write; seconds."""
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@dataclass
class Cell:
    """One (shape, GA, k): where each route's checkpoint is, and the uninterrupted run's weights after the window."""

    grad_accum: int
    trained: int
    files: dict[str, Path]
    expected: dict[str, torch.Tensor]


def prepare(shape: Shape, grad_accum: int, folder: Path) -> tuple[list[Cell], Path]:
    """Train one window, then the next one micro-batch by micro-batch, writing both routes'
    checkpoints at each measured phase; the weights after the second window are the reference.
    Also returns a boundary checkpoint (after the first window), the size both routes are compared with."""
    run = build(shape)
    window = AccumulationWindow(run.loader, grad_accum)
    batches = iter(window)
    for _ in range(grad_accum):
        train_micro(run, next(batches), grad_accum)
    step(run)
    boundary = folder / f"boundary-ga{grad_accum}.pt"
    common = {MODEL: run.model.state_dict(), OPTIMIZER: run.optimizer.state_dict()}
    save({**common, LOADER: run.loader.state_dict(), RNG: capture_rng_state()}, boundary)
    files: dict[int, dict[str, Path]] = {}
    for trained in range(1, grad_accum):
        train_micro(run, next(batches), grad_accum)
        if trained in phases(grad_accum):
            files[trained] = {route: folder / f"ga{grad_accum}-k{trained}-{route[0]}.pt" for route in ROUTES}
            save({**common, WINDOW: window.state_dict()}, files[trained][WINDOW_START])
            grads = {name: p.grad for name, p in run.model.named_parameters() if p.grad is not None}
            state = {**common, LOADER: run.loader.state_dict(), RNG: capture_rng_state(), GRADS: grads}
            save(state, files[trained][SAVED_GRADS])
    train_micro(run, next(batches), grad_accum)
    step(run)
    expected = weights(run.model)
    return [Cell(grad_accum, trained, paths, expected) for trained, paths in files.items()], boundary


def resume(shape: Shape, cell: Cell, route: str) -> float | None:
    """Seconds from ``torch.load`` to the end of the open window's optimizer step; None when the
    weights after it differ from the uninterrupted run's."""
    run = build(shape)  # outside the timing: a resumed job builds its model before loading anyway
    start = time.perf_counter()
    state = torch.load(cell.files[route], weights_only=True)
    run.model.load_state_dict(state[MODEL])
    run.optimizer.load_state_dict(state[OPTIMIZER])
    if route == WINDOW_START:
        window = AccumulationWindow(run.loader, cell.grad_accum)
        window.load_state_dict(state[WINDOW])  # the loader and the RNGs as the window began
        batches: Iterator[Any] = iter(window)
        remaining = cell.grad_accum  # the first k again, then the rest
    else:
        run.loader.load_state_dict(state[LOADER])
        restore_rng_state(state[RNG])
        for name, param in run.model.named_parameters():
            param.grad = state[GRADS][name]
        batches = iter(run.loader)
        remaining = cell.grad_accum - cell.trained
    for _ in range(remaining):
        train_micro(run, next(batches), cell.grad_accum)
    step(run)
    elapsed = time.perf_counter() - start
    got = weights(run.model)
    exact = got.keys() == cell.expected.keys() and all(torch.equal(got[n], cell.expected[n]) for n in got)
    return elapsed if exact else None


def spread(values: list[float]) -> str:
    return f"{format_seconds(statistics.median(values))} ({format_seconds(min(values))}-{format_seconds(max(values))})"


def main() -> None:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
        parser.add_argument(
            "--ckpt-dir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)"
        )

    args = parse_args(__doc__.splitlines()[0], arguments)
    rounds = 1 if args.quick else args.rounds
    shapes, gas = (SHAPES[:1], (2, 4)) if args.quick else (SHAPES, (2, 4, 8))
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="bench-accumulation-", dir=args.ckpt_dir))
    cells: dict[str, list[Cell]] = {}
    boundaries: dict[str, Path] = {}
    started = time.perf_counter()
    try:
        for number, shape in enumerate(shapes):
            cells[shape.name] = []
            (folder / str(number)).mkdir()  # the file names repeat from shape to shape
            for grad_accum in gas:
                prepared, boundaries[shape.name] = prepare(shape, grad_accum, folder / str(number))
                cells[shape.name] += prepared
            print(f"{shape.name}: checkpoints written ({time.perf_counter() - started:.0f} s)", flush=True)
        saves: dict[tuple[str, str], list[float]] = {}
        resumes: dict[tuple[str, int, int, str], list[float]] = {}
        wrong: set[tuple[str, int, int, str]] = set()
        for round_ in range(rounds):
            order = ROUTES if round_ % 2 == 0 else ROUTES[::-1]
            for shape in shapes:
                worst = cells[shape.name][-1]  # the largest GA's worst phase: the bytes do not depend on it
                for route in order:
                    state = torch.load(worst.files[route], weights_only=True)
                    saves.setdefault((shape.name, route), []).append(save(state, folder / "timed-save.pt"))
                for cell in cells[shape.name]:
                    for route in order:
                        key = (shape.name, cell.grad_accum, cell.trained, route)
                        seconds = resume(shape, cell, route)
                        if seconds is None:
                            wrong.add(key)
                        else:
                            resumes.setdefault(key, []).append(seconds)
            print(f"round {round_ + 1}/{rounds} done ({time.perf_counter() - started:.0f} s)", flush=True)
        report = render(shapes, cells, boundaries, saves, resumes, wrong, rounds, time.perf_counter() - started)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(report)
    write_report(args.out, "accumulation", report)
    plot(args.out / "accumulation_resume.png", resumes)


def render(
    shapes: tuple[Shape, ...],
    cells: dict[str, list[Cell]],
    boundaries: dict[str, Path],
    saves: dict[tuple[str, str], list[float]],
    resumes: dict[tuple[str, int, int, str], list[float]],
    wrong: set[tuple[str, int, int, str]],
    rounds: int,
    total_s: float,
) -> str:
    size_rows = []
    for shape in shapes:
        base = boundaries[shape.name].stat().st_size
        worst = cells[shape.name][-1]
        params = sum(p.numel() for p in GPT(shape.model).parameters())
        for route in ROUTES:
            size = worst.files[route].stat().st_size
            size_rows.append(
                [
                    shape.name,
                    f"{params / 1e6:.2f}M",
                    route,
                    f"{size / 1e6:.2f} MB",
                    f"{size - base:+,} B ({(size - base) / base:+.1%})",
                    spread(saves[(shape.name, route)]),
                ]
            )
    resume_rows = []
    for shape in shapes:
        for cell in cells[shape.name]:
            keys = {route: (shape.name, cell.grad_accum, cell.trained, route) for route in ROUTES}
            shown = {
                route: "resumes WRONG: no figure" if key in wrong else spread(resumes[key])
                for route, key in keys.items()
            }
            both = not any(key in wrong for key in keys.values())
            ratio = (
                statistics.median(resumes[keys[SAVED_GRADS]]) / statistics.median(resumes[keys[WINDOW_START]])
                if both
                else float("nan")
            )
            phase = "worst" if cell.trained == cell.grad_accum - 1 else "median"
            resume_rows.append(
                [
                    shape.name,
                    cell.grad_accum,
                    f"{cell.trained} ({phase})",
                    shown[WINDOW_START],
                    shown[SAVED_GRADS],
                    f"{ratio:.2f}",
                    "yes" if both else "NO",
                ]
            )
    return "\n".join(
        [
            machine_header("Checkpoints inside a gradient-accumulation window: window start vs saved gradient"),
            f"- {rounds} interleaved rounds, {total_s:.0f} s in all; one intra-op thread; AdamW; dropout 0.1",
            "",
            "## Checkpoint size and save time (`torch.save` + `fsync`)",
            "",
            "Beyond a boundary checkpoint (model, AdamW, loader, RNGs). Neither depends on GA or on the phase: "
            "route 1 stores the window start's loader and RNG states instead of the present ones (plus two "
            "counters), route 2 adds one gradient tensor per parameter.",
            "",
            markdown_table(
                ["model", "parameters", "route", "checkpoint", "extra vs boundary", "save: median (min-max)"],
                size_rows,
            ),
            "",
            "## Resume: `torch.load` to the end of the open window's optimizer step",
            "",
            "k: micro-batches of the window trained before the save (route 1 trains them again). "
            "exact: every resume's weights after the step bitwise equal to the uninterrupted run's.",
            "",
            markdown_table(
                ["model", "GA", "k", "1 window start", "2 saved gradient", "2 / 1", "exact"],
                resume_rows,
            ),
        ]
    )


def plot(path: Path, resumes: dict[tuple[str, int, int, str], list[float]]) -> None:
    groups: dict[str, dict[str, float]] = {}
    spreads: dict[str, dict[str, tuple[float, float]]] = {}
    for (shape, grad_accum, trained, route), values in resumes.items():
        group = f"{shape.split(',')[0]}\nGA {grad_accum}, k {trained}"
        groups.setdefault(group, {})[route] = statistics.median(values)
        spreads.setdefault(group, {})[route] = (min(values), max(values))
    plot_bars(
        path,
        "Resume from a mid-window checkpoint to the window's optimizer step (median, min-max)",
        groups,
        ylabel="seconds",
        spreads=spreads,
    )


if __name__ == "__main__":
    main()
