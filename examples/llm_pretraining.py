"""LLM pretraining data: JSONL documents, tokenized, packed into fixed windows, mixed on a schedule,
batched by 2 worker processes, stopped mid-epoch and resumed exactly.

Two corpora ("web" and "code") of JSONL documents go through a byte-level tokenizer (a ``map``;
no download), ``pack`` (windows of BLOCK + 1 tokens, an end-of-document token after each
document) and ``mix`` with a schedule (code off for the first windows of each worker, then 1:1).
The checkpoint holds byte offsets into the JSONL files and, per corpus, the key of the one
document the last window ended in: never tokens. A restore seeks into each file and re-reads that
one document.

Then the same checkpoint is resumed with 1 worker instead of 2: the rest of the epoch comes in
another order, but every token of the epoch is still trained on exactly once.

    python examples/llm_pretraining.py            # CPU only, under a minute
    python examples/llm_pretraining.py --smoke    # what the test suite runs
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from resumable_data import ShardedIterable, StreamLoader, mix
from resumable_data.streams import TextLineReader

BLOCK = 64  # tokens per training example; each window holds BLOCK + 1 for next-token targets
EOS = 256  # after the 256 byte values
PAD = 257  # pads each worker's last window of an epoch (instead of dropping its tokens)
WORDS = ["the", "data", "resumes", "exactly", "def", "return", "model", "token", "(x)", "{", "}", "window"]


def write_corpus(folder: Path, name: str, num_files: int, docs_per_file: int, seed: int) -> list[Path]:
    """JSONL files of documents of random lengths (``name_000.jsonl``, ...)."""
    rng = np.random.default_rng(seed)
    paths = []
    for k in range(num_files):
        path = folder / f"{name}_{k:03d}.jsonl"
        lines = []
        for _ in range(docs_per_file):
            words = rng.choice(WORDS, size=int(rng.integers(1, 60)))
            lines.append(json.dumps({"text": " ".join(words)}))
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths


def tokenize(document: dict) -> list[int]:
    """A byte-level tokenizer: a stand-in for a real one, which the map would call the same way."""
    return list(document["text"].encode())


def make_loader(web: list[Path], code: list[Path], num_workers: int = 2) -> StreamLoader:
    corpora = [
        ShardedIterable(paths, read_shard=TextLineReader(json.loads), seed=k)
        .map(tokenize, global_rng=None)  # draws nothing random: no per-record seeding below pack
        .pack(BLOCK + 1, eos=EOS, pad_id=PAD)
        for k, paths in enumerate([web, code])
    ]
    # Records drawn per worker: code is off for the first 20 windows, then the mix is 1:1.
    stream = mix(corpora, weights=[(0, [1, 0]), (20, [1, 1])], seed=2)
    return StreamLoader(stream, batch_size=8, num_workers=num_workers)


def batches(loader: StreamLoader, num_epochs: int, stop_after: int | None = None) -> list[torch.Tensor]:
    """The epoch loop of a training job, stopped after ``stop_after`` batches (a preemption)."""
    seen = []
    for epoch in range(loader.epoch, num_epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            inputs, targets = batch[:, :-1], batch[:, 1:]  # what the model step would take
            seen.append(torch.stack([inputs, targets]))
            if len(seen) == stop_after:
                return seen
    return seen


def checkpoint_roundtrip(state: dict) -> dict:
    """What a checkpoint file does to the state: torch.save, then a weights_only load."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def tokens_of(seen: list[torch.Tensor]) -> Counter:
    """The tokens trained on (each window's inputs plus its last target), padding left out."""
    windows = torch.cat([torch.cat([b[0], b[1][:, -1:]], dim=1) for b in seen])
    return Counter(t for t in windows.reshape(-1).tolist() if t != PAD)


def corpus_tokens(paths: list[Path]) -> Counter:
    documents = [json.loads(line) for path in paths for line in path.read_text().splitlines()]
    return Counter(t for document in documents for t in [*tokenize(document), EOS])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a smaller run, for the test suite")
    args = parser.parse_args()
    docs = 40 if args.smoke else 400
    num_epochs = 2

    with tempfile.TemporaryDirectory() as folder:
        web = write_corpus(Path(folder), "web", 4, docs, seed=0)
        code = write_corpus(Path(folder), "code", 2, docs, seed=1)

        reference = batches(make_loader(web, code), num_epochs)
        epoch_batches = len(batches(make_loader(web, code), 1))
        stop = epoch_batches // 3  # inside the first epoch, the schedule's first piece behind it
        first_leg = make_loader(web, code)
        before = batches(first_leg, num_epochs, stop_after=stop)
        state = checkpoint_roundtrip(first_leg.state_dict())

        resumed_loader = make_loader(web, code)  # a fresh process would build it the same way
        resumed_loader.load_state_dict(state)
        after = batches(resumed_loader, num_epochs)

        # The same checkpoint, resumed with 1 worker: the rest of epoch 0, every token once.
        elastic = make_loader(web, code, num_workers=1)
        elastic.load_state_dict(state)
        rest = batches(elastic, 1)
        exactly_once = tokens_of(before + rest) == corpus_tokens(web) + corpus_tokens(code)

    resumed = before + after
    print(f"{len(reference)} batches of 8 x {BLOCK} tokens over {num_epochs} epochs; stopped after {stop}")
    print(f"state: {len(json.dumps(state))} characters of JSON (byte offsets and one document key per corpus)")
    print(f"resumed with 1 worker instead of 2, every token of epoch 0 exactly once: {exactly_once}")
    identical = len(resumed) == len(reference) and all(
        torch.equal(a, b) for a, b in zip(reference, resumed, strict=False)
    )
    print(f"identical: {identical}")
    raise SystemExit(0 if identical and exactly_once else 1)


if __name__ == "__main__":
    main()
