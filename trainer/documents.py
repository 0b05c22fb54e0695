"""``--data`` as ``.jsonl`` or ``.parquet`` documents, streamed: never tokenized ahead, never cached.

The files (sorted) are the shards of a ``ShardedIterable``, their order shuffled per epoch, read as
JSONL lines (the cursor a byte offset) or Parquet rows (a row number); a shuffle buffer mixes
documents; each becomes its text field's UTF-8 bytes, ``pack`` appends an end-of-document token
(:data:`EOS`: the model's vocabulary grows to 257) and cuts windows of ``block_size + 1`` tokens, and
a ``StreamLoader`` batches them as ``(x, y)`` pairs. Each ``(rank, worker)`` reads every
``world_size * num_workers``-th file of the epoch's order (under torchrun the ranks' epochs end
together: see :class:`StreamData`), and the loader's state is cursors and a few document keys,
never tokens. The last file is held out: its first windows are the validation set.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from resumable_data import ShardedIterable, Stream, StreamLoader
from resumable_data.position import skip_stream_state
from resumable_data.streams import ParquetReader, TextLineReader

from .config import TrainConfig
from .data import TrainingData, user_files
from .parallel import Parallel

SUFFIXES = (".jsonl", ".parquet")
EOS = 256  # the token after each document, past the 256 byte values
# Documents held by the shuffle buffer: a restore re-reads them, a larger one mixes more files.
SHUFFLE_DOCUMENTS = 256


def document_files(data: str | os.PathLike[str] | None) -> list[Path] | None:
    """The sorted files of ``--data`` when they are ``.jsonl``/``.parquet`` documents; None for text.

    Raises:
        ValueError: the path is missing or empty, or mixes documents with other files.
    """
    files = [] if data is None else user_files(Path(data))
    others = [str(f) for f in files if f.suffix not in SUFFIXES]
    if others and len(others) < len(files):
        raise ValueError(
            f"--data {data} mixes .jsonl/.parquet documents with other files ({others[:3]}); give one kind"
        )
    return files if files and not others else None


class DocumentReader:
    """``read_shard`` of the document stream: each file's lines (``.jsonl``) or rows (``.parquet``)."""

    def __init__(self, field: str, parquet: bool) -> None:
        self.field, self.jsonl = field, TextLineReader(json.loads)
        self.parquet = ParquetReader([field]) if parquet else None  # only then is pyarrow needed

    def _reader(self, shard: str) -> Any:
        return self.parquet if shard.endswith(".parquet") else self.jsonl

    def identity(self, shard: str) -> str:
        """Size and content digest: a restore refuses a partly read file that changed."""
        return self._reader(shard).identity(shard)

    def read_from(self, shard: str, start: int) -> Iterator[tuple[int, Any]]:
        """``(next cursor, document)`` pairs from cursor ``start``."""
        if shard.endswith(".parquet"):
            return enumerate(self._reader(shard)(shard, start), start=start + 1)
        return self.jsonl.read_from(shard, start)

    def tokens(self, document: Any) -> torch.Tensor:
        """The document's text field as UTF-8 bytes, int64."""
        text = document.get(self.field) if isinstance(document, dict) else None
        if not isinstance(text, str):
            raise ValueError(
                f"a document has no text field {self.field!r}: {str(document)[:80]}; --text-field names it"
            )
        return torch.from_numpy(np.frombuffer(text.encode(errors="replace"), dtype=np.uint8).astype(np.int64))


def _windows(files: list[Path], block_size: int, config: TrainConfig, *, shuffle: bool) -> Stream:
    """Windows of ``block_size + 1`` tokens of ``files``' documents; each slot's short last one is dropped."""
    reader = DocumentReader(config.text_field, any(f.suffix == ".parquet" for f in files))
    documents = ShardedIterable([str(f) for f in files], read_shard=reader, shuffle=shuffle, seed=config.seed)
    if shuffle:
        documents = documents.shuffle_buffer(SHUFFLE_DOCUMENTS, seed=config.seed)
    # reader.tokens draws nothing random: global_rng=None skips seeding the RNGs per record below pack.
    return documents.map(reader.tokens, global_rng=None).pack(block_size + 1, eos=EOS)


def _shifted(windows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of windows as ``(x, y)``: ``y`` is ``x`` shifted by one token."""
    stacked = torch.stack(windows)
    return stacked[:, :-1].contiguous(), stacked[:, 1:].contiguous()


def document_loader(files: list[Path], block_size: int, config: TrainConfig, par: Parallel) -> StreamLoader:
    """This rank's batches of ``files``, in a resumable order."""
    return stream_loader(_windows(files, block_size, config, shuffle=True), config, par)


def stream_loader(windows: Stream, config: TrainConfig, par: Parallel) -> StreamLoader:
    """This rank's batches of a stream of windows of ``block_size + 1`` tokens, as ``(x, y)`` pairs."""
    return StreamLoader(
        windows,
        batch_size=config.batch_size,
        drop_last=True,  # every step sees the same number of tokens
        collate_fn=_shifted,
        num_workers=config.num_workers,
        rank=par.rank,
        world_size=par.world_size,
        pin_memory=par.device.type == "cuda",
    )


@dataclass
class StreamData(TrainingData):
    """:class:`TrainingData` of streamed documents; ``twin`` builds another loader of the same batches,
    ``pipeline`` the stream of windows it batches.

    ``all_true`` tells whether a flag holds on every rank (:func:`on_every_rank`): the ranks read
    different files, so their epochs hold different numbers of batches, and an epoch ends on every
    rank when it ends on one (its other batches are dropped, as ``drop_last`` drops a short batch).
    In lockstep, every rank's loader is in the same epoch at every step, so the ranks' states merge
    into one checkpoint (which refuses ranks in different epochs) and resume on any number of ranks.
    """

    twin: Callable[[], StreamLoader]
    pipeline: Callable[[], Stream]
    all_true: Callable[[bool], bool] = bool  # a single process: its own flag

    def batches(self) -> Iterator[Any]:
        """Batches forever, epoch after epoch in lockstep over the ranks: each step every rank takes
        the next batch of the current epoch, or all of them go on with the next epoch.

        Raises:
            ValueError: two epochs in a row yield nothing (one may: a restore at an epoch's end),
                which a stream can only tell once it is read; the loop would wait forever.
        """
        epoch, empty = self.loader.epoch, 0
        while empty < 2:
            # Chosen, not left to the loader: a pass ends with the epoch (a restored one with it,
            # too) instead of going on with the next one, which the other ranks may not have reached.
            self.loader.set_epoch(epoch)
            empty += 1
            with contextlib.closing(iter(self.loader)) as passing:
                while True:
                    batch = next(passing, None)
                    # One all-reduce per batch, on every rank: a rank whose epoch ended says so at
                    # the step it ends, and the ranks with a batch left drop it.
                    if not self.all_true(batch is not None):
                        break
                    empty = 0
                    yield batch
            epoch += 1
        raise ValueError(
            "an epoch of this rank's documents or token shards holds no batch (fewer than --batch-size windows per "
            "worker); use more data, or fewer --num-workers or ranks"
        )

    def epoch_length(self, grad_accum: int) -> str:
        return "epochs of unknown length (streamed)"

    def done(self) -> str:
        return f"{self.loader.batches_yielded} batches done"

    def peek(self, n: int) -> list[Any]:
        """A hash of each of the next ``n`` batches' tokens (a stream has no indices), read by a
        twin loader restored to this one's state: this loader does not move."""
        twin = StreamData(self.twin(), [], "", self.twin, self.pipeline)
        twin.loader.load_state_dict(self.loader.state_dict())
        with contextlib.closing(twin.batches()) as batches:
            return [hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16] for x, _ in itertools.islice(batches, n)]

    def skip(self, batches: int) -> None:
        """Move this rank's slots past its next ``batches`` batches (every rank does, in lockstep);
        refused for a pipeline a skip cannot move (documents: a shuffle buffer and packing)."""
        state = self.loader.state_dict()
        moved = skip_stream_state(
            state, self.pipeline(), batches=batches, batch_size=self.loader.batch_size, drop_last=self.loader.drop_last
        )
        self.loader.load_state_dict(moved)


def document_data(config: TrainConfig, block_size: int, files: list[Path], par: Parallel) -> StreamData:
    """All files but the last streamed for training; the last one's first windows, as many as an
    evaluation takes, for validation.

    Raises:
        ValueError: fewer than 2 files, or a validation file shorter than a window.
    """
    *train_files, val_file = files
    if not train_files:
        raise ValueError(f"--data {config.data}: documents need 2 or more files (the last is the validation set)")
    val_windows = _windows([val_file], block_size, config, shuffle=False)
    val = [(w[:-1], w[1:]) for w in itertools.islice(val_windows, config.eval_batches * config.batch_size)]
    if not val:
        raise ValueError(f"the validation file {val_file} holds fewer than {block_size + 1} tokens: one window")
    described = f"{config.data}: {len(train_files)} files of documents, streamed, {len(val)} val windows of the last"
    twin = partial(document_loader, train_files, block_size, config, par)
    pipeline = partial(_windows, train_files, block_size, config, shuffle=True)
    return StreamData(twin(), val, described, twin, pipeline, on_every_rank(par))


def on_every_rank(par: Parallel) -> Callable[[bool], bool]:
    """Whether a flag holds on every rank: the mean of the flags is 1 (one all-reduce per call)."""
    if not par.distributed:
        return bool
    return lambda flag: par.mean(torch.tensor([float(flag)], dtype=torch.float64, device=par.device)).item() == 1.0
