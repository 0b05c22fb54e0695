"""Smoke tests of the benchmarks: each runs with ``--quick`` and must report every method as correct.

No timing is asserted (a shared CI machine makes any threshold flaky). What is asserted is what the
benchmarks check along the way: every resumed batch is the one the uninterrupted run yields, every
epoch hands out each sample once, every checkpoint loads back as it was saved.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import _common  # noqa: E402  (the benchmarks' helpers, for parsing their tables)

QUICK_TIMEOUT_S = 240  # --quick aims at ≤ 15 s; the margin is for a loaded CI machine


def _run_quick(script: str, out: Path) -> str:
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
        cwd=REPO,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed.stdout


def _replot(script: str, report: Path, out: Path) -> None:
    """``--replot`` redraws a written report's plots without measuring anything."""
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--replot", str(report), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
        cwd=REPO,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]


def _rows(out: Path, name: str, first_header: str) -> list[dict[str, str]]:
    text = (out / f"{name}.md").read_text()
    assert text.startswith("# ") and "- machine:" in text and "- command:" in text
    return _common.parse_markdown_rows(text, first_header)


@pytest.mark.slow  # 25-35 s on 2 cores: CI's 5 minutes keep the cheaper benchmarks' smoke tests
def test_bench_resume_quick(tmp_path: Path) -> None:
    _run_quick("bench_resume.py", tmp_path)
    text = (tmp_path / "bench_resume.md").read_text()
    rows = [row for row in _rows(tmp_path, "bench_resume", "method") if "exact" in row]
    methods = {(row["sweep"], row["method"]) for row in rows}
    data_methods = (
        "naive skip",
        "index-only skip",
        "StatefulDataLoader",
        "torchdata.nodes",
        "resumable_data",
        "resumable_data, warm start",
    )
    expected = {("data", m) for m in data_methods}
    expected |= {("index", m) for m in ("index-only skip", "StatefulDataLoader", "torchdata.nodes", "resumable_data")}
    # Grain side by side where it is installed (the [peers] extra); else a line says it was skipped.
    if importlib.util.find_spec("grain") is not None:
        expected.add(("data", "Grain"))
        section = text.split("## Grain side by side")[1].split("\n## ")[0]
        grain = _common.parse_markdown_rows(section, "method")
        assert {row["method"] for row in grain} >= {"Grain", "resumable_data"}
        assert all(row["state size"].endswith(" B") for row in grain), grain
    else:
        assert "Grain skipped: not installed" in text
    assert methods == expected
    wrong = [row for row in rows if row["exact"] != "ok" and not row["exact"].startswith("not run")]
    assert not wrong, wrong
    # Every checked cell has a figure: none was refused for resuming wrong.
    assert all(row["latency"] != "no figure: resumed wrong" for row in rows), rows
    # Baselines are skipped only where they would materialize the whole permutation; ours never is.
    assert all(row["exact"] == "ok" for row in rows if row["method"] == "resumable_data")
    assert all("would materialize" in row["note"] for row in rows if row["exact"].startswith("not run"))
    # Every resumable_data cell with a dataset has its floor and a verdict against the 2x target.
    ours = [row for row in rows if row["method"] == "resumable_data" and row["sweep"] == "data"]
    assert ours and all(row["floor"] and row["÷ floor"].endswith(("(met)", "(missed)")) for row in ours), ours
    assert "restore / floor" in text
    # Warm start has cells only with workers, and is checked against the same reference as resumable_data.
    assert all(row["workers"] != "0" for row in rows if row["method"] == "resumable_data, warm start")
    # Epoch start: every variant (warm start or not, persistent or not) hands out the same batches.
    epoch_rows = [row for row in _rows(tmp_path, "bench_resume", "variant") if "same batches" in row]
    assert len(epoch_rows) == 4 and all(row["same batches"] == "ok" for row in epoch_rows), epoch_rows
    _replot("bench_resume.py", tmp_path / "bench_resume.md", tmp_path / "replot")
    for plot in ("resume_vs_position.png", "resume_vs_n.png"):
        assert (tmp_path / plot).stat().st_size > 0
        assert (tmp_path / "replot" / plot).stat().st_size > 0


@pytest.mark.slow  # 25-35 s on 2 cores: CI's 5 minutes keep the cheaper benchmarks' smoke tests
def test_bench_overhead_quick(tmp_path: Path) -> None:
    _run_quick("bench_overhead.py", tmp_path)
    rows = _rows(tmp_path, "bench_overhead", "method")
    epochs = [row for row in rows if "coverage" in row]
    control = "control: DataLoader fed resumable_data's order"
    methods = {
        "DataLoader",
        "StatefulDataLoader",
        "resumable_data",
        control,
        "resumable_data, global_rng=None",
        'resumable_data, global_rng="sample"',
    }
    assert {row["method"] for row in epochs} == methods
    assert all(row["coverage"] == "ok" for row in epochs), epochs
    machinery = [row for row in rows if "per batch" in row]
    assert {row["method"] for row in machinery} == methods
    # The global-RNG modes side by side, as ratios to global_rng=None of the same round.
    rng_rows = _rows(tmp_path, "bench_overhead", "global_rng")
    assert [row["global_rng"] for row in rng_rows][:2] == ['global_rng="batch" (default)', 'global_rng="sample"']
    states = [row for row in rows if "pickled size" in row]
    assert {row["method"] for row in states} == {"StatefulDataLoader", "resumable_data"}
    assert all(row["JSON-serializable"] == "yes" for row in states if row["method"] == "resumable_data")
    assert (tmp_path / "overhead_throughput.png").stat().st_size > 0
    _replot("bench_overhead.py", tmp_path / "bench_overhead.md", tmp_path / "replot")
    assert (tmp_path / "replot" / "overhead_throughput.png").stat().st_size > 0


@pytest.mark.slow  # 20 s on CI's 2 cores; the default suite keeps bench_elastic's and bench_checkpoint's
def test_bench_streams_quick(tmp_path: Path) -> None:
    # The benchmark exits non-zero if an epoch misses a record; a restore that differs is "not exact".
    _run_quick("bench_streams.py", tmp_path)
    text = (tmp_path / "streams.md").read_text()
    rows = _rows(tmp_path, "streams", "method")
    methods = [row["method"] for row in rows]
    assert "DataLoader (map-style, shuffled)" in methods
    assert "StreamLoader, shuffle_window(10,000), 2 workers" in methods
    inexact = [row for row in rows if "not exact" in row.values()]
    assert not inexact, inexact
    assert "not exact" not in text.split("## 3.")[1]  # nor in the state, elastic or mixing lines
    assert sum(name in methods for name in ("litdata", "mosaic", "litdata 0.2.76", "Mosaic Streaming 0.13.0")) >= 2
    assert "## 4. Elastic" in text and "## 5. Mixing" in text


def test_bench_elastic_quick(tmp_path: Path) -> None:
    # Each case checks once that the records before the state and after the restore are the epoch's, once each.
    _run_quick("bench_elastic.py", tmp_path)
    rows = _rows(tmp_path, "bench_elastic", "case")
    assert {row["case"] for row in rows} == {
        "2 workers -> 2 workers (same layout)",
        "0 workers -> 0 workers (same layout)",
        "2 workers -> 0 workers",
        "0 workers -> 2 workers, warm start",
        "0 workers -> 2 workers, no warm start",
    }
    assert all(row["exact"] == "ok" for row in rows), rows


@pytest.mark.slow  # 6 s; CI's 5 minutes keep bench_elastic's and bench_accumulation's smoke tests
def test_bench_checkpoint_quick(tmp_path: Path) -> None:
    _run_quick("bench_checkpoint.py", tmp_path)
    rows = [row for row in _rows(tmp_path, "bench_checkpoint", "mode") if "restored" in row]
    assert {row["mode"] for row in rows} == {"no checkpoints", "synchronous", "asynchronous"}
    assert all(row["restored"] == "ok" for row in rows if row["mode"] != "no checkpoints"), rows
    assert (tmp_path / "checkpoint_step_time.png").stat().st_size > 0


@pytest.mark.slow  # six Trainer runs in fresh processes: 40 s on the shared 2-core machine
def test_bench_hf_trainer_quick(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the [transformers] extra is not installed")
    _run_quick("bench_hf_trainer.py", tmp_path)
    rows = _rows(tmp_path, "bench_hf_trainer", "method")
    assert {(row["method"], row["checkpoint"]) for row in rows} == {
        (method, checkpoint)
        for method in ("Trainer (skip_first_batches)", "ResumableTrainer")
        for checkpoint in ("fresh start", "90%")
    }
    assert all(not row["median"].startswith("error") for row in rows), rows
    assert all(row["exact"] == "yes" for row in rows if row["method"] == "ResumableTrainer"), rows


@pytest.mark.slow  # 17 s on 2 cores (an S3 server, spawned workers): CI's 5 minutes
def test_bench_remote_shapes_quick(tmp_path: Path) -> None:
    # The benchmark exits non-zero if an epoch misses a record.
    pytest.importorskip("s3fs")
    _run_quick("bench_remote_shapes.py", tmp_path)
    rows = _rows(tmp_path, "remote_shapes", "shards")
    assert [row["cache"] for row in rows] == ["0.5 D", "none"]
    assert all(row["bytes down"].endswith(" D") for row in rows)
    assert rows[1]["whole-shard downloads"] == "0.00 D (0)"  # no cache: ranged reads only
