"""Smoke test of benchmarks/bench_scale.py: ``--quick`` runs and reports every configuration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_scale_quick_reports_small_states_at_every_world_size(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_scale.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-4000:]
    text = (tmp_path / "bench_scale.md").read_text()
    assert "- machine:" in text and "- command:" in text
    map_rows = [line.split("|") for line in text.splitlines() if line.startswith("| 10^")][:6]
    assert [row[2].strip() for row in map_rows] == ["1", "8", "1024"] * 2
    assert all(int(row[3]) < 512 for row in map_rows)  # the map-style state stays O(1) and small
