"""Smoke test of benchmarks/bench_parquet.py: it runs with ``--quick`` and every restore is exact.

No timing is asserted. The benchmark exits non-zero if a restored batch differs from the
uninterrupted run's, so a zero exit and a table with both pipelines is the specification.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyarrow", reason="the [parquet] extra (pyarrow) is not installed")

REPO = Path(__file__).resolve().parents[2]


def test_bench_parquet_quick(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_parquet.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    text = (tmp_path / "parquet.md").read_text()
    assert text.startswith("# ") and "- machine:" in text and "- command:" in text
    rows = [line for line in text.splitlines() if line.startswith("| parquet")]
    assert [row.split(" | ")[0] for row in rows] == ["| parquet source", "| parquet, shuffle buffer 1000"]
