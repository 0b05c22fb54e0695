"""WebDataset shards: epoch throughput of WebDatasetReader versus WebDataset's own reader over the same
files, and the time to resume at 90 % of an epoch.

Data: 8 shards x 1,500 samples (``--quick``: 3 x 300) written by ``webdataset.ShardWriter`` to a
temp dir: each sample a ``jpg`` of 4-16 KiB random bytes, a ``cls`` and a ``json`` field (the
layout of an image-classification shard); the files are in the page cache (written just before).
Both readers hand each sample dict to the same cheap decode (``[id, class, len(jpg)]`` as a
tensor: image decoding would cost both the same), in batches of 64, shard order unshuffled, with 0
and 2 DataLoader workers (ours: ``StreamLoader``, theirs: ``torch.utils.data.DataLoader``).

Epoch: a fresh process builds the loader and reads one epoch; samples/s, median (min–max) of the
rounds, readers interleaved. Ours is timed twice: with the sample indexes built in the process
(the tar headers scanned when the stream is built: a first run) and read from ``cache_dir``
(saved there by an earlier run: every later run). Each epoch is checked to hold every sample once.

Resume at 90 %: ours loads the checkpoint's state (``load_state_dict``) into a loader built in a
fresh process and reads the next batch, checked equal to the uninterrupted run's. WebDataset has
no exact resume: its answer (webdataset issues #234, #271, #177) is to resample (``resampled=True``,
``with_epoch(n)``: a fresh random stream, not the rest of the epoch) or to skip (``.slice(n)``,
which still reads every sample it skips). So the honest alternative is iterate-and-discard to 90 %,
then the next batch: timed the same way.

Run: ``python benchmarks/bench_webdataset.py`` (``--quick``: a smoke test; ``--rounds N``).
"""

from __future__ import annotations

import itertools
import json
import pickle
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import webdataset as wds
from _common import format_seconds, machine_header, markdown_table, parse_args, run_isolated, write_report

from resumable_data.streams import StreamLoader
from resumable_data.streams.formats import WebDatasetReader, webdataset_stream

BATCH = 64
FRACTION = 0.9
TIMEOUT_S = 600.0


def write_shards(directory: Path, num_shards: int, samples: int) -> list[str]:
    rng = random.Random(0)
    pattern = str(directory / "train-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=samples, verbose=0) as writer:
        for i in range(num_shards * samples):
            writer.write(
                {
                    "__key__": f"{i:08d}",
                    "jpg": rng.randbytes(rng.randrange(4096, 16384)),
                    "cls": str(i % 1000).encode(),
                    "json": json.dumps({"id": i}).encode(),
                }
            )
    return [pattern % s for s in range(num_shards)]


def decode(sample: dict[str, Any]) -> torch.Tensor:
    return torch.tensor([json.loads(sample["json"])["id"], int(sample["cls"]), len(sample["jpg"])])


def ours(shards: list[str], workers: int, cache_dir: str | None) -> StreamLoader:
    stream = webdataset_stream(shards, read_shard=WebDatasetReader(decode, cache_dir=cache_dir), shuffle=False)
    return StreamLoader(stream, batch_size=BATCH, num_workers=workers)


def theirs(shards: list[str], workers: int) -> torch.utils.data.DataLoader:
    dataset = wds.WebDataset(shards, shardshuffle=False).map(decode)
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=workers)


def make_loader(reader: str, shards: list[str], workers: int, cache_dir: str) -> Any:
    if reader == "webdataset":
        return theirs(shards, workers)
    return ours(shards, workers, cache_dir if reader == "ours, index in cache_dir" else None)


def epoch_cell(reader: str, shards: list[str], workers: int, cache_dir: str) -> dict[str, Any]:
    """One epoch in this fresh process, loader built inside the timing."""
    start = time.perf_counter()
    ids = [int(i) for batch in make_loader(reader, shards, workers, cache_dir) for i in batch[:, 0]]
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "samples": len(ids), "distinct": len(set(ids))}


def checkpoint_cell(shards: list[str], workers: int, position: int) -> dict[str, Any]:
    """Our state after ``position`` batches, and the batch that follows it."""
    loader = ours(shards, workers, None)
    batches = iter(loader)
    for _ in itertools.islice(batches, position):
        pass
    state = pickle.dumps(loader.state_dict())
    return {"state": state, "expected": pickle.dumps(next(batches))}


def resume_cell(
    reader: str, shards: list[str], workers: int, cache_dir: str, position: int, state: bytes, expected: bytes
) -> dict[str, Any]:
    """Ours: build, ``load_state_dict``, next batch. WebDataset: build, discard ``position`` batches, next."""
    start = time.perf_counter()
    loader = make_loader(reader, shards, workers, cache_dir)
    if reader == "webdataset":
        batches = iter(loader)
        for _ in itertools.islice(batches, position):
            pass
        got = next(batches)
    else:
        loader.load_state_dict(pickle.loads(state))
        got = next(iter(loader))
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "equal": bool(torch.equal(got, pickle.loads(expected)))}


def spread(values: list[float], show: Callable[[float], str]) -> str:
    return f"{show(statistics.median(values))} ({show(min(values))}–{show(max(values))})"


def run(num_shards: int, samples: int, rounds: int) -> tuple[str, str]:
    readers = ["webdataset", "ours, index built", "ours, index in cache_dir"]
    total = num_shards * samples
    position = int(FRACTION * (total // BATCH))
    with tempfile.TemporaryDirectory(prefix="bench-webdataset-") as tmp:
        shards = write_shards(Path(tmp), num_shards, samples)
        cache_dir = str(Path(tmp) / "cache")
        ours(shards, 0, cache_dir)  # an earlier run: the indexes are saved in cache_dir
        epochs: dict[tuple[str, int], list[float]] = {}
        resumes: dict[tuple[str, int], list[float]] = {}
        states = {
            w: run_isolated(
                checkpoint_cell, {"shards": shards, "workers": w, "position": position}, timeout_s=TIMEOUT_S
            )
            for w in (0, 2)
        }
        for _ in range(rounds):  # interleaved: a load change on the machine hits every reader alike
            for workers, reader in itertools.product((0, 2), readers):
                cell = {"reader": reader, "shards": shards, "workers": workers, "cache_dir": cache_dir}
                result = run_isolated(epoch_cell, cell, timeout_s=TIMEOUT_S)
                if "error" in result or result["samples"] != total or result["distinct"] != total:
                    raise SystemExit(f"{reader}, {workers} workers: {result}")
                epochs.setdefault((reader, workers), []).append(result["seconds"])
                resumed = run_isolated(
                    resume_cell, {**cell, "position": position, **states[workers]}, timeout_s=TIMEOUT_S
                )
                if "error" in resumed or (reader != "webdataset" and not resumed["equal"]):
                    raise SystemExit(f"resume, {reader}, {workers} workers: {resumed}")
                resumes.setdefault((reader, workers), []).append(resumed["seconds"])
    rate = [
        [
            reader,
            str(workers),
            spread([total / s for s in epochs[reader, workers]], lambda v: f"{v:,.0f}"),
            f"{statistics.median(epochs['webdataset', workers]) / statistics.median(epochs[reader, workers]):.2f}x",
        ]
        for workers, reader in itertools.product((0, 2), readers)
    ]
    resume = [
        [
            reader + (" (iterate and discard)" if reader == "webdataset" else " (load_state_dict)"),
            str(workers),
            spread(resumes[reader, workers], format_seconds),
            f"{statistics.median(resumes['webdataset', workers]) / statistics.median(resumes[reader, workers]):.1f}x",
        ]
        for workers, reader in itertools.product((0, 2), readers)
    ]
    return (
        markdown_table(["reader", "workers", "samples/s", "vs webdataset"], rate),
        markdown_table(
            [
                "resume at batch " + f"{position:,} of {total // BATCH:,}",
                "workers",
                "time to the next batch",
                "vs webdataset",
            ],
            resume,
        ),
    )


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument("--rounds", type=int, default=3))
    num_shards, samples = (3, 300) if args.quick else (8, 1500)
    rounds = 1 if args.quick else args.rounds
    epoch_table, resume_table = run(num_shards, samples, rounds)
    text = "\n".join(
        [
            machine_header(f"WebDataset shards: epoch throughput and resume at {FRACTION:.0%}"),
            f"{num_shards} shards x {samples:,} samples (jpg 4-16 KiB, cls, json) written by `webdataset.ShardWriter` "
            f"{wds.__version__ if hasattr(wds, '__version__') else ''}, read from the page cache; batches of {BATCH}, "
            f"shards unshuffled. Each cell is a fresh process; median (min–max) of {rounds} rounds, readers interleaved. "
            "'index built': the tar headers are scanned when the stream is built (a first run); 'index in cache_dir': "
            "read from where an earlier run saved it.",
            "",
            "## One epoch (loader built inside the timing)",
            "",
            epoch_table,
            "",
            "## Resume at 90 % (loader built inside the timing)",
            "",
            "Ours restores the checkpoint's state and its next batch is checked equal to the uninterrupted run's. "
            "WebDataset has no exact resume (it offers resampling, `resampled=True`/`with_epoch`, or `.slice`, "
            "which reads what it skips): its exact alternative is to iterate and discard.",
            "",
            resume_table,
        ]
    )
    print()
    print(text)
    write_report(args.out, "webdataset", text)


if __name__ == "__main__":
    main()
