"""Time from "checkpoint in hand" to "first resumed batch in hand", and its peak memory.

Methods, as a user would build each one:

- naive skip: ``DataLoader(sampler=RandomSampler(generator=g))``; iterate and discard k batches.
- index-only skip: the same order, but the batch sampler drops its first k batches before any
  sample is loaded (what ``accelerate.skip_first_batches`` does).
- StatefulDataLoader: torchdata's, with its stateful ``RandomSampler(generator=g)``;
  ``load_state_dict`` + ``next(iter(loader))``.
- torchdata.nodes: ``SamplerWrapper(BatchSampler(RandomSampler))`` → ``Mapper`` / ``ParallelMapper``
  (threads) → ``Prefetcher`` → ``Loader``, as in torchdata's migration guide; ``load_state_dict`` +
  ``next(iter(loader))``.
- resumable_data: ``ResumableDataLoader``; ``load_state_dict`` + ``next(iter(loader))``.
- resumable_data, warm start: the same with ``warm_start=True`` (the main process fetches the
  first batch while the workers start); only with workers, where it changes anything.
- Grain (torchtitan's loader now; optional, see ``_grain.py``): ``grain.python.DataLoader`` with a
  shuffled ``IndexSampler``, ``Batch(32)`` and ``worker_count`` 0 or 2; ``set_state`` on a fresh
  iterator + ``next``. Skipped, with a line that says why, where Grain does not import.

Epoch start: one more table times a fresh epoch of a running job (the second epoch of a loader,
2 workers, persistent or not, with and without warm start): its first batch and its total time,
over interleaved rounds, each epoch checked to be the same batches in every variant.

"Checkpoint in hand" is the method's own state dict (already deserialized) and a freshly built
loader. The state for position k is the method's real state after one batch with its position
counters set to k, which is what it would have saved after k batches; producing it by iterating k
batches would take the naive skip's time again for every cell. The exactness column confirms that
each restore lands on batch k: the resumed batches (the timed first one and the next ones, up to
``CHECKED_BATCHES``, taken after the clock stops) are compared with batches k, k + 1, ... of an
uninterrupted run of the method's own sampler (computed once per sampler and size, outside the
timed region). A method that resumes wrong gets no figure: its cells say "no figure: resumed
wrong". The state size is the bytes of the checkpoint as saved: pickled for a state dict, the JSON
Grain's ``get_state()`` returns (what its checkpoint handler writes) for Grain.

The floor: in every resumable_data cell with a dataset, the same process also times the first
batch of a fresh, unshuffled plain ``DataLoader`` over the same dataset with the same workers
(``DataLoader(dataset, batch_size=32, num_workers=w)``: no state, no permutation), interleaved with
the restores. It is what any loader pays to hand out a first batch (worker start-up, fetching and
collating 32 samples); the target is a restore within 2x of it at every N and position.

Every cell runs in a fresh process (see ``_common.run_isolated``), so its peak RSS is its own.

    python benchmarks/bench_resume.py            # full run, writes benchmarks/results/
    python benchmarks/bench_resume.py --quick    # < 1 minute smoke test, writes to a temp dir
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import pickle
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common  # first: it puts this checkout's resumable_data on the path
import _grain
import numpy as np
import torch
import torchdata.nodes as tn
from _common import (
    PeakMemory,
    SyntheticDataset,
    format_count,
    format_seconds,
    markdown_table,
    repeat_timed,
    run_isolated,
    seeded_generator,
)
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler, default_collate
from torchdata.stateful_dataloader.sampler import BatchSampler as StatefulBatchSampler
from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

from resumable_data import ResumableSampler
from resumable_data.core.permutation import Permutation

# torchdata 0.11 calls a deprecated torch API on every StatefulDataLoader; the warning is noise here.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

NAIVE = "naive skip"
INDEX_SKIP = "index-only skip"
STATEFUL = "StatefulDataLoader"
NODES = "torchdata.nodes"
OURS = "resumable_data"
WARM = "resumable_data, warm start"
GRAIN = _grain.NAME
DATA_METHODS = (NAIVE, INDEX_SKIP, STATEFUL, NODES, OURS, WARM, GRAIN)
OURS_METHODS = (OURS, WARM)  # one loader, one state format, one order: they share a reference
# Without a dataset, discarding batches *is* the index-only skip, so the naive skip has no row there.
INDEX_METHODS = (INDEX_SKIP, STATEFUL, NODES, OURS)
SKIP_METHODS = (NAIVE, INDEX_SKIP)


BATCH_SIZE = 32
SEED = 1234
# The baselines draw randperm(N) (8 B per index) and turn it into a Python list (a pointer plus an
# int object, 40 B per index): what one restore holds at its peak.
BASELINE_BYTES_PER_INDEX = 48
MEMORY_CAP_BYTES = 4 * 2**30  # the machine is shared: no baseline cell may need more
# Up to this size the reference is an uninterrupted run of the method's own loader. Above it, an
# uninterrupted iteration of the method's sampler (a loader run with workers would take minutes), and
# above ITERATED_REFERENCE_LIMIT, for resumable_data, the permutation evaluated at the target positions
# (iterating 10^9 indices is what no one can afford).
LOADER_REFERENCE_LIMIT = 10**5
# Grain's loader reads about 3,000 records/s here (0 µs/sample, with or without workers): above this
# size its reference is its sampler, laid out over workers as its loader does (see _grain.py).
GRAIN_LOADER_REFERENCE_LIMIT = 10**4
ITERATED_REFERENCE_LIMIT = 10**7
CELL_TIMEOUT_FLOOR_S = 30
# Every restore is checked on this many batches from its position on (fewer at the epoch's end).
CHECKED_BATCHES = 3


@dataclass(frozen=True)
class Plan:
    """Which cells a run measures."""

    index_sizes: tuple[int, ...]  # index generation alone (no dataset)
    index_focus: tuple[int, ...]  # the index sizes shown "vs position"
    data_sizes: tuple[int, ...]  # with a dataset; the largest is the "vs position" sweep
    positions: tuple[int, ...]  # percent of the epoch consumed at the checkpoint
    configs: tuple[tuple[float, int], ...]  # (per-sample work in µs, num_workers)
    vs_size_position: int  # the position of the "vs N" sweeps
    max_reps: int
    epoch_n: int  # epoch-start table: samples per epoch (50 µs each)
    epoch_rounds: int


FULL = Plan(
    index_sizes=(10**4, 10**5, 10**6, 10**7, 10**8, 10**9),
    index_focus=(10**7, 10**9),
    data_sizes=(10**4, 10**5, 10**6, 10**7),
    positions=(0, 10, 50, 90, 99),
    configs=((0.0, 0), (0.0, 2), (50.0, 0), (50.0, 2)),
    vs_size_position=90,
    max_reps=5,
    epoch_n=6400,
    epoch_rounds=8,
)
# A smoke test of every method, check, table and plot, in few cells: each is a process start.
QUICK = Plan(
    index_sizes=(10**3, 10**9),
    index_focus=(10**9,),
    data_sizes=(10**3,),
    positions=(90,),
    configs=((0.0, 0), (50.0, 2)),
    vs_size_position=90,
    max_reps=1,
    epoch_n=320,
    epoch_rounds=1,
)
# What a restore is compared with: the first batch of a plain, unshuffled DataLoader.
FLOOR = "floor: fresh unshuffled DataLoader"
FLOOR_TARGET = 2.0  # restore ≤ 2× the floor
REFUSED = "no figure: resumed wrong"


class DeadlineExceeded(Exception):
    """A skip baseline ran out of time after ``done`` of the batches it had to skip."""

    def __init__(self, done: int) -> None:
        super().__init__(done)
        self.done = done


class SkipBatches(Sampler[list[int]]):
    """Drops the first ``skip`` batches of ``batch_sampler`` before the loader fetches anything."""

    def __init__(self, batch_sampler: BatchSampler, skip: int, deadline_at: float) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip
        self.deadline_at = deadline_at

    def __iter__(self) -> Iterator[list[int]]:
        batches = iter(self.batch_sampler)
        for done in range(self.skip):
            next(batches)
            # Checking the clock every batch would cost as much as the skipping itself.
            if done % 4096 == 4095 and time.perf_counter() > self.deadline_at:
                raise DeadlineExceeded(done + 1)
        yield from batches

    def __len__(self) -> int:
        return len(self.batch_sampler) - self.skip


class MapAndCollate:
    """torchdata.nodes' recipe for a map-style dataset: load a batch of indices and collate it."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, indices: list[int]) -> Any:
        return default_collate([self.dataset[i] for i in indices])


# -- building each method's loader and its checkpoint -------------------------------------------


def _nodes_loader(dataset: Sized, *, workers: int) -> tn.Loader:
    batches = BatchSampler(RandomSampler(dataset, generator=seeded_generator(SEED)), BATCH_SIZE, drop_last=False)
    node: tn.BaseNode = tn.SamplerWrapper(batches)
    if workers:
        # Threads, not processes: with method="process" this pipeline deadlocked at its first batch
        # in about 1 % of loader starts here (it forks while its own threads run). Threads also
        # start faster, which if anything favours nodes in a time-to-first-batch benchmark.
        node = tn.ParallelMapper(node, MapAndCollate(dataset), num_workers=workers, method="thread", in_order=True)
    else:
        node = tn.Mapper(node, MapAndCollate(dataset))
    return tn.Loader(tn.Prefetcher(node, prefetch_factor=2))


_BUILDERS: dict[str, Callable[..., Any]] = {
    STATEFUL: functools.partial(_common.stateful_loader, batch_size=BATCH_SIZE, seed=SEED),
    NODES: _nodes_loader,
    OURS: functools.partial(_common.resumable_loader, batch_size=BATCH_SIZE, seed=SEED, warm_start=False),
    WARM: functools.partial(_common.resumable_loader, batch_size=BATCH_SIZE, seed=SEED, warm_start=True),
    GRAIN: functools.partial(_grain.loader, batch_size=BATCH_SIZE, seed=SEED),
}


def _set_keys(state: Any, names: tuple[str, ...], value: int) -> None:
    """Set every ``names`` key anywhere in a nested state dict to ``value``."""
    if isinstance(state, dict):
        for key, child in state.items():
            if key in names:
                state[key] = value
            else:
                _set_keys(child, names, value)


def _stateful_state_at(state: dict[str, Any], k: int, workers: int) -> dict[str, Any]:
    """torchdata 0.11's StatefulDataLoader state after one batch, moved to k batches."""
    _set_keys(state, ("_num_yielded", "_sampler_iter_yielded", "_snapshot_step"), k)
    _set_keys(state, ("samples_yielded", "yielded"), k * BATCH_SIZE)
    if workers:
        # Batches go to workers round-robin; the restored loader continues after this worker.
        state["_snapshot"]["_last_yielded_worker_id"] = (k - 1) % workers
    return state


def _state_after_one_batch(loader: Any) -> Any:
    iterator = iter(loader)
    next(iterator)
    # Grain keeps the state on the iterator, the others on the loader.
    state = iterator.get_state() if hasattr(iterator, "get_state") else loader.state_dict()
    del iterator  # shuts its workers down
    return state


def _checkpoint(method: str, dataset: SyntheticDataset, k: int, workers: int) -> Any:
    if method == STATEFUL:
        return _stateful_state_at(_state_after_one_batch(_BUILDERS[STATEFUL](dataset, workers=workers)), k, workers)
    if method == NODES:
        state = _state_after_one_batch(_nodes_loader(dataset, workers=workers))
        _set_keys(state, ("num_yielded", "_num_yielded"), k)
        return state
    if method == GRAIN:
        state = _state_after_one_batch(_BUILDERS[GRAIN](dataset, workers=workers))
        return _grain.state_at(state, k, batch_size=BATCH_SIZE, workers=workers)
    state = _state_after_one_batch(_BUILDERS[method](dataset, workers=workers))
    state["position"] = k * BATCH_SIZE  # the documented, editable field: global samples consumed
    return state


# -- the cells ------------------------------------------------------------------------------------


def _with_next(first: Any, iterator: Iterator[Any], count: int) -> list[torch.Tensor]:
    """``first`` and the iterator's next ``count - 1`` batches (taken after the clock stopped), as tensors."""
    # Grain hands out numpy arrays; the checks compare tensors.
    return [torch.as_tensor(batch) for batch in (first, *itertools.islice(iterator, count - 1))]


def _skip_cell(
    method: str, dataset: SyntheticDataset, k: int, workers: int, deadline_s: float, count: int
) -> tuple[float, list[torch.Tensor] | None, str]:
    """Build the loader, skip k batches, take the next (timed) and ``count - 1`` more.

    Returns (seconds, batches or None, note).
    """
    start = time.perf_counter()
    if method == INDEX_SKIP:
        sampler = RandomSampler(dataset, generator=seeded_generator(SEED))
        skipping = SkipBatches(BatchSampler(sampler, BATCH_SIZE, drop_last=False), k, start + deadline_s)
        iterator = iter(DataLoader(dataset, batch_sampler=skipping, num_workers=workers))
        try:
            batch = next(iterator)
        except DeadlineExceeded as stop:
            elapsed = time.perf_counter() - start
            return (
                elapsed * k / stop.done,
                None,
                f"> {deadline_s:.0f} s deadline: extrapolated (linear from {stop.done} batches)",
            )
        seconds = time.perf_counter() - start
        return seconds, _with_next(batch, iterator, count), ""
    iterator = iter(_common.plain_loader(dataset, batch_size=BATCH_SIZE, seed=SEED, workers=workers))
    batch = next(iterator)
    first = time.perf_counter() - start  # start-up: the permutation and the workers
    for done in range(1, k + 1):
        batch = next(iterator)
        elapsed = time.perf_counter() - start
        if elapsed > deadline_s and done < k:
            per_batch = (elapsed - first) / done
            estimate = first + k * per_batch
            return estimate, None, f"> {deadline_s:.0f} s deadline: extrapolated (linear from {done} batches)"
    seconds = time.perf_counter() - start
    return seconds, _with_next(batch, iterator, count), ""


def _restore_once(
    method: str, dataset: SyntheticDataset, workers: int, state: Any, count: int
) -> tuple[float, list[torch.Tensor]]:
    """Restore a fresh loader, time its first batch, then take ``count - 1`` more to check."""
    loader = _BUILDERS[method](dataset, workers=workers)
    gc.collect()
    start = time.perf_counter()
    if method == GRAIN:
        iterator = iter(loader)  # Grain restores an iterator, as its checkpoint handler does
        iterator.set_state(state)
    else:
        loader.load_state_dict(state)
        iterator = iter(loader)
    batch = next(iterator)
    seconds = time.perf_counter() - start
    batches = _with_next(batch, iterator, count)
    del iterator  # its workers shut down outside the timed part
    return seconds, batches


def _floor_once(dataset: SyntheticDataset, workers: int) -> float:
    """First batch of a fresh, unshuffled plain DataLoader: timed like a restore, minus the state."""
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=workers)
    gc.collect()
    start = time.perf_counter()
    iterator = iter(loader)
    batch = next(iterator)
    seconds = time.perf_counter() - start
    del iterator
    if batch[:, 0].tolist() != list(range(min(BATCH_SIZE, len(dataset)))):
        raise RuntimeError("the unshuffled DataLoader's first batch is not samples 0..31")
    return seconds


def _check(got: list[list[int]], expected: list[list[int]]) -> str:
    """ "ok" when the resumed batches are the reference's batches k, k + 1, ... (same indices, same order)."""
    for offset, (mine, theirs) in enumerate(itertools.zip_longest(got, expected)):
        if mine != theirs:
            shown = "nothing" if mine is None else f"{mine[:3]}…"
            return f"MISMATCH at batch k + {offset}: got {shown}, expected {(theirs or [])[:3]}…"
    return "ok"


def _check_batches(batches: list[torch.Tensor], dataset: SyntheticDataset, expected: list[list[int]]) -> str:
    verdict = _check([batch[:, 0].tolist() for batch in batches], expected)
    if verdict == "ok" and not all(
        torch.equal(batch, torch.stack([dataset[i] for i in indices]))
        for batch, indices in zip(batches, expected, strict=True)
    ):
        return "MISMATCH: indices right, sample contents wrong"
    return verdict


def data_cell(
    method: str,
    n: int,
    k: int,
    work_iterations: int,
    workers: int,
    expected: list[list[int]],
    deadline_s: float,
    max_reps: int,
) -> dict[str, Any]:
    """One cell with a dataset: restore at batch k of N samples; latency, peak memory, exactness.

    ``expected`` is batches k, k + 1, ... of the uninterrupted run, as index lists.
    """
    torch.set_num_threads(1)  # as in a DataLoader worker; also keeps cells from fighting over cores
    dataset = SyntheticDataset(n, work_iterations)
    state = None if method in SKIP_METHODS else _checkpoint(method, dataset, k, workers)
    gc.collect()
    memory = PeakMemory()
    memory.start()
    if method in SKIP_METHODS:
        seconds, batches, note = _skip_cell(method, dataset, k, workers, deadline_s, len(expected))
        times = [seconds]
        extrapolated = batches is None
    else:
        restored: list[list[torch.Tensor]] = []
        floors: list[float] = []
        times = []

        def once() -> float:
            seconds, batches = _restore_once(method, dataset, workers, state, len(expected))
            restored.append(batches)
            times.append(seconds)
            if method == OURS:  # the floor, interleaved with the restores in this process
                floors.append(_floor_once(dataset, workers))
            return seconds

        seconds, _ = repeat_timed(once, max_reps=max_reps)
        batches, note, extrapolated = restored[-1], "", False
    peak = memory.peak_mb()
    exact = "not reached (deadline)" if batches is None else _check_batches(batches, dataset, expected)
    result = {
        "seconds": seconds,
        "min_seconds": min(times),
        "max_seconds": max(times),
        "reps": len(times),
        "peak_mb": peak,
        "exact": exact,
        "extrapolated": extrapolated,
        "note": note,
    }
    if state is not None:
        # As saved: Grain's JSON bytes as they are, a state dict pickled (as torch.save stores it).
        result["state_bytes"] = len(state) if isinstance(state, bytes) else len(pickle.dumps(state))
    if method == OURS:
        result["floor_seconds"] = statistics.median(floors)
    return result


def index_cell(
    method: str, n: int, k: int, expected: list[list[int]], deadline_s: float, max_reps: int
) -> dict[str, Any]:
    """One cell of index generation alone: the first batch of indices at batch k of N (timed), and the
    next ones, checked against ``expected``."""
    count = len(expected)
    torch.set_num_threads(1)
    source = range(n)  # a Sized of length N that stores nothing
    if method == INDEX_SKIP:
        memory = PeakMemory()
        memory.start()
        start = time.perf_counter()
        order = BatchSampler(RandomSampler(source, generator=seeded_generator(SEED)), BATCH_SIZE, False)
        skipping = iter(SkipBatches(order, k, start + deadline_s))
        try:
            got = next(skipping)
        except DeadlineExceeded as stop:
            estimate = (time.perf_counter() - start) * k / stop.done
            note = f"> {deadline_s:.0f} s deadline: extrapolated (linear from {stop.done} batches)"
            return {
                "seconds": estimate,
                "reps": 1,
                "peak_mb": memory.peak_mb(),
                "exact": "not reached (deadline)",
                "extrapolated": True,
                "note": note,
            }
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "reps": 1,
            "peak_mb": memory.peak_mb(),
            "exact": _check([got, *itertools.islice(skipping, count - 1)], expected),
            "extrapolated": False,
            "note": "",
        }

    def build() -> Any:
        if method == STATEFUL:
            return StatefulBatchSampler(
                StatefulRandomSampler(source, generator=seeded_generator(SEED)), BATCH_SIZE, False
            )
        if method == NODES:
            return tn.SamplerWrapper(
                BatchSampler(RandomSampler(source, generator=seeded_generator(SEED)), BATCH_SIZE, False)
            )
        return ResumableSampler(n, shuffle=True, seed=SEED)

    # The checkpoint: each method's state after one batch, moved to batch k.
    if method == STATEFUL:
        iterator = iter(build())
        next(iterator)
        state = iterator.state_dict()
        del iterator
        _set_keys(state, ("samples_yielded", "yielded"), k * BATCH_SIZE)
    elif method == NODES:
        node = build()
        node.reset()
        next(node)
        state = node.state_dict()
        _set_keys(state, ("_num_yielded",), k)
    else:
        state = build().state_dict()
        state["position"] = k * BATCH_SIZE
    gc.collect()
    memory = PeakMemory()
    memory.start()
    results: list[list[list[int]]] = []
    times: list[float] = []

    def once() -> float:
        fresh = build()
        start = time.perf_counter()
        if method == STATEFUL:
            iterator = iter(fresh)  # as StatefulDataLoader does: a new iterator, then its state
            iterator.load_state_dict(state)
        elif method == NODES:
            fresh.reset(state)
            iterator = fresh
        else:
            fresh.load_state_dict(state)
            iterator = iter(BatchSampler(fresh, BATCH_SIZE, False))
        first = next(iterator)
        seconds = time.perf_counter() - start
        results.append([first, *itertools.islice(iterator, count - 1)])
        times.append(seconds)
        return seconds

    seconds, reps = repeat_timed(once, max_reps=max_reps)
    return {
        "seconds": seconds,
        "min_seconds": min(times),
        "max_seconds": max(times),
        "reps": reps,
        "peak_mb": memory.peak_mb(),
        "exact": _check(results[-1], expected),
        "extrapolated": False,
        "note": "",
    }


def _data_methods(workers: int) -> tuple[str, ...]:
    """Warm start changes nothing without workers, so it has cells only with them."""
    return DATA_METHODS if workers else tuple(m for m in DATA_METHODS if m != WARM)


def _reference_method(method: str) -> str:
    """The method whose uninterrupted run is the reference (the skips share one loader, so do ours)."""
    if method in SKIP_METHODS:
        return NAIVE
    return OURS if method in OURS_METHODS else method


def _reference_order(method: str, n: int, workers: int) -> tuple[Iterator[list[int]], str]:
    """An uninterrupted epoch of ``method`` as a stream of index batches, and how it was obtained."""
    if n <= LOADER_REFERENCE_LIMIT:
        # The method's own loader, run from the start with the same num_workers, over range(N) so
        # that each batch *is* its indices.
        source = range(n)
        if method in SKIP_METHODS:
            loader: Any = _common.plain_loader(source, batch_size=BATCH_SIZE, seed=SEED, workers=workers)
        else:
            loader = _BUILDERS[method](source, workers=workers)
        return (batch.tolist() for batch in loader), "uninterrupted run of the same loader"
    if method == OURS:
        order: Iterator[int] = iter(ResumableSampler(n, shuffle=True, seed=SEED))
    elif method == STATEFUL:
        sampler = StatefulRandomSampler(range(n), generator=seeded_generator(SEED))
        if workers:
            # StatefulDataLoader's multi-process iterator creates the sampler iterator twice and
            # its RandomSampler draws a permutation at each creation: the epoch is the second one
            # (the uninterrupted loader runs at N <= LOADER_REFERENCE_LIMIT show it).
            iter(sampler)
        order = iter(sampler)
    else:
        order = iter(RandomSampler(range(n), generator=seeded_generator(SEED)))
    batches = iter(lambda: list(itertools.islice(order, BATCH_SIZE)), [])
    return batches, "uninterrupted iteration of the sampler"


def reference_batches(method: str, n: int, ks: list[int], workers: int) -> dict[str, Any]:
    """Batches k .. k + CHECKED_BATCHES - 1 (those in the epoch) for each k in ``ks``, of an
    uninterrupted epoch of ``method``, as index lists."""
    wanted = set(ks)
    if method == OURS and n > ITERATED_REFERENCE_LIMIT:
        permutation = Permutation(n, SEED, 0)
        starts = range(0, n, BATCH_SIZE)
        found = {
            k: [permutation(np.arange(i, min(n, i + BATCH_SIZE))).tolist() for i in starts[k : k + CHECKED_BATCHES]]
            for k in wanted
        }
        return {"batches": found, "how": "permutation evaluated at the positions"}
    if method == GRAIN and n > GRAIN_LOADER_REFERENCE_LIMIT:
        # Grain's sampler is random access, so its batches need no iteration (the layout over
        # workers is _grain.py's, checked against Grain's uninterrupted run at N <= GRAIN_LOADER_REFERENCE_LIMIT).
        found = _grain.batches_at(n, sorted(wanted), CHECKED_BATCHES, batch_size=BATCH_SIZE, seed=SEED, workers=workers)
        return {"batches": found, "how": "IndexSampler evaluated at the positions"}
    batches, how = _reference_order(method, n, workers)
    found = {k: [] for k in wanted}
    for j, batch in enumerate(itertools.islice(batches, max(wanted) + CHECKED_BATCHES)):
        for k in range(j - CHECKED_BATCHES + 1, j + 1):  # the ks whose checked batches include batch j
            if k in found:
                found[k].append(batch)
    return {"batches": found, "how": how}


# -- epoch start ----------------------------------------------------------------------------------

EPOCH_WORKERS = 2
EPOCH_COST_US = 50.0
# (label, warm_start, persistent_workers), in table order.
EPOCH_VARIANTS = (
    ("without warm start", False, False),
    ("warm start", True, False),
    ("without warm start, persistent workers", False, True),
    ("warm start, persistent workers", True, True),
)


def epoch_start_cell(warm: bool, persistent: bool, n: int, work_iterations: int) -> dict[str, Any]:
    """Two epochs of one loader: each epoch's first batch and total time, and a digest of its batches.

    Epoch 0 is a job's start; epoch 1 is what every later epoch of a running job costs to start
    (persistent workers are already running then, non-persistent ones start again).
    """
    torch.set_num_threads(1)
    loader = _common.resumable_loader(
        SyntheticDataset(n, work_iterations),
        batch_size=BATCH_SIZE,
        seed=SEED,
        workers=EPOCH_WORKERS,
        warm_start=warm,
        persistent_workers=persistent,
    )
    result: dict[str, Any] = {}
    for epoch in range(2):
        gc.collect()
        start = time.perf_counter()
        iterator = iter(loader)
        batches = [next(iterator)]
        first = time.perf_counter() - start
        # With warm start the workers start at the second request, in the main thread: that cost moves here.
        batches.append(next(iterator))
        second = time.perf_counter() - start
        batches += list(iterator)
        result[f"first_{epoch}"], result[f"second_{epoch}"], result[f"total_{epoch}"] = (
            first,
            second,
            time.perf_counter() - start,
        )
        contents = torch.cat(batches)
        # The batches' order and contents: equal digests in every variant mean the same epoch.
        result[f"digest_{epoch}"] = int((contents[:, 0] * torch.arange(1, len(contents) + 1)).sum()) ^ int(
            contents.sum()
        )
        del iterator
    return result


def run_epoch_starts(plan: Plan, work_iterations: int) -> dict[str, list[dict[str, Any]]]:
    """Every variant once per round, in an order rotated each round."""
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in EPOCH_VARIANTS}
    for round_ in range(plan.epoch_rounds):
        shift = round_ % len(EPOCH_VARIANTS)
        for label, warm, persistent in EPOCH_VARIANTS[shift:] + EPOCH_VARIANTS[:shift]:
            kwargs = {"warm": warm, "persistent": persistent, "n": plan.epoch_n, "work_iterations": work_iterations}
            result = run_isolated(epoch_start_cell, kwargs, timeout_s=300)
            runs[label].append(result)
            shown = (
                f"epoch 1 first batch {format_seconds(result['first_1'])}, total {format_seconds(result['total_1'])}"
                if "first_1" in result
                else result["error"]
            )
            print(f"epoch start, round {round_ + 1}: {label}: {shown}", flush=True)
    return runs


def _median_range(values: list[float]) -> str:
    if not values:
        return ""
    return f"{format_seconds(statistics.median(values))} ({format_seconds(min(values))}–{format_seconds(max(values))})"


def epoch_start_report(runs: dict[str, list[dict[str, Any]]], plan: Plan) -> list[str]:
    reference = [r for r in runs[EPOCH_VARIANTS[0][0]] if "digest_0" in r]
    rows = []
    for label, _, _ in EPOCH_VARIANTS:
        good = [r for r in runs[label] if "first_1" in r]
        errors = [r["error"] for r in runs[label] if "error" in r]
        same = (
            all((r["digest_0"], r["digest_1"]) == (reference[0]["digest_0"], reference[0]["digest_1"]) for r in good)
            if reference
            else False
        )
        verdict = (
            "ok"
            if same and good and not errors
            else ("; ".join(errors) or "MISMATCH: batches differ from the run without warm start")
        )
        rows.append(
            [
                label,
                _median_range([r["first_0"] for r in good]),
                _median_range([r["first_1"] for r in good]),
                _median_range([r["second_1"] for r in good]),
                _median_range([r["total_1"] for r in good]),
                verdict,
            ]
        )
    return [
        f"## Epoch start: a fresh epoch, {EPOCH_WORKERS} workers, N = {plan.epoch_n:,}, {EPOCH_COST_US:.0f} µs/sample",
        "",
        f"One loader per cell runs two epochs; epoch 1 is what every later epoch of a running job costs to start. Median "
        f'(min–max) over {plan.epoch_rounds} round(s), the variants in an order rotated every round. "same batches": '
        "every epoch of every variant has the order and contents of the run without warm start.",
        "",
        markdown_table(
            [
                "variant",
                "epoch 0: first batch",
                "epoch 1: first batch",
                "epoch 1: first two batches",
                "epoch 1: total",
                "same batches",
            ],
            rows,
        ),
        "",
    ]


# -- the run ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    sweep: str  # "index" or "data"
    method: str
    n: int
    percent: int
    cost_us: float
    workers: int

    @property
    def k(self) -> int:
        """Batches consumed at the checkpoint."""
        batches = -(-self.n // BATCH_SIZE)
        return min(batches - 1, self.percent * batches // 100)


def plan_cells(plan: Plan, skipped: tuple[str, ...] = ()) -> list[Cell]:
    """Every cell of ``plan``, the methods interleaved within each position; none for ``skipped``."""
    cells = [Cell("index", m, n, p, 0.0, 0) for n in plan.index_sizes for p in plan.positions for m in INDEX_METHODS]
    largest = max(plan.data_sizes)
    for cost, workers in plan.configs:
        methods = [m for m in _data_methods(workers) if m not in skipped]
        for n in plan.data_sizes:
            positions = plan.positions if n == largest else (plan.vs_size_position,)
            cells += [Cell("data", m, n, p, cost, workers) for p in positions for m in methods]
    return cells


def not_run_reason(cell: Cell) -> str | None:
    need = cell.n * BASELINE_BYTES_PER_INDEX
    if cell.method != OURS and need > MEMORY_CAP_BYTES:
        return (
            f"not run: would materialize {format_count(cell.n)} indices "
            f"(≥ {need / 2**30:.1f} GB as randperm + list, over the {MEMORY_CAP_BYTES / 2**30:.0f} GB cap)"
        )
    return None


def _refuse_if_wrong(result: dict[str, Any]) -> None:
    """A method that resumed wrong gets no figure: its times are dropped, its verdict stays."""
    if result.get("exact", "").startswith("MISMATCH"):
        for key in ("seconds", "min_seconds", "max_seconds", "floor_seconds"):
            result.pop(key, None)
        result["refused"] = True


def run(
    plan: Plan, deadline_s: float, work_iterations: dict[float, int], skipped: tuple[str, ...] = ()
) -> dict[Cell, dict[str, Any]]:
    cells = plan_cells(plan, skipped)
    references: dict[tuple[str, int], dict[str, Any]] = {}
    results: dict[Cell, dict[str, Any]] = {}
    timeout = max(CELL_TIMEOUT_FLOOR_S, 4 * deadline_s)
    for i, cell in enumerate(cells):
        reason = not_run_reason(cell)
        if reason is not None:
            results[cell] = {"not_run": reason}
            continue
        key = (_reference_method(cell.method), cell.n, cell.workers)
        if key not in references:
            ks = [c.k for c in cells if (_reference_method(c.method), c.n, c.workers) == key]
            kwargs = {"method": key[0], "n": cell.n, "ks": ks, "workers": cell.workers}
            references[key] = run_isolated(reference_batches, kwargs, timeout_s=timeout)
        reference = references[key]
        if "error" in reference:
            results[cell] = {"error": f"reference failed: {reference['error']}"}
            continue
        expected = reference["batches"][cell.k]
        kwargs = {
            "method": cell.method,
            "n": cell.n,
            "k": cell.k,
            "expected": expected,
            "deadline_s": deadline_s,
            "max_reps": plan.max_reps,
        }
        if cell.sweep == "data":
            kwargs.update(work_iterations=work_iterations[cell.cost_us], workers=cell.workers)
        function = index_cell if cell.sweep == "index" else data_cell
        result = run_isolated(function, kwargs, timeout_s=timeout)
        _refuse_if_wrong(result)
        result["reference"] = reference["how"]
        results[cell] = result
        floor = (
            f" (floor {format_seconds(result['floor_seconds'])}: {_floor_verdict(result)})"
            if "floor_seconds" in result
            else ""
        )
        print(
            f"[{i + 1}/{len(cells)}] {cell.sweep} {cell.method} N={format_count(cell.n)} {cell.percent}% "
            f"{cell.cost_us:.0f}µs w{cell.workers}: {_latency(result)} {result.get('exact', '')}{floor}",
            flush=True,
        )
    return results


def _latency(result: Mapping[str, Any]) -> str:
    if "not_run" in result:
        return "not run"
    if "refused" in result:
        return REFUSED
    if "error" in result:
        return f"error: {result['error']}"
    text = format_seconds(result["seconds"])
    return f"≈ {text} (extrapolated)" if result["extrapolated"] else text


def _exact(result: Mapping[str, Any]) -> str:
    if "not_run" in result:
        return "not run"
    return result.get("exact", "error")


# -- report -----------------------------------------------------------------------------------------


def _wide_table(
    results: Mapping[Cell, dict[str, Any]],
    cells: list[Cell],
    column: Callable[[Cell], str],
    methods: tuple[str, ...],
    *,
    floor: bool = False,
) -> str:
    """One row per method, one column per ``column(cell)``; with ``floor``, the floor and our ratio to it."""
    columns = list(dict.fromkeys(column(c) for c in cells))
    rows = []
    for method in (m for m in methods if any(c.method == m for c in cells)):  # a skipped method has no row
        by_column = {column(c): results[c] for c in cells if c.method == method}
        rows.append([method, *(_latency(by_column[col]) if col in by_column else "" for col in columns)])
    if floor:
        ours = {column(c): results[c] for c in cells if c.method == OURS}
        floors = {col: r["floor_seconds"] for col, r in ours.items() if "floor_seconds" in r}
        rows.append([FLOOR, *(format_seconds(floors[col]) if col in floors else "" for col in columns)])
        rows.append(
            [
                f"resumable_data / floor (target ≤ {FLOOR_TARGET:.0f}×)",
                *(_floor_verdict(ours.get(col, {})) for col in columns),
            ]
        )
    return markdown_table(["method", *columns], rows)


def _floor_ratio(result: Mapping[str, Any]) -> float | None:
    if "seconds" not in result or "floor_seconds" not in result:
        return None
    return result["seconds"] / result["floor_seconds"]


def _floor_verdict(result: Mapping[str, Any]) -> str:
    ratio = _floor_ratio(result)
    if ratio is None:
        return ""
    return f"{ratio:.2f}× ({'met' if ratio <= FLOOR_TARGET else 'missed'})"


def _ratio(results: Mapping[Cell, dict[str, Any]], a: Cell, b: Cell) -> float | None:
    ra, rb = results.get(a, {}), results.get(b, {})
    if "seconds" not in ra or "seconds" not in rb:
        return None
    return ra["seconds"] / rb["seconds"]


def _targets(results: Mapping[Cell, dict[str, Any]], plan: Plan) -> list[str]:
    lines = []
    n_data = max(plan.data_sizes)
    position_ratio = _ratio(results, Cell("data", OURS, n_data, 90, 0.0, 0), Cell("data", OURS, n_data, 0, 0.0, 0))
    if position_ratio is not None:
        lines.append(
            f"- resumable_data 90 % / 0 % at N = {format_count(n_data)} (dataset, ≈0 µs, 0 workers): "
            f"{position_ratio:.2f} (target ≤ 1.5: {'met' if position_ratio <= 1.5 else 'missed'})"
        )
    for n in plan.index_focus:
        ratio = _ratio(results, Cell("index", OURS, n, 90, 0.0, 0), Cell("index", OURS, n, 0, 0.0, 0))
        if ratio is not None:
            lines.append(
                f"- resumable_data 90 % / 0 % at N = {format_count(n)} (index generation): "
                f"{ratio:.2f} (target ≤ 1.5: {'met' if ratio <= 1.5 else 'missed'})"
            )
    ours_cells = [(c, r) for c, r in results.items() if c.method == OURS and _floor_ratio(r) is not None]
    if ours_cells:
        met = [c for c, r in ours_cells if _floor_ratio(r) <= FLOOR_TARGET]
        worst_cell, worst = max(ours_cells, key=lambda cr: _floor_ratio(cr[1]))
        lines.append(
            f"- resumable_data restore / floor (a fresh unshuffled DataLoader's first batch, same process) ≤ {FLOOR_TARGET:.0f}× "
            f"at every N and position: met in {len(met)} of {len(ours_cells)} cells; worst {_floor_ratio(worst):.2f}× "
            f"(N = {format_count(worst_cell.n)}, {worst_cell.percent} %, {worst_cell.cost_us:.0f} µs/sample, {worst_cell.workers} workers: "
            f"{format_seconds(worst['seconds'])} vs {format_seconds(worst['floor_seconds'])})"
        )
        for cost, workers in plan.configs:
            config = [r for c, r in ours_cells if (c.cost_us, c.workers) == (cost, workers)]
            ratios = sorted(_floor_ratio(r) for r in config)
            if ratios:
                verdict = "met" if ratios[-1] <= FLOOR_TARGET else "missed"
                lines.append(
                    f"  - {cost:.0f} µs/sample, {workers} workers: {ratios[0]:.2f}–{ratios[-1]:.2f}× over {len(ratios)} cells ({verdict})"
                )
    for cost, workers in plan.configs:
        warm, cold = (
            results.get(Cell("data", WARM, n_data, 90, cost, workers), {}),
            results.get(Cell("data", OURS, n_data, 90, cost, workers), {}),
        )
        if "seconds" in warm and "seconds" in cold:
            lines.append(
                f"- warm start, N = {format_count(n_data)}, 90 %, {cost:.0f} µs/sample, {workers} workers: first resumed batch in "
                f"{format_seconds(warm['seconds'])} (target ≤ 5 ms: {'met' if warm['seconds'] <= 5e-3 else 'missed'}); "
                f"without warm start {format_seconds(cold['seconds'])} in the same run"
            )
    for cost, workers in plan.configs:
        ours = Cell("data", OURS, n_data, 90, cost, workers)
        for baseline in (STATEFUL, NODES, NAIVE):
            speedup = _ratio(results, Cell("data", baseline, n_data, 90, cost, workers), ours)
            if speedup is None:
                continue
            target = (
                "target ≥ 100×: " + ("met" if speedup >= 100 else "missed")
                if baseline != NAIVE and workers == 0
                else "no target"
            )
            extrapolated = results[Cell("data", baseline, n_data, 90, cost, workers)].get("extrapolated")
            times = f"{speedup:,.0f}×" if speedup >= 10 else f"{speedup:.2f}×"
            lines.append(
                f"- N = {format_count(n_data)}, 90 %, {cost:.0f} µs/sample, {workers} workers: {baseline} / resumable_data = "
                f"{times}{' (extrapolated)' if extrapolated else ''} ({target})"
            )
    return lines


GRAIN_POSITIONS = (0, 50, 90)
# The methods that restore from a state, side by side with Grain (the skips have no state to size).
STATE_METHODS = (STATEFUL, NODES, OURS, WARM, GRAIN)


def _spread(result: Mapping[str, Any]) -> str:
    """The median with its min–max over the repetitions, or why there is no figure."""
    if "seconds" not in result or "min_seconds" not in result:
        return _latency(result)
    if result["reps"] == 1:
        return f"{format_seconds(result['seconds'])} (1 run)"
    low, high = format_seconds(result["min_seconds"]), format_seconds(result["max_seconds"])
    return f"{format_seconds(result['seconds'])} ({low}–{high}, {result['reps']} runs)"


def grain_report(results: Mapping[Cell, dict[str, Any]], plan: Plan, grain_missing: str | None) -> list[str]:
    """Grain next to the methods that restore from a state: latency at 0/50/90 % and the state's size."""
    largest = max(plan.data_sizes)
    title = f"## Grain side by side: restore vs position and state size, N = {format_count(largest)}"
    if grain_missing is not None:
        return [title, "", f"Grain skipped: {grain_missing}.", ""]
    positions = [p for p in plan.positions if p in GRAIN_POSITIONS] or list(plan.positions)
    rows = []
    for cost, workers in plan.configs:
        for method in (m for m in STATE_METHODS if m in _data_methods(workers)):
            by_position = {
                c.percent: r
                for c, r in results.items()
                if (c.sweep, c.method, c.n, c.cost_us, c.workers) == ("data", method, largest, cost, workers)
            }
            last = by_position.get(positions[-1], {})
            size = f"{last['state_bytes']:,} B" if "state_bytes" in last else ""
            rows.append(
                [method, f"{cost:.0f} µs", workers, *(_spread(by_position.get(p, {})) for p in positions), size]
            )
    return [
        title,
        "",
        f"Grain {_grain.version()}: `grain.python.DataLoader` over the same dataset, a shuffled `IndexSampler` "
        f"(seed {SEED}), `Batch({BATCH_SIZE})`, `worker_count` as in the row; restored by `set_state` on a fresh "
        "iterator. The same cells as in the tables above (each method's cells interleaved with the others' at every "
        "position). Median (min–max) over the repetitions; the state size is the checkpoint as saved (Grain: the JSON "
        "bytes of `get_state()`; the others: their state dict, pickled), at the last position shown.",
        "",
        markdown_table(["method", "work", "workers", *(f"{p} %" for p in positions), "state size"], rows),
        "",
    ]


def report(
    results: Mapping[Cell, dict[str, Any]],
    plan: Plan,
    deadline_s: float,
    work_iterations: dict[float, int],
    epoch_runs: dict[str, list[dict[str, Any]]],
    grain_missing: str | None = None,
) -> str:
    cells = list(results)
    largest = max(plan.data_sizes)
    parts = [
        _common.machine_header("Resume latency: checkpoint in hand → first resumed batch in hand"),
        f"Batch size {BATCH_SIZE}, shuffled, seed {SEED}. Per-sample work: "
        + ", ".join(f"{us:.0f} µs ≈ {it} LCG iterations" for us, it in work_iterations.items())
        + f". Skip baselines stop at a {deadline_s:.0f} s deadline; their latency is then a linear extrapolation, "
        "marked as such. Peak RSS is the growth of the main process's high-water mark during the timed part "
        "(workers' memory not included). Times are medians of up to "
        f"{plan.max_reps} repetitions for cells under 1 s, one run otherwise. The floor is the first batch of a fresh, "
        "unshuffled plain DataLoader over the same dataset with the same workers, timed in each resumable_data cell's "
        "process between its restores (median of as many runs). Every restore is checked on its first "
        f"{CHECKED_BATCHES} batches against the uninterrupted run; a method that resumes wrong gets no figure "
        f'("{REFUSED}").',
        "",
        "## Targets",
        "",
        *_targets(results, plan),
        "",
    ]
    for cost, workers in plan.configs:
        chosen = [
            c for c in cells if c.sweep == "data" and c.n == largest and (c.cost_us, c.workers) == (cost, workers)
        ]
        parts += [
            f"## With a dataset: latency vs position, N = {format_count(largest)}, {cost:.0f} µs/sample, {workers} workers",
            "",
            _wide_table(results, chosen, lambda c: f"{c.percent} %", _data_methods(workers), floor=True),
            "",
        ]
    for cost, workers in plan.configs:
        chosen = [
            c
            for c in cells
            if c.sweep == "data" and c.percent == plan.vs_size_position and (c.cost_us, c.workers) == (cost, workers)
        ]
        parts += [
            f"## With a dataset: latency vs N at {plan.vs_size_position} %, {cost:.0f} µs/sample, {workers} workers",
            "",
            _wide_table(results, chosen, lambda c: f"N = {format_count(c.n)}", _data_methods(workers), floor=True),
            "",
        ]
    parts += grain_report(results, plan, grain_missing)
    parts += epoch_start_report(epoch_runs, plan)
    index_cells = [c for c in cells if c.sweep == "index"]
    parts += [
        f"## Index generation alone: latency vs N at {plan.vs_size_position} %",
        "",
        _wide_table(
            results,
            [c for c in index_cells if c.percent == plan.vs_size_position],
            lambda c: f"N = {format_count(c.n)}",
            INDEX_METHODS,
        ),
        "",
    ]
    for n in plan.index_focus:
        parts += [
            f"## Index generation alone: latency vs position, N = {format_count(n)}",
            "",
            _wide_table(results, [c for c in index_cells if c.n == n], lambda c: f"{c.percent} %", INDEX_METHODS),
            "",
        ]
    rows = []
    for cell, result in results.items():
        peak = f"{result['peak_mb']:.0f} MB" if "peak_mb" in result else ""
        note = result.get("not_run") or result.get("note", "")
        floor = format_seconds(result["floor_seconds"]) if "floor_seconds" in result else ""
        spread = (
            f"{format_seconds(result['min_seconds'])}–{format_seconds(result['max_seconds'])}"
            if "min_seconds" in result and result["reps"] > 1
            else ""
        )
        state = f"{result['state_bytes']:,} B" if "state_bytes" in result else ""
        rows.append(
            [
                cell.method,
                cell.sweep,
                format_count(cell.n),
                f"{cell.percent} %",
                f"{cell.cost_us:.0f} µs",
                cell.workers,
                _latency(result),
                spread,
                floor,
                _floor_verdict(result),
                peak,
                state,
                _exact(result),
                result.get("reps", ""),
                result.get("reference", ""),
                note,
            ]
        )
    parts += [
        "## Every cell",
        "",
        markdown_table(
            [
                "method",
                "sweep",
                "N",
                "position",
                "work",
                "workers",
                "latency",
                "min–max",
                "floor",
                "÷ floor",
                "peak RSS",
                "state size",
                "exact",
                "reps",
                "reference",
                "note",
            ],
            rows,
        ),
    ]
    return "\n".join(parts)


def _points(
    results: Mapping[Cell, dict[str, Any]], cells: list[Cell], x: Callable[[Cell], float], methods: tuple[str, ...]
) -> dict[str, list[tuple[float, float, bool]]]:
    series: dict[str, list[tuple[float, float, bool]]] = {m: [] for m in methods}
    for cell in cells:
        result = results[cell]
        if "seconds" in result:
            series[cell.method].append((x(cell), result["seconds"], result["extrapolated"]))
        if "floor_seconds" in result:
            series.setdefault(FLOOR, []).append((x(cell), result["floor_seconds"], False))
    return series


def plot(results: Mapping[Cell, dict[str, Any]], plan: Plan, out: Any) -> None:
    cells = list(results)
    largest = max(plan.data_sizes)
    by_position = []
    for n in plan.index_focus:
        chosen = [c for c in cells if c.sweep == "index" and c.n == n]
        by_position.append(
            (
                f"index generation alone, N = {format_count(n)}",
                _points(results, chosen, lambda c: c.percent, INDEX_METHODS),
            )
        )
    for cost, workers in plan.configs:
        chosen = [
            c for c in cells if c.sweep == "data" and c.n == largest and (c.cost_us, c.workers) == (cost, workers)
        ]
        by_position.append(
            (
                f"dataset N = {format_count(largest)}, {cost:.0f} µs/sample, {workers} workers",
                _points(results, chosen, lambda c: c.percent, DATA_METHODS),
            )
        )
    _common.plot_lines(
        out / "resume_vs_position.png",
        by_position,
        xlabel="position in the epoch (%)",
        ylabel="checkpoint → first batch (s)",
        xscale="linear",
        xlim=(0, 100),
    )
    at = plan.vs_size_position
    index_title = f"index generation alone, {at} %"
    index_cells = [c for c in cells if c.sweep == "index" and c.percent == at]
    by_size = [(index_title, _points(results, index_cells, lambda c: c.n, INDEX_METHODS))]
    not_run = {index_title: [(c.n, c.method) for c in index_cells if "not_run" in results[c]]}
    for cost, workers in plan.configs:
        chosen = [
            c for c in cells if c.sweep == "data" and c.percent == at and (c.cost_us, c.workers) == (cost, workers)
        ]
        by_size.append(
            (
                f"dataset, {at} %, {cost:.0f} µs/sample, {workers} workers",
                _points(results, chosen, lambda c: c.n, DATA_METHODS),
            )
        )
    _common.plot_lines(
        out / "resume_vs_n.png",
        by_size,
        xlabel="dataset size N",
        ylabel="checkpoint → first batch (s)",
        not_run=not_run,
        not_run_label=f"not run (would materialize > {MEMORY_CAP_BYTES / 2**30:.0f} GB)",
    )


def results_from_report(path: Path) -> dict[Cell, dict[str, Any]]:
    """The cells of a written report ("Every cell" table), to redraw its plots without running it again."""
    results: dict[Cell, dict[str, Any]] = {}
    for row in _common.parse_markdown_rows(path.read_text(), "method"):
        if "sweep" not in row:
            continue
        n = 10 ** int(row["N"].split("^")[1]) if "^" in row["N"] else int(row["N"].replace(",", ""))
        cell = Cell(
            row["sweep"],
            row["method"],
            n,
            int(row["position"].split()[0]),
            float(row["work"].split()[0]),
            int(row["workers"]),
        )
        latency = row["latency"]
        if latency == "not run":
            results[cell] = {"not_run": row["note"]}
            continue
        if latency.startswith("error"):
            results[cell] = {"error": latency}
            continue
        if latency == REFUSED:
            results[cell] = {"refused": True}
            continue
        extrapolated = latency.startswith("≈")
        result: dict[str, Any] = {
            "seconds": _common.parse_seconds(latency.strip("≈ ").replace(" (extrapolated)", "")),
            "extrapolated": extrapolated,
        }
        if row["floor"]:
            result["floor_seconds"] = _common.parse_seconds(row["floor"])
        results[cell] = result
    return results


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="REPORT.md",
        help="redraw the plots from a written report's 'Every cell' table (no measurement)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds after which a skip baseline stops and its latency is extrapolated (default 15; 5 with --quick)",
    )


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0], _add_arguments)
    plan = QUICK if args.quick else FULL
    if args.replot is not None:
        plot(results_from_report(args.replot), plan, args.out)
        return
    if args.deadline is None:
        args.deadline = 5.0 if args.quick else 15.0
    grain_missing = _grain.unavailable()
    if grain_missing is not None:
        print(f"Grain skipped: {grain_missing}", flush=True)
    work_iterations = {cost: _common.calibrate_work(cost) for cost in dict.fromkeys(c for c, _ in plan.configs)}
    started = time.perf_counter()
    results = run(plan, args.deadline, work_iterations, skipped=(GRAIN,) if grain_missing else ())
    epoch_runs = run_epoch_starts(plan, _common.calibrate_work(EPOCH_COST_US))
    text = report(results, plan, args.deadline, work_iterations, epoch_runs, grain_missing)
    text += f"\n\nTotal run time: {time.perf_counter() - started:.0f} s."
    print(text)
    _common.write_report(args.out, "bench_resume", text)
    plot(results, plan, args.out)


if __name__ == "__main__":
    main()
