"""Stream pipelines against a plain DataLoader, litdata and Mosaic Streaming: throughput, restore, state.

Data: token shards of windows of 2 int32 tokens, record ``i`` being ``[i, i]`` (its id), read by
``TokenShardReader(2)`` with ``sizes=`` (known record counts); the peers get the same records in
their own formats (``benchmarks/_peers.py``). Batches of 32. Every figure is checked: each epoch
yields every record once; each restore's first batch equals the uninterrupted run's.

1. Throughput: one epoch of 16 shards x 3,125 records with 50 µs of work per record (a busy
   loop in ``map``, or in the map-style dataset's ``__getitem__``), 0 and 2 workers; a plain
   ``DataLoader`` over the same records as a map-style dataset is the reference. Methods are
   interleaved in each round; the ratio to the plain DataLoader is taken per round (paired). Our two
   shuffles run twice: with the default per-batch global-RNG seeding (``global_rng="batch"``, which
   no peer has) and with ``global_rng=None``, what the pipeline itself costs.
2. Restore: 16 shards x 62,500 records (10^6); a state is taken at 0, 50 and 90 % of the epoch and
   restored into a freshly built loader, timed from ``load_state_dict`` to the first batch in hand
   (with workers also to the second: warm start moves the workers' start there). Restores are
   interleaved over the methods in each round, the positions' order turned by one each round; each
   method's cell process first iterates a plain one-batch DataLoader, so torch's one-time first-use
   costs are not counted in its first restore.

Every epoch of 1. and every method's checkpoints and restores of 2. run in a process of their own: a
peer's threads and shared memory outlive its loader and would slow down whatever ran next beside them.
3. State size: the JSON (ours) or pickled (peers) state at 50 %, and ``shuffle_window`` over 10^4 shards.
4. Elastic: ``shuffle_window(10_000)`` over 10^5 shards of known sizes (in memory), a state of two
   ranks at 30 % merged and loaded by rank 0 of three: ``load_state_dict`` plus the first batch.
5. Mixing, ``shuffle_window`` against ``shuffle_buffer`` of the same size over the records' keys
   (16 shards x 12,500): how far a record moves from its place in the unshuffled stream (mean
   and 99th percentile of |output position - input position|) and the share of batches whose 32
   records all come from one shard.

6. LLM data: 10^6 token documents in two in-memory sources, each through ``shuffle_buffer(1000)``,
   ``mix`` with a schedule, ``pack(1024)``: restore at 90 % (``load_state_dict`` plus the first batch,
   checked equal); and the steady-state cost per token of ``pack`` next to reading stored windows.

Run: ``python benchmarks/bench_streams.py`` (``--quick``: small sizes, one round: a smoke test of
every method and check, not a measurement). The peers need the ``[peers]`` extra; without it their
rows say "not installed". They do not install beside the ``[hf]`` extra (Mosaic pins numpy < 2.2
and transformers, which pins huggingface_hub < 1.0): use a separate environment.
"""

from __future__ import annotations

import gc
import itertools
import json
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _peers
import numpy as np
import torch
from _common import (
    busy_work,
    calibrate_work,
    format_seconds,
    machine_header,
    markdown_table,
    parse_args,
    run_isolated,
    timed_epoch,
    write_report,
)

from resumable_data.streams import ShardedIterable, Stream, StreamLoader, TokenShardReader, mix

BATCH = 32
BUFFER = 10_000
SHARDS = 16
WORK_US = 50.0
FRACTIONS = (0.0, 0.5, 0.9)


# -- data and the loaders compared -------------------------------------------------------------------
def write_shards(directory: Path, num_shards: int, per_shard: int) -> list[Path]:
    paths = []
    for s in range(num_shards):
        ids = np.arange(s * per_shard, (s + 1) * per_shard, dtype=np.int32)
        path = directory / f"tok_{s:04d}.bin"
        np.repeat(ids, 2).tofile(path)
        paths.append(path)
    return paths


class Busy:
    """``map``'s work: ``iterations`` of busy loop, the record unchanged (picklable for workers)."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations

    def __call__(self, record: torch.Tensor) -> torch.Tensor:
        busy_work(int(record[0]), self.iterations)
        return record


class MapStyle(torch.utils.data.Dataset):
    """The same records as a map-style dataset: what a plain DataLoader reads."""

    def __init__(self, paths: list[Path], per_shard: int, iterations: int) -> None:
        self.paths, self.per_shard, self.busy = paths, per_shard, Busy(iterations)
        self._tokens: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.paths) * self.per_shard

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._tokens is None:  # opened in the process that reads (a worker)
            self._tokens = [np.memmap(p, dtype=np.int32, mode="r") for p in self.paths]
        shard, offset = divmod(index, self.per_shard)
        record = torch.from_numpy(self._tokens[shard][2 * offset : 2 * offset + 2].astype(np.int64))
        return self.busy(record)


def source(paths: list[Path], per_shard: int) -> ShardedIterable:
    reader = TokenShardReader(2, dtype=np.int32)
    return ShardedIterable(paths, read_shard=reader, seed=0, sizes=[per_shard] * len(paths))


def ours(
    paths: list[Path], per_shard: int, shuffle: str, iterations: int = 0, global_rng: str | None = "batch"
) -> Callable[[int], StreamLoader]:
    def make(workers: int) -> StreamLoader:
        stream: Stream = source(paths, per_shard)
        stream = stream.shuffle_buffer(BUFFER, seed=1) if shuffle == "buffer" else stream.shuffle_window(BUFFER, seed=1)
        if iterations:
            stream = stream.map(Busy(iterations))
        return StreamLoader(stream, batch_size=BATCH, num_workers=workers, global_rng=global_rng)

    return make


def record_ids(batch: Any) -> list[int]:
    return batch[:, 0].tolist()


# -- the methods, built by name in a cell process -----------------------------------------------------
PLAIN = "DataLoader (map-style, shuffled)"
OURS_BUFFER = f"StreamLoader, shuffle_buffer({BUFFER:,})"
OURS_WINDOW = f"StreamLoader, shuffle_window({BUFFER:,})"
# The same two without the per-batch global-RNG seeding (global_rng=None: records that draw no global
# randomness, as here, need none), which no peer does: what the pipeline itself costs.
NO_SEEDING = ", global_rng=None"
OURS = {
    OURS_BUFFER: ("buffer", "batch"),
    OURS_WINDOW: ("window", "batch"),
    OURS_BUFFER + NO_SEEDING: ("buffer", None),
    OURS_WINDOW + NO_SEEDING: ("window", None),
}
PEERS = {"litdata": "litdata 0.2.76", "mosaic": "Mosaic Streaming 0.13.0"}


def build(method: str, data: dict[str, Any], iterations: int, workers: int) -> Any:
    """The loader ``method`` names over ``data`` (``paths`` and ``per_shard``, and each peer's folder)."""
    paths, per_shard = [Path(p) for p in data["paths"]], data["per_shard"]
    if method == PLAIN:
        dataset = MapStyle(paths, per_shard, iterations)
        return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers)
    if method in OURS:
        shuffle, global_rng = OURS[method]
        return ours(paths, per_shard, shuffle, iterations, global_rng)(workers)
    peer = next(p for p, name in PEERS.items() if name == method)
    make = _peers.litdata_loader if peer == "litdata" else _peers.mosaic_loader
    return make(Path(data[peer]), batch_size=BATCH, workers=workers, transform=Busy(iterations) if iterations else None)


# Each cell runs in a process of its own (``run_isolated``): a peer's threads and shared memory
# outlive its loader, and in a shared process they would slow down whatever is timed next.
def epoch_cell(method: str, data: dict[str, Any], iterations: int, workers: int) -> dict[str, Any]:
    """1. Throughput: the seconds of one epoch, checked to yield every record once."""
    torch.set_num_threads(1)
    loader = build(method, data, iterations, workers)
    return timed_epoch(loader, record_ids, len(data["paths"]) * data["per_shard"])


def checkpoints_cell(method: str, data: dict[str, Any], workers: int, epoch_batches: int) -> dict[str, Any]:
    """2. One pass: at each fraction, (batches consumed, the pickled state, the next two batches' ids)."""
    torch.set_num_threads(1)
    loader = build(method, data, 0, workers)
    batches = iter(loader)
    out = []
    consumed = 0
    for fraction in FRACTIONS:
        target = int(fraction * epoch_batches)
        for _ in itertools.islice(batches, target - consumed):
            pass
        consumed = target
        state = pickle.dumps(loader.state_dict())
        first, second = next(batches), next(batches)
        consumed += 2
        out.append((target, state, record_ids(first), record_ids(second)))
    return {"taken": out}


def warm_up_dataloader() -> None:
    """One epoch of a one-batch DataLoader of tensors, so that torch's first-use costs in a process are paid
    before a timed restore: about 2.5 ms here, on the first iteration of any DataLoader (restored
    or not, ours, litdata's or Mosaic's): the profiler hook it opens per batch imports a module at
    its first use, the first draw of the base seed from a generator sets that op up, and the first
    collation stacks tensors for the first time. A training process has paid them before it
    restores (its model's initialization draws, its first steps)."""
    records = [torch.zeros(2, dtype=torch.int64)] * 2
    for _ in torch.utils.data.DataLoader(records, batch_size=2, generator=torch.Generator()):
        pass


def restore_cell(method: str, data: dict[str, Any], workers: int, taken: list[Any]) -> dict[str, Any]:
    """2. Each checkpoint restored into a freshly built loader: seconds to the first and second
    batch (NaN where a restored batch differs from the uninterrupted run's)."""
    torch.set_num_threads(1)
    warm_up_dataloader()
    times = []
    for _, state, first, second in taken:
        loader = build(method, data, 0, workers)
        gc.collect()
        start = time.perf_counter()
        loader.load_state_dict(pickle.loads(state))
        batches = iter(loader)
        got_first = record_ids(next(batches))
        t_first = time.perf_counter() - start
        got_second = record_ids(next(batches))
        t_second = time.perf_counter() - start
        del batches, loader
        _peers.release_mosaic()
        exact = (got_first, got_second) == (first, second)
        times.append((t_first, t_second) if exact else (float("nan"), float("nan")))
    return {"times": times}


def isolated(fn: Callable[..., dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    result = run_isolated(fn, kwargs, timeout_s=1200)
    if "error" in result:
        raise SystemExit(f"{fn.__name__} {kwargs.get('method')}: {result['error']}")
    return result


# -- 4. elastic and 5. mixing over in-memory shards ---------------------------------------------------
class RangeShards:
    """``read_shard`` of in-memory shards ``s0, s1, ...`` of ``per_shard`` records: record ids."""

    def __init__(self, per_shard: int) -> None:
        self.per_shard = per_shard

    def __call__(self, shard: str, start: int) -> Iterator[int]:
        base = int(shard[1:]) * self.per_shard
        return iter(range(base + start, base + self.per_shard))

    def read_records(self, shard: str, offsets: list[int]) -> list[int]:
        base = int(shard[1:]) * self.per_shard
        return [base + o for o in offsets]


def memory_source(num_shards: int, per_shard: int, *, seed: int = 0) -> ShardedIterable:
    names = [f"s{i}" for i in range(num_shards)]
    return ShardedIterable(names, read_shard=RangeShards(per_shard), seed=seed, sizes=[per_shard] * num_shards)


def elastic(num_shards: int, per_shard: int, rounds: int) -> tuple[list[float], int]:
    def make(rank: int, world: int) -> StreamLoader:
        stream = memory_source(num_shards, per_shard).shuffle_window(BUFFER, seed=1)
        return StreamLoader(stream, batch_size=BATCH, rank=rank, world_size=world)

    old = [make(r, 2) for r in range(2)]
    per_rank = int(0.3 * num_shards * per_shard / 2 / BATCH)
    for loader in old:
        for _ in itertools.islice(iter(loader), per_rank):
            pass
    states = [json.loads(json.dumps(loader.state_dict())) for loader in old]
    times = []
    for _ in range(rounds):
        new = make(0, 3)
        gc.collect()
        start = time.perf_counter()
        new.load_state_dict(StreamLoader.merge_states(states))
        next(iter(new))
        times.append(time.perf_counter() - start)
    return times, len(json.dumps(StreamLoader.merge_states(states)))


def mixing(num_shards: int, per_shard: int) -> dict[str, tuple[float, float, float]]:
    unshuffled = list(memory_source(num_shards, per_shard))
    place = {record: i for i, record in enumerate(unshuffled)}
    out = {}
    for name in ("shuffle_window", "shuffle_buffer"):
        stream = memory_source(num_shards, per_shard)
        stream_ = (
            stream.shuffle_window(BUFFER, seed=1) if name == "shuffle_window" else stream.shuffle_buffer(BUFFER, seed=1)
        )
        got = list(stream_)
        moved = np.abs(np.array([place[r] for r in got]) - np.arange(len(got)))
        shards = np.array(got) // per_shard
        batches = shards[: len(shards) // BATCH * BATCH].reshape(-1, BATCH)
        one_shard = float(np.mean(batches.min(axis=1) == batches.max(axis=1)))
        out[name] = (float(moved.mean()), float(np.percentile(moved, 99)), one_shard)
    return out


# -- 6. LLM data: packed documents (issue 22) ------------------------------------------------------
BLOCK = 1024
LLM_BATCH = 8


class DocShards:
    """``read_shard`` of in-memory shards ``d0, d1, ...`` of ``per_shard`` token documents (plus ``base``):
    document ``i`` is ``i, i + 1, ...`` (mod 50,000) and 8 to 119 tokens long, fixed by ``i``."""

    def __init__(self, per_shard: int, base: int = 0) -> None:
        self.per_shard, self.base = per_shard, base

    @staticmethod
    def length(i: int) -> int:
        return 8 + (i * 2654435761) % 112

    def doc(self, i: int) -> np.ndarray:
        return np.arange(i, i + self.length(i), dtype=np.int64) % 50_000

    def __call__(self, shard: str, start: int) -> Iterator[np.ndarray]:
        first = self.base + int(shard[1:]) * self.per_shard
        return (self.doc(first + o) for o in range(start, self.per_shard))

    def read_records(self, shard: str, offsets: list[int]) -> list[np.ndarray]:
        first = self.base + int(shard[1:]) * self.per_shard
        return [self.doc(first + o) for o in offsets]


def doc_source(num_shards: int, per_shard: int, base: int, seed: int) -> ShardedIterable:
    names = [f"d{i}" for i in range(num_shards)]
    return ShardedIterable(names, read_shard=DocShards(per_shard, base), seed=seed, sizes=[per_shard] * num_shards)


def packed_tokens(num_docs: int) -> int:
    """Tokens of documents ``0 .. num_docs - 1`` with one EOS after each."""
    i = np.arange(num_docs, dtype=np.int64)
    return int((8 + (i * 2654435761) % 112).sum()) + num_docs


def llm_loader(num_docs: int) -> StreamLoader:
    """Two sources of ``num_docs / 2`` documents, each through ``shuffle_buffer(1000)``, mixed 70/30 and
    then 50/50 after a quarter of the documents, packed into windows of 1024 tokens, batches of 8."""
    half, shards = num_docs // 2, 16
    web = doc_source(shards, half // shards, 0, seed=3).shuffle_buffer(1000, seed=4)
    code = doc_source(shards, half // shards, half, seed=5).shuffle_buffer(1000, seed=6)
    schedule = [(0, [0.7, 0.3]), (num_docs // 4, [0.5, 0.5])]
    stream = mix([web, code], weights=schedule, seed=7).pack(BLOCK, eos=0)
    return StreamLoader(stream, batch_size=LLM_BATCH)


def llm_restore(num_docs: int, rounds: int) -> tuple[list[float], int, int]:
    """Restore at 90 % of an epoch of the packed, mixed, buffered stream: times, state bytes, position."""
    position = int(0.9 * packed_tokens(num_docs) // BLOCK // LLM_BATCH)
    loader = llm_loader(num_docs)
    batches = iter(loader)
    for _ in itertools.islice(batches, position):
        pass
    state = json.loads(json.dumps(loader.state_dict()))
    expected = next(batches)
    del batches, loader
    times = []
    for _ in range(rounds):
        fresh = llm_loader(num_docs)
        gc.collect()
        start = time.perf_counter()
        fresh.load_state_dict(state)
        got = next(iter(fresh))
        times.append(time.perf_counter() - start)
        if not torch.equal(got, expected):
            times[-1] = float("nan")
    return times, len(json.dumps(state)), position


class WindowShards(DocShards):
    """The same kind of shards as fixed windows of ``BLOCK + 1`` tokens: a plain windowed read."""

    def doc(self, i: int) -> np.ndarray:
        return np.arange(i, i + BLOCK + 1, dtype=np.int64) % 50_000


def per_token(tokens: int, rounds: int) -> dict[str, list[float]]:
    """ns per token of one epoch through StreamLoader (0 workers): windows read as they are stored, and
    documents packed into windows of the same size; the two interleaved in each round."""
    windows, docs = tokens // (BLOCK + 1), tokens // 64  # 64.5 tokens a document with its EOS, on average
    makes = {
        f"windowed read ({BLOCK + 1}-token records)": lambda: StreamLoader(
            ShardedIterable(["d0"], read_shard=WindowShards(windows), seed=0, sizes=[windows]), batch_size=LLM_BATCH
        ),
        f"pack({BLOCK}) of 8–119-token documents": lambda: StreamLoader(
            ShardedIterable(["d0"], read_shard=DocShards(docs), seed=0, sizes=[docs]).pack(BLOCK, eos=0),
            batch_size=LLM_BATCH,
        ),
    }
    out: dict[str, list[float]] = {name: [] for name in makes}
    for _ in range(rounds):
        for name, make in makes.items():
            loader = make()
            start = time.perf_counter()
            seen = sum(batch.numel() for batch in loader)
            out[name].append((time.perf_counter() - start) / seen * 1e9)
    return out


# -- report ----------------------------------------------------------------------------------------
def spread(values: list[float], fmt: Callable[[float], str] = format_seconds) -> str:
    good = [v for v in values if v == v]
    if len(good) < len(values):
        return "not exact"
    return f"{fmt(statistics.median(good))} ({fmt(min(good))}–{fmt(max(good))})"


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    quick = args.quick
    rounds = 1 if quick else 5
    restore_rounds = 1 if quick else 5
    per_t = 100 if quick else 3125
    per_r = 500 if quick else 62_500
    iterations = calibrate_work(WORK_US)
    found = _peers.available()
    started = time.perf_counter()
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-streams-") as tmp:
        root = Path(tmp)
        (root / "t").mkdir()
        (root / "r").mkdir()
        t_paths, r_paths = write_shards(root / "t", SHARDS, per_t), write_shards(root / "r", SHARDS, per_r)
        n_t, n_r = SHARDS * per_t, SHARDS * per_r
        peers_t: dict[str, Path] = {}
        peers_r: dict[str, Path] = {}
        for peer, write in (("litdata", _peers.write_litdata), ("mosaic", _peers.write_mosaic)):
            if found[peer] is None:
                peers_t[peer], peers_r[peer] = write(root / "t", n_t), write(root / "r", n_r)
                print(f"wrote {peer} data", flush=True)
        data_t = {"paths": [str(p) for p in t_paths], "per_shard": per_t, **{k: str(v) for k, v in peers_t.items()}}
        data_r = {"paths": [str(p) for p in r_paths], "per_shard": per_r, **{k: str(v) for k, v in peers_r.items()}}

        # 1. throughput
        # Each method's epoch runs right beside one of the plain DataLoader's (which goes first
        # alternates by round), and the ratio is taken within that pair: on a shared machine the
        # speed drifts by ±20 % over tens of seconds, far more than the differences measured.
        methods = [*OURS, *(PEERS[p] for p in peers_t)]
        seconds: dict[tuple[str, int], list[float]] = {}
        ratios: dict[tuple[str, int], list[float]] = {}
        for round_ in range(rounds):
            for workers in (0, 2):
                for name in methods:
                    pair = (PLAIN, name) if round_ % 2 == 0 else (name, PLAIN)
                    got = {
                        m: isolated(epoch_cell, method=m, data=data_t, iterations=iterations, workers=workers)[
                            "seconds"
                        ]
                        for m in pair
                    }
                    for m in pair:
                        seconds.setdefault((m, workers), []).append(got[m])
                    ratios.setdefault((name, workers), []).append(got[PLAIN] / got[name])
                    print(
                        f"round {round_ + 1}, {workers} workers: {name} {got[name]:.2f} s, {PLAIN} {got[PLAIN]:.2f} s",
                        flush=True,
                    )
        rows = [[PLAIN, spread(seconds[(PLAIN, 0)]), "1", spread(seconds[(PLAIN, 2)]), "1"]]
        for name in methods:
            row = [name]
            for workers in (0, 2):
                row += [spread(seconds[(name, workers)]), spread(ratios[(name, workers)], lambda x: f"{x:.2f}")]
            rows.append(row)
        for peer, why in found.items():
            if why is not None:
                rows.append([peer, why, "", "", ""])
        lines += [
            f"## 1. Throughput: one epoch of {n_t:,} records, {WORK_US:.0f} µs of work each, batches of {BATCH}",
            "",
            f"Median (min–max) over {rounds} round(s), each epoch in a process of its own, each method's beside one "
            "of the plain DataLoader's (which one goes first alternates by round); the ratio is the DataLoader's "
            "epoch time over the method's within each pair (≥ 1: as fast or faster).",
            "",
            markdown_table(["method", "0 workers", "÷ DataLoader", "2 workers", "÷ DataLoader"], rows),
            "",
        ]

        # 2. restore
        epoch_batches = n_r // BATCH
        restorers: dict[str, tuple[str, int]] = {
            f"{OURS_WINDOW}, 0 workers": (OURS_WINDOW, 0),
            f"{OURS_WINDOW}, 2 workers": (OURS_WINDOW, 2),
            f"{OURS_BUFFER}, 0 workers": (OURS_BUFFER, 0),
            **{f"{peer}, {w} workers": (PEERS[peer], w) for peer in peers_r for w in (0, 2)},
        }
        taken = {}
        for name, (method, workers) in restorers.items():
            cell = isolated(checkpoints_cell, method=method, data=data_r, workers=workers, epoch_batches=epoch_batches)
            taken[name] = cell["taken"]
            print(f"checkpoints taken: {name}", flush=True)
        timings: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for round_ in range(restore_rounds):
            # The positions' order turns each round, so that a process's first restore (which pays
            # the first use of whatever it touches) falls on each position in turn.
            order = [(f + round_) % len(FRACTIONS) for f in range(len(FRACTIONS))]
            for name, (method, workers) in restorers.items():
                states = [taken[name][f] for f in order]
                cell = isolated(restore_cell, method=method, data=data_r, workers=workers, taken=states)
                for f, t in zip(order, cell["times"], strict=True):
                    timings.setdefault((name, f), []).append(t)
            print("restore round done", flush=True)
        rows = []
        for name in restorers:
            row = [name]
            for f in range(len(FRACTIONS)):
                row.append(spread([t[0] for t in timings[(name, f)]]))
            row.append(spread([t[1] for t in timings[(name, len(FRACTIONS) - 1)]]))
            state = pickle.loads(taken[name][1][1])
            try:
                size = f"{len(json.dumps(state)):,} B (JSON)"
            except TypeError:
                size = f"{len(pickle.dumps(state)):,} B (pickle)"
            row.append(size)
            rows.append(row)
        for peer, why in found.items():
            if why is not None:
                rows.append([peer, why, "", "", "", ""])
        headers = [
            "method",
            *[f"first batch at {f:.0%}" for f in FRACTIONS],
            f"second batch at {FRACTIONS[-1]:.0%}",
            "state at 50 %",
        ]
        lines += [
            f"## 2. Restore to the first batch: {n_r:,} records in {SHARDS} shards",
            "",
            f"From `load_state_dict` into a freshly built loader to the batch in hand; median (min–max) over "
            f"{restore_rounds} round(s), methods and positions interleaved; every restored batch (and the next) "
            "checked equal to the uninterrupted run's ('not exact' otherwise).",
            "",
            markdown_table(headers, rows),
            "",
        ]

    # 3. state size at 10^4 shards (in memory)
    wide = StreamLoader(memory_source(10_000, 3 if quick else 100).shuffle_window(BUFFER, seed=1), batch_size=BATCH)
    for _ in itertools.islice(iter(wide), 50):
        pass
    lines += [
        f"## 3. State size: `shuffle_window({BUFFER:,})` over 10,000 shards of known sizes, after 50 batches: "
        f"{len(json.dumps(wide.state_dict())):,} B (JSON)",
        "",
    ]
    # 4. elastic
    num_shards = 300 if quick else 100_000
    times, size = elastic(num_shards, 10, restore_rounds)
    lines += [
        f"## 4. Elastic: {num_shards:,} shards x 10 records, `shuffle_window({BUFFER:,})`, 2 ranks -> 3 at 30 %",
        "",
        f"merge_states + load_state_dict + first batch on rank 0: {spread(times)}; the merged state: {size:,} B "
        "(each new slot's state is a position plus the old slots' positions: nothing is listed per shard).",
        "",
    ]
    # 5. mixing
    mixed = mixing(SHARDS, 200 if quick else 12_500)
    lines += [
        f"## 5. Mixing over {SHARDS} shards x {200 if quick else 12_500:,} records, size {BUFFER:,}",
        "",
        markdown_table(
            ["shuffle", "mean |moved|", "99th percentile |moved|", f"batches of {BATCH} from one shard"],
            [[name, f"{m:,.0f}", f"{p:,.0f}", f"{one:.1%}"] for name, (m, p, one) in mixed.items()],
        ),
        "",
    ]
    # 6. LLM data
    num_docs = 20_000 if quick else 1_000_000
    times, size, position = llm_restore(num_docs, restore_rounds)
    costs = per_token(10**5 if quick else 2 * 10**7, rounds)
    lines += [
        f"## 6. LLM data: {num_docs:,} documents (8–119 tokens), two sources through `shuffle_buffer(1000)`, "
        f"`mix` with a schedule (70/30, then 50/50), `pack({BLOCK}, eos=0)`, batches of {LLM_BATCH}",
        "",
        f"Restore at 90 % (batch {position:,}): load_state_dict + first batch {spread(times)}, checked equal to "
        f"the uninterrupted batch; the state: {size:,} B (JSON).",
        "",
        markdown_table(
            ["one epoch, 0 workers", f"ns per token, median (min–max) of {rounds}"],
            [[name, spread(v, lambda x: f"{x:.0f}")] for name, v in costs.items()],
        ),
        "",
        f"Total run time: {time.perf_counter() - started:.0f} s.",
    ]
    text = "\n".join(
        [machine_header("Streams: throughput, restore, state, against litdata and Mosaic Streaming"), *lines]
    )
    print()
    print(text)
    write_report(args.out, "streams", text)


if __name__ == "__main__":
    main()
