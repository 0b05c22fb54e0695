"""How long ``verify`` takes on the reference trainer with 3 kills, against one uninterrupted run.

``verify`` runs the command once uninterrupted (with the audit on), then an interrupted series: 3
launches SIGKILLed at steps drawn in advance plus one to the end; each relaunch pays the process
start, the model and data set-up, and replays the steps after its checkpoint. The issue's target is
the whole check within 3x one plain uninterrupted run (``python -m trainer train`` alone, no audit),
timed here in the same conditions, interleaved: a plain run, a verify, a plain run, a verify, ...

    python benchmarks/bench_verify.py            # 3 rounds of 1000 steps, writes benchmarks/results/verify.md
    python benchmarks/bench_verify.py --quick    # 1 round of a tiny run, to a temp dir
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine_header, parse_args

from resumable_data import audit

ROOT = Path(__file__).resolve().parent.parent
KILLS = 3


def trainer_command(max_steps: int) -> list[str]:
    """The trainer at a small size (a few ms per step on CPU), checkpointing every 10 steps."""
    return [
        *(sys.executable, "-m", "trainer", "train", "--run-dir", "{run_dir}", "--max-steps", str(max_steps)),
        *("--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "64", "--batch-size", "8"),
        *("--dropout", "0.1", "--eval-every", "50", "--eval-batches", "2", "--checkpoint-every", "10", "--no-progress"),
    ]


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and of its children that have ended."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def plain_run(command: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one uninterrupted run of ``command`` in a fresh folder, audit off."""
    with tempfile.TemporaryDirectory() as run_dir:
        started, cpu = time.perf_counter(), cpu_seconds()
        argv = [arg.replace("{run_dir}", run_dir) for arg in command]
        subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, timeout=1800)
        return time.perf_counter() - started, cpu_seconds() - cpu


def verify_run(command: list[str], seed: int) -> tuple[float, float, dict[str, float], bool]:
    """Wall and CPU seconds of ``verify`` with 3 kills (its launches and its own polling), its
    parts, and whether it passed."""
    with tempfile.TemporaryDirectory() as work:
        started, cpu = time.perf_counter(), cpu_seconds()
        result = audit.verify(command, kills=KILLS, seed=seed, timeout=1800, work_dir=Path(work) / "runs", echo=None)
        return time.perf_counter() - started, cpu_seconds() - cpu, result.seconds, result.passed


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument("--max-steps", type=int, default=None))
    rounds, steps = (1, 30) if args.quick else (3, args.max_steps or 1000)
    os.chdir(ROOT)  # verify puts the folder it starts from on PYTHONPATH, so that `-m trainer` imports
    command = trainer_command(steps)
    rows = []
    for seed in range(rounds):
        plain, plain_cpu = plain_run(command)
        total, total_cpu, parts, passed = verify_run(command, seed)
        rows.append((plain, total, parts, passed, plain_cpu, total_cpu))
        print(
            f"round {seed}: plain {plain:.1f} s, verify {total:.1f} s ({total / plain:.2f}x); CPU {total_cpu / plain_cpu:.2f}x"
        )
        if not passed:
            sys.exit("verify did not pass: the timing means nothing")
    ratio = statistics.median(row[1] / row[0] for row in rows)
    cpu_ratio = statistics.median(row[5] / row[4] for row in rows)
    # verify's own reference run is the same command with the audit on, timed inside the same verify:
    # a ratio to it is less at the mercy of the machine's load changing between the two.
    own = statistics.median(row[1] / row[2]["reference"] for row in rows)
    lines = [
        machine_header(f"`verify` on the trainer ({steps} steps, {KILLS} SIGKILLs) vs one uninterrupted run"),
        "| round | plain run | verify | verify / plain | reference (audit on) | verify / reference | interrupted series "
        "| CPU: plain | CPU: verify | CPU ratio | PASS |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {i} | {p:.1f} s | {t:.1f} s | {t / p:.2f}x | {parts['reference']:.1f} s | {t / parts['reference']:.2f}x | "
            f"{parts['interrupted']:.1f} s | {pc:.1f} s | {tc:.1f} s | {tc / pc:.2f}x | {'yes' if ok else 'NO'} |"
            for i, (p, t, parts, ok, pc, tc) in enumerate(rows)
        ),
        "",
        f"Median wall time, verify / plain: **{ratio:.2f}x**; verify / its own reference run: **{own:.2f}x**; "
        f"CPU time (less at the mercy of other jobs' load), verify / plain: **{cpu_ratio:.2f}x** (target: "
        "at most 3x). `verify` runs the command twice in "
        f"full (reference and series) plus {KILLS} extra process starts and the steps replayed after each "
        "kill (at most 9, as the trainer checkpoints every 10 steps), so 2x is its floor.",
        "",
    ]
    out = args.out / "verify.md"
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
