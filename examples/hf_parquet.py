"""Hugging Face ``datasets`` two ways, both resumed exactly after a stop mid-epoch:

1. a ``datasets.Dataset`` (Arrow, map-style) used directly in ``ResumableDataLoader``;
2. the same data as a Hub-style folder of Parquet shards (``data/train-0000k-of-0000n.parquet``,
   what ``Dataset.push_to_hub`` writes and most Hub datasets hold), streamed with ``ParquetReader``
   through a shuffle buffer by 2 worker processes. A restore opens each shard at its row: it reads
   one row group, never the rows before it.

(A ``datasets.IterableDataset`` cannot seek; see the README's "Use it with" section for it.)

    python examples/hf_parquet.py            # CPU only, under a minute
    python examples/hf_parquet.py --smoke    # what the test suite runs
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path
from typing import Any

import datasets
import torch

from resumable_data import ResumableDataLoader, ShardedIterable, StreamLoader
from resumable_data.streams import ParquetReader

BLOCK = 16


def corpus(rows: int) -> datasets.Dataset:
    """A small text corpus, tokenized to fixed-length byte ids with ``Dataset.map``."""
    text = datasets.Dataset.from_dict({"text": [f"document {i}: " + "lorem ipsum " * (i % 5 + 1) for i in range(rows)]})

    def tokenize(example: dict[str, Any]) -> dict[str, Any]:
        ids = list(example["text"].encode())[:BLOCK]
        return {"input_ids": ids + [0] * (BLOCK - len(ids))}

    return text.map(tokenize)


def run(
    make_loader, num_epochs: int, stop_after: int | None = None, state: dict | None = None
) -> tuple[list[Any], dict]:
    """An epoch loop over a fresh loader (restored from ``state``), stopped after ``stop_after`` batches."""
    loader = make_loader()
    if state is not None:
        loader.load_state_dict(state)
    seen: list[Any] = []
    for epoch in range(loader.epoch, num_epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            seen.append(batch["input_ids"])
            if len(seen) == stop_after:
                return seen, checkpoint_roundtrip(loader.state_dict())
    return seen, checkpoint_roundtrip(loader.state_dict())


def checkpoint_roundtrip(state: dict) -> dict:
    """What a checkpoint file does to the state: torch.save, then a weights_only load."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def stop_and_resume(name: str, make_loader, num_epochs: int) -> bool:
    reference, _ = run(make_loader, num_epochs)
    stop = len(reference) // 2 - 1
    before, state = run(make_loader, num_epochs, stop_after=stop)
    after, _ = run(make_loader, num_epochs, state=state)
    resumed = before + after
    same = len(resumed) == len(reference) and all(torch.equal(a, b) for a, b in zip(reference, resumed, strict=False))
    print(f"{name}: {len(reference)} batches, stopped after {stop}, resumed: identical {same}")
    return same


def to_tensors(row: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor(row["input_ids"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a smaller run, for the test suite")
    args = parser.parse_args()
    datasets.disable_progress_bars()
    rows = 120 if args.smoke else 2000
    dataset = corpus(rows)

    # 1. The Arrow dataset itself: map-style, so the loader's O(1) position works as for any dataset.
    arrow = dataset.with_format("torch", columns=["input_ids"])
    ok_arrow = stop_and_resume(
        "datasets.Dataset in ResumableDataLoader",
        lambda: ResumableDataLoader(arrow, batch_size=8, shuffle=True, seed=0, num_workers=2),
        num_epochs=2,
    )

    # 2. A Hub-style folder of Parquet shards, streamed.
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "data").mkdir()
        for k in range(4):
            shard = dataset.shard(4, k, contiguous=True)
            shard.to_parquet(f"{root}/data/train-{k:05d}-of-00004.parquet", batch_size=50)  # 50-row row groups
        files = sorted(Path(root).glob("data/train-*.parquet"))

        def streamed() -> StreamLoader:
            reader = ParquetReader(["input_ids"], parse=to_tensors)
            stream = ShardedIterable(files, read_shard=reader, seed=0).shuffle_buffer(64, seed=1)
            return StreamLoader(stream, batch_size=8, num_workers=2)

        ok_parquet = stop_and_resume("Parquet shards through ParquetReader", streamed, num_epochs=2)

    identical = ok_arrow and ok_parquet
    print(f"identical: {identical}")
    raise SystemExit(0 if identical else 1)


if __name__ == "__main__":
    main()
