"""Mosaic MDS shards read by our MDSReader against Mosaic Streaming's own StreamingDataset: epoch
throughput and restore at 90 %, over the same files.

Data: records written by Mosaic's ``MDSWriter``, record ``i`` being ``{"tokens": [i, i] (ndarray:int64:2),
"text": 120 characters (str)}``, in shards of at most 1 MiB; once plain and once zstd-compressed.
Both libraries decode every column and yield ``torch.from_numpy(record["tokens"])``; batches of 32.

Methods:

- ours: ``mds_stream(folder, seed=0).shuffle_window(10_000, seed=1).map(tokens)`` through ``StreamLoader``.
- Mosaic: ``StreamingDataset(local=folder, shuffle=True, shuffle_seed=0, batch_size=32)`` through its
  ``StreamingDataLoader`` (``benchmarks/_peers.py``); a zstd folder is copied fresh for each of its
  cells, since Mosaic decompresses the shards into the folder it reads (the next run would read
  them decompressed).

1. Throughput: one epoch, 0 and 2 workers; ours and Mosaic's interleaved in each round, which goes
   first alternating by round; each epoch is checked to yield every record once. The ratio is
   Mosaic's epoch time over ours within each round (≥ 0.9 is the target; > 1: ours faster).
2. Restore at 90 % of the epoch: the loader's state taken there (``state_dict``), loaded into a
   freshly built loader, timed from ``load_state_dict`` to the first batch in hand, which is checked
   equal to the uninterrupted run's ("not exact" otherwise); Mosaic's ``StreamingDataLoader``
   ``state_dict``/``load_state_dict``, as its documentation shows.

Every epoch and restore runs in a process of its own (``_common.run_isolated``): Mosaic's shared memory
and threads outlive its loader. Run with an environment where ``streaming`` imports (it pins numpy < 2.2):
``PYTHONPATH=. /path/to/peers/python benchmarks/bench_mds.py`` (``--quick``: a smoke test).
"""

from __future__ import annotations

import gc
import pickle
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import _peers
import numpy as np
import torch
from _common import machine_header, markdown_table, parse_args, run_isolated, timed_epoch, write_report
from bench_streams import record_ids, spread, warm_up_dataloader

from resumable_data.streams import StreamLoader
from resumable_data.streams.formats import mds_stream

BATCH = 32
WINDOW = 10_000
FRACTION = 0.9
OURS = "ours: mds_stream + shuffle_window"
MOSAIC = "Mosaic StreamingDataset 0.13.0"


def write(directory: Path, n: int, compression: str | None) -> Path:
    """``n`` records by Mosaic's MDSWriter into ``directory``."""
    _peers._import_streaming()
    from streaming import MDSWriter

    columns = {"tokens": "ndarray:int64:2", "text": "str"}
    with MDSWriter(out=str(directory), columns=columns, size_limit=1 << 20, compression=compression) as writer:
        for i in range(n):
            writer.write({"tokens": np.array([i, i], dtype=np.int64), "text": f"{i:08d}" * 15})
    return directory


def tokens(record: dict[str, Any]) -> torch.Tensor:
    return torch.from_numpy(record["tokens"])


def build(method: str, folder: str, workers: int, scratch: str) -> Any:
    """The loader ``method`` names over ``folder`` (for Mosaic, a fresh copy under ``scratch``)."""
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    if method == OURS:
        stream = mds_stream(folder, seed=0).shuffle_window(WINDOW, seed=1).map(tokens)
        return StreamLoader(stream, batch_size=BATCH, num_workers=workers)
    local = Path(tempfile.mkdtemp(dir=scratch))
    shutil.rmtree(local)
    shutil.copytree(folder, local)
    return _peers.mosaic_loader(local, batch_size=BATCH, workers=workers)


def epoch_cell(method: str, folder: str, workers: int, n: int, scratch: str) -> dict[str, Any]:
    """1. The seconds of one epoch, checked to yield every record once."""
    torch.set_num_threads(1)
    return timed_epoch(build(method, folder, workers, scratch), record_ids, n)


def checkpoint_cell(method: str, folder: str, workers: int, n: int, scratch: str) -> dict[str, Any]:
    """2. The pickled state at 90 % of the epoch and the next batch's ids."""
    torch.set_num_threads(1)
    loader = build(method, folder, workers, scratch)
    batches = iter(loader)
    for _ in range(int(FRACTION * n / BATCH)):
        next(batches)
    state = pickle.dumps(loader.state_dict())
    return {"state": state, "next": record_ids(next(batches))}


def restore_cell(method: str, folder: str, workers: int, scratch: str, state: bytes, expected: list[int]) -> dict:
    """2. ``load_state_dict`` into a fresh loader, to the first batch in hand (NaN if it differs)."""
    torch.set_num_threads(1)
    warm_up_dataloader()
    loader = build(method, folder, workers, scratch)
    gc.collect()
    start = time.perf_counter()
    loader.load_state_dict(pickle.loads(state))
    got = record_ids(next(iter(loader)))
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed if got == expected else float("nan")}


def isolated(fn: Any, **kwargs: Any) -> dict[str, Any]:
    result = run_isolated(fn, kwargs, timeout_s=900)
    if "error" in result:
        raise SystemExit(f"{fn.__name__} {kwargs.get('method')}: {result['error']}")
    return result


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rounds = 1 if args.quick else 3
    n = 2_000 if args.quick else 100_000
    why = _peers.available()["mosaic"]
    if why is not None:
        raise SystemExit(f"Mosaic Streaming is needed here: {why}")
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-mds-") as tmp:
        root = Path(tmp)
        data = {
            name: str(write(root / name, n, compression)) for name, compression in (("plain", None), ("zstd", "zstd"))
        }
        shards = len(list((root / "plain").glob("shard.*")))
        scratch = str(root / "scratch")
        Path(scratch).mkdir()
        print(f"wrote {n:,} records in {shards} shards", flush=True)

        seconds: dict[tuple[str, str, int], list[float]] = {}
        ratios: dict[tuple[str, int], list[float]] = {}
        for round_ in range(rounds):
            for name, folder in data.items():
                for workers in (0, 2):
                    pair = (OURS, MOSAIC) if round_ % 2 == 0 else (MOSAIC, OURS)
                    got = {
                        m: isolated(epoch_cell, method=m, folder=folder, workers=workers, n=n, scratch=scratch)[
                            "seconds"
                        ]
                        for m in pair
                    }
                    for m in pair:
                        seconds.setdefault((m, name, workers), []).append(got[m])
                    ratios.setdefault((name, workers), []).append(got[MOSAIC] / got[OURS])
                    print(f"round {round_ + 1} {name} {workers} workers: {got}", flush=True)
        rows = []
        for name in data:
            for workers in (0, 2):
                ours, theirs = seconds[(OURS, name, workers)], seconds[(MOSAIC, name, workers)]
                rows.append(
                    [
                        f"{name}, {workers} workers",
                        spread(ours),
                        f"{n / np.median(ours):,.0f}",
                        spread(theirs),
                        f"{n / np.median(theirs):,.0f}",
                        spread(ratios[(name, workers)], lambda x: f"{x:.2f}"),
                    ]
                )
        lines += [
            "",
            f"## 1. Throughput: one epoch of {n:,} records in {shards} shards, batches of {BATCH}",
            "",
            f"Median (min–max) over {rounds} round(s), each epoch in a process of its own, ours and Mosaic's "
            "interleaved (which goes first alternates by round); the ratio is Mosaic's epoch time over ours "
            "within each round (target ≥ 0.9; > 1: ours faster).",
            "",
            markdown_table(
                ["shards, workers", "ours", "ours records/s", "Mosaic", "Mosaic records/s", "Mosaic ÷ ours"], rows
            ),
            "",
        ]

        taken = {
            (m, workers): isolated(
                checkpoint_cell, method=m, folder=data["plain"], workers=workers, n=n, scratch=scratch
            )
            for m in (OURS, MOSAIC)
            for workers in (0, 2)
        }
        restores: dict[tuple[str, int], list[float]] = {}
        for round_ in range(rounds):
            for (m, workers), cell in taken.items() if round_ % 2 == 0 else reversed(taken.items()):
                result = isolated(
                    restore_cell,
                    method=m,
                    folder=data["plain"],
                    workers=workers,
                    scratch=scratch,
                    state=cell["state"],
                    expected=cell["next"],
                )
                restores.setdefault((m, workers), []).append(result["seconds"])
            print(f"restore round {round_ + 1} done", flush=True)
        rows = [
            [m, str(workers), spread(restores[(m, workers)]), f"{len(taken[(m, workers)]['state']):,} B (pickle)"]
            for (m, workers) in taken
        ]
        lines += [
            f"## 2. Restore at {FRACTION:.0%} of the epoch ({int(FRACTION * n / BATCH):,} batches in), plain shards",
            "",
            f"From `load_state_dict` into a freshly built loader to the first batch in hand; median (min–max) over "
            f"{rounds} round(s), each in a process of its own; every restored batch checked equal to the "
            "uninterrupted run's ('not exact' otherwise).",
            "",
            markdown_table(["method", "workers", "first batch", "state"], rows),
            "",
        ]
    text = machine_header(f"MDS shards: MDSReader against Mosaic Streaming ({n:,} records)") + "\n".join(lines)
    print(text)
    write_report(args.out, "mds", text)


if __name__ == "__main__":
    main()
