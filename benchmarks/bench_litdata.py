"""litdata's chunks read by LitdataReader against litdata's own StreamingDataset: epoch throughput and restore.

Data, written by ``litdata.optimize`` (in a process of its own, see ``_peers``) to a temp dir:

- items: 20,000 dicts ``{"id": i, "tokens": int32[128]}`` (``--quick``: 4,000), 1,000 per chunk;
- tokens: 6,000 documents of 500-1,500 int32 tokens in ``TokensLoader`` chunks of 1 MB, read as
  blocks of 256 tokens (``--quick``: 400 documents).

Readers, batches of 32, with 0 and 2 workers:

- ours: ``StreamLoader(litdata_stream(folder, seed=0).shuffle_window(1000, seed=1))``: chunk order
  shuffled per epoch, records shuffled within a window of 1,000;
- litdata: ``StreamingDataLoader(StreamingDataset(folder, shuffle=True, seed=0))`` (chunk order and
  items within chunks shuffled), with ``TokensLoader(block_size=256)`` for tokens.

1. Epoch: the seconds of one whole epoch from a freshly built loader, checked to yield every record
   once; records/s, median of the rounds (min-max), the readers interleaved round by round.
2. Restore at 90 %: a loader's state after 90 % of the epoch's batches, loaded into a freshly built
   loader (ours: ``load_state_dict``; litdata: ``StreamingDataLoader.load_state_dict``) and timed to
   the first batch in hand, checked equal to the uninterrupted run's next batch; median (min-max).
   With workers, ours makes that batch in the loader's process while they start (StreamLoader's
   warm start, its default).

Every measurement runs in a fresh process (``_common.run_isolated``). Needs litdata:
``PYTHONPATH=. /work/peers-venv/bin/python benchmarks/bench_litdata.py`` (``--quick``: a smoke test).
"""

from __future__ import annotations

import gc
import itertools
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import format_seconds, machine_header, markdown_table, parse_args, run_isolated, write_report

from resumable_data.streams import StreamLoader
from resumable_data.streams.formats import litdata_stream

BATCH = 32
BLOCK = 256
WINDOW = 1000
FRACTION = 0.9
READERS = ("ours", "litdata")

_WRITER = """
import sys
import numpy as np
import torch
import litdata
from litdata.streaming.item_loader import TokensLoader

def item(i):
    return {"id": i, "tokens": np.arange(i, i + 128, dtype=np.int32)}

def document(i):
    return torch.arange(i * 2000, i * 2000 + 500 + (i * 7919) % 1000, dtype=torch.int32)

if __name__ == "__main__":
    kind, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if kind == "items":
        litdata.optimize(fn=item, inputs=list(range(n)), output_dir=out, num_workers=1, chunk_size=1000)
    else:
        litdata.optimize(
            fn=document, inputs=list(range(n)), output_dir=out, num_workers=1, chunk_bytes="1MB",
            item_loader=TokensLoader(),
        )
"""


def write(directory: Path, kind: str, n: int) -> str:
    """The dataset ``kind`` of ``n`` items or documents, written by ``litdata.optimize`` in another process
    (after optimize has run in a process, its forked DataLoader workers start far slower)."""
    script, out = directory / "write.py", directory / kind
    script.write_text(_WRITER)
    subprocess.run([sys.executable, str(script), kind, str(n), str(out)], check=True, capture_output=True, timeout=1800)
    return str(out)


def build(reader: str, kind: str, folder: str, workers: int) -> Any:
    block = {"block_size": BLOCK} if kind == "tokens" else {}
    if reader == "ours":
        stream = litdata_stream(folder, seed=0, **block).shuffle_window(WINDOW, seed=1)
        return StreamLoader(stream, batch_size=BATCH, num_workers=workers)
    import litdata
    from litdata.streaming.item_loader import TokensLoader

    loader = {"item_loader": TokensLoader(block_size=BLOCK)} if kind == "tokens" else {}
    dataset = litdata.StreamingDataset(folder, shuffle=True, seed=0, **loader)
    return litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers)


def ids(batch: Any) -> list[int]:
    """A batch's record ids: an item's id, a token block's first token (tokens are unique)."""
    return (batch["id"] if isinstance(batch, dict) else torch.as_tensor(batch)[:, 0]).tolist()


def epoch_cell(reader: str, kind: str, folder: str, workers: int, expected: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    loader = build(reader, kind, folder, workers)
    gc.collect()
    start = time.perf_counter()
    seen = [i for batch in loader for i in ids(batch)]
    elapsed = time.perf_counter() - start
    if len(seen) != expected or len(set(seen)) != expected:
        return {"error": f"{reader}: an epoch yielded {len(seen)} records ({len(set(seen))} distinct), not {expected}"}
    return {"seconds": elapsed, "batches": -(-len(seen) // BATCH)}


def checkpoint_cell(reader: str, kind: str, folder: str, workers: int, position: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    loader = build(reader, kind, folder, workers)
    batches = iter(loader)
    for _ in itertools.islice(batches, position):
        pass
    state = pickle.dumps(loader.state_dict())
    return {"state": state, "next": ids(next(batches))}


def restore_cell(
    reader: str, kind: str, folder: str, workers: int, state: bytes, expected: list[int]
) -> dict[str, Any]:
    torch.set_num_threads(1)
    for _ in torch.utils.data.DataLoader([torch.zeros(2)] * 2, batch_size=2):  # torch's first-use costs, paid
        pass
    loader = build(reader, kind, folder, workers)
    gc.collect()
    start = time.perf_counter()
    loader.load_state_dict(pickle.loads(state))
    got = ids(next(iter(loader)))
    elapsed = time.perf_counter() - start
    if got != expected:
        return {"error": f"{reader}: the restored first batch differs from the uninterrupted run's"}
    return {"seconds": elapsed}


def cell(fn: Any, **kwargs: Any) -> dict[str, Any]:
    result = run_isolated(fn, kwargs, timeout_s=1200)
    if "error" in result:
        raise SystemExit(f"{fn.__name__} {kwargs['reader']} {kwargs['kind']} {kwargs['workers']}: {result['error']}")
    return result


def spread(values: list[float], fmt: Any) -> str:
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}–{fmt(max(values))})"


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    sizes = {"items": 4000, "tokens": 400} if args.quick else {"items": 20_000, "tokens": 6000}
    rounds = 1 if args.quick else 7
    epoch_rows, restore_rows = [], []
    with tempfile.TemporaryDirectory(prefix="bench-litdata-") as tmp:
        for kind, n in sizes.items():
            (Path(tmp) / kind).mkdir()
            folder = write(Path(tmp) / kind, kind, n)
            # The record count: what litdata's own reader yields in an unshuffled pass of ours.
            records = sum(
                1 for _ in litdata_stream(folder, shuffle=False, **({"block_size": BLOCK} if kind == "tokens" else {}))
            )
            for workers in (0, 2):
                seconds: dict[str, list[float]] = {r: [] for r in READERS}
                batches = 0
                for r in range(rounds):  # interleaved, first one then the other first: load changes hit both alike
                    for reader in READERS if r % 2 == 0 else READERS[::-1]:
                        result = cell(
                            epoch_cell, reader=reader, kind=kind, folder=folder, workers=workers, expected=records
                        )
                        seconds[reader].append(result["seconds"])
                        batches = result["batches"]
                rates = {r: [records / s for s in seconds[r]] for r in READERS}
                ratio = statistics.median(rates["ours"]) / statistics.median(rates["litdata"])
                epoch_rows.append(
                    [kind, f"{records:,}", workers]
                    + [spread(rates[r], lambda v: f"{v:,.0f}") for r in READERS]
                    + [f"{ratio:.2f}x"]
                )
                position = int(FRACTION * batches)
                taken = {
                    r: cell(checkpoint_cell, reader=r, kind=kind, folder=folder, workers=workers, position=position)
                    for r in READERS
                }
                restores: dict[str, list[float]] = {r: [] for r in READERS}
                for round_ in range(rounds):
                    for r in READERS if round_ % 2 == 0 else READERS[::-1]:
                        kwargs = {"state": taken[r]["state"], "expected": taken[r]["next"]}
                        result = cell(restore_cell, reader=r, kind=kind, folder=folder, workers=workers, **kwargs)
                        restores[r].append(result["seconds"])
                restore_rows.append(
                    [kind, f"{position:,} of {batches:,}", workers]
                    + [spread(restores[r], format_seconds) for r in READERS]
                    + [f"{len(taken[r]['state']):,} B" for r in READERS]
                )
    text = "\n".join(
        [
            machine_header("litdata chunks: LitdataReader against litdata's own StreamingDataset"),
            f"Data written by `litdata.optimize`: items `{{'id', 'tokens': int32[128]}}` (1,000 per chunk) and "
            f"`TokensLoader` chunks read as blocks of {BLOCK} tokens. Batches of {BATCH}; ours shuffles chunks and a "
            f"window of {WINDOW:,} records, litdata chunks and items within chunks. Median (min–max) of {rounds} "
            "rounds, the two readers interleaved (each first in every other round), each measurement in a fresh process.",
            "",
            "## Epoch throughput (records/s)",
            "",
            markdown_table(["data", "records", "workers", "ours", "litdata", "ours / litdata"], epoch_rows),
            "",
            f"## Restore at {FRACTION:.0%} of the epoch (load_state_dict to the first batch, checked exact)",
            "",
            markdown_table(
                ["data", "position (batches)", "workers", "ours", "litdata", "state, ours (pickled)", "state, litdata"],
                restore_rows,
            ),
        ]
    )
    print()
    print(text)
    write_report(args.out, "litdata", text)


if __name__ == "__main__":
    main()
