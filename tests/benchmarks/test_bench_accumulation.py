"""``benchmarks/bench_accumulation.py``: both routes of a mid-window checkpoint resume to the
uninterrupted run's weights, and a route that does not gets no figure.

No timing is asserted (see test_benchmarks.py); what is asserted is the exactness check the
benchmark's figures stand on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import _common  # noqa: E402  (the benchmarks' helpers, for parsing their tables)
import bench_accumulation as bench  # noqa: E402

QUICK_TIMEOUT_S = 240  # --quick takes about 15 s; the margin is for a loaded CI machine


def test_both_routes_resume_exactly_and_a_wrong_resume_is_caught(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    shape = bench.SHAPES[0]
    cells, _ = bench.prepare(shape, 4, tmp_path)
    assert [cell.trained for cell in cells] == [2, 3]  # the median and the worst phase of GA 4
    for cell in cells:
        for route in bench.ROUTES:
            assert bench.resume(shape, cell, route) is not None, (cell.trained, route)
    # The same resumes against other expected weights: the check names them wrong.
    cell = cells[0]
    cell.expected = {name: tensor + 1e-7 for name, tensor in cell.expected.items()}
    assert all(bench.resume(shape, cell, route) is None for route in bench.ROUTES)


@pytest.mark.slow  # one quick run: ~15 s of a 2-core machine
def test_bench_accumulation_quick(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_accumulation.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
        cwd=REPO,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    text = (tmp_path / "accumulation.md").read_text()
    assert text.startswith("# ") and "- machine:" in text and "- command:" in text
    resumes = _common.parse_markdown_rows(text, "model")
    rows = [row for row in resumes if "exact" in row]
    assert [(row["GA"], row["k"]) for row in rows] == [("2", "1 (worst)"), ("4", "2 (median)"), ("4", "3 (worst)")]
    assert all(row["exact"] == "yes" for row in rows), rows
    sizes = [row for row in resumes if "extra vs boundary" in row]
    extra = {row["route"]: int(row["extra vs boundary"].split()[0].replace(",", "")) for row in sizes}
    # The saved gradient adds one float32 per parameter (plus pickle framing); the window start a few counters.
    params = sum(p.numel() for p in bench.GPT(bench.SHAPES[0].model).parameters())
    assert extra[bench.SAVED_GRADS] >= 4 * params and 0 <= extra[bench.WINDOW_START] < 1000, extra
