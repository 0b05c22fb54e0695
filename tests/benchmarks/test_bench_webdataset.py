"""Smoke test of benchmarks/bench_webdataset.py: it runs with ``--quick``, every epoch holds each sample
once and every resumed batch is the uninterrupted run's.

No timing is asserted. The benchmark exits non-zero if an epoch misses or repeats a sample, or if a
restored batch differs from the uninterrupted run's, so a zero exit and the two tables is the
specification. Slow: a quick run starts 24 cell processes (about 10 s on 2 shared cores).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("webdataset", reason="the benchmark compares with webdataset (in the [dev] extra)")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_webdataset_quick(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_webdataset.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    text = (tmp_path / "webdataset.md").read_text()
    assert text.startswith("# ") and "- machine:" in text and "- command:" in text
    readers = [line.split(" | ")[0] for line in text.splitlines() if line.startswith(("| webdataset", "| ours"))]
    assert len(readers) == 12 and readers.count("| webdataset") == 2
