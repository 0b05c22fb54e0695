"""Token data: a corpus of bytes in two memmapped files (train, val), fixed-size windows over it, and
what the loop reads (:class:`TrainingData`; ``documents.py`` streams ``.jsonl``/``.parquet`` documents instead).

The default corpus needs no download: the Python standard library's own source, in sorted order and
capped, so it is the same on every run on a machine. Tokens are bytes, written once to ``train.bin``
and ``val.bin`` in a cache folder named by a hash of the inputs; later runs only memmap them. Their
sha256, recorded at the build, goes into each checkpoint: a resume on changed content is refused.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sysconfig
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from resumable_data import ResumableDataLoader
from resumable_data.position import skip_state

from .config import TrainConfig
from .parallel import Parallel

# Byte-level tokens: one byte each, so uint8 holds the whole vocabulary (256).
TOKEN_DTYPE = np.uint8
# The default corpus is capped so building it and one epoch over it stay small on a laptop.
DEFAULT_CORPUS_BYTES = 4 * 2**20
VAL_FRACTION = 0.1
# Bumped when the way the files are turned into tokens changes, so old caches are not reused (2: sha256).
CACHE_FORMAT = 2
_SEPARATOR = b"\n"


@dataclass(frozen=True)
class TokenData:
    """Where a prepared corpus lives, what it was built from, and a digest of its tokens."""

    train: Path
    val: Path
    source: str
    n_files: int
    sha256: str  # of train.bin's bytes, then val.bin's

    def describe(self) -> str:
        """One line for the log: the source and the split sizes."""
        sizes = f"{self.train.stat().st_size:,} train bytes, {self.val.stat().st_size:,} val bytes"
        return f"{self.source}: {self.n_files} files, {sizes}"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/resumable_data/trainer`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "resumable_data" / "trainer"


def user_files(path: Path) -> list[Path]:
    """A text file, or every non-hidden file under a folder, sorted by relative path.

    Raises:
        ValueError: the path does not exist or holds no files.
    """
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"--data {path}: no such file or folder")
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise ValueError(f"--data {path}: the folder holds no files")
    return files


def prepare_data(data: str | os.PathLike[str] | None, cache_dir: Path, say: Callable[[str], None] = print) -> TokenData:
    """The train/val token files of ``data`` (a text file, a folder, or None: the standard library's
    top-level ``*.py`` files) in ``cache_dir``, built on first use; the last ``VAL_FRACTION`` of the
    bytes is the validation split. ``say`` gets a line before and after a build.

    Raises:
        ValueError: the path is missing or empty, or the corpus is too small to split.
    """
    if data is None:
        stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        files, cap, source = stdlib, DEFAULT_CORPUS_BYTES, "Python standard library source"
    else:
        files, cap, source = user_files(Path(data)), None, str(data)
    # The key covers everything the tokens depend on; mtime catches edits that keep the size.
    listing = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, cap, VAL_FRACTION, listing]).encode()).hexdigest()[:16]
    folder = cache_dir / key
    built = not (folder / "meta.json").is_file()
    if built:
        # The first launch on a machine builds the corpus: say so, rather than stay silent.
        say(f"tokenizing {len(files)} files of {source} into {folder} (once; later runs reuse it)")
        started = time.perf_counter()
        _build(files, cap, folder, {"source": source, "files": len(files)})
    sha256 = json.loads((folder / "meta.json").read_text())["sha256"]
    prepared = TokenData(folder / "train.bin", folder / "val.bin", source, len(files), sha256)
    if built:
        say(f"tokenized: {prepared.describe()} in {time.perf_counter() - started:.1f} s")
    return prepared


def _build(files: list[Path], cap: int | None, folder: Path, meta: dict[str, Any]) -> None:
    """Write train.bin, val.bin and meta.json into a scratch folder, then rename it into place.

    The rename makes the cache entry appear complete or not at all, so an interrupted build or two
    runs building at once never leave a half-written corpus behind.
    """
    total = sum(f.stat().st_size + len(_SEPARATOR) for f in files)
    total = total if cap is None else min(total, cap)
    split = total - int(total * VAL_FRACTION)
    if split < 2 or total - split < 2:
        raise ValueError(
            f"the corpus has {total} bytes, too few to split into train and validation; give --data more text"
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = folder.parent / f".tmp-{folder.name}-{uuid.uuid4().hex[:8]}"
    scratch.mkdir()
    try:
        written = 0
        digest = hashlib.sha256()  # of train.bin's bytes, then val.bin's
        with open(scratch / "train.bin", "wb") as train, open(scratch / "val.bin", "wb") as val:
            for path in files:
                # Files are read one at a time, so a large folder never has to fit in memory.
                chunk = (path.read_bytes() + _SEPARATOR)[: total - written]
                cut = max(0, min(len(chunk), split - written))
                train.write(chunk[:cut])
                val.write(chunk[cut:])
                digest.update(chunk)
                written += len(chunk)
                if written >= total:
                    break
        record = {**meta, "bytes": written, "split": split, "sha256": digest.hexdigest()}
        (scratch / "meta.json").write_text(json.dumps(record))
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    try:
        os.rename(scratch, folder)
    except OSError:
        shutil.rmtree(scratch, ignore_errors=True)
        if not (folder / "meta.json").is_file():  # another run finished the same build first
            raise


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``block_size`` tokens: item ``i`` is ``(x, y)``, ``y`` = ``x`` shifted by one.

    Fixed windows make a map-style dataset whose length and items never change, which is what lets
    the loader's state be just a position in a keyed permutation of the windows.

    Raises:
        ValueError: the file is shorter than one window plus one token.
    """

    def __init__(self, path: Path, block_size: int) -> None:
        self.path = Path(path)
        self.block_size = block_size
        n_tokens = self.path.stat().st_size // np.dtype(TOKEN_DTYPE).itemsize
        # The last target needs one token beyond the window.
        self.n_windows = (n_tokens - 1) // block_size
        if self.n_windows < 1:
            raise ValueError(
                f"{self.path} has {n_tokens} tokens, fewer than one window of block_size={block_size} "
                "plus one; use a smaller --block-size or more data"
            )
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        return self.n_windows

    def spread(self, n: int) -> list[int]:
        """``n`` window indices (at most all) spread evenly over the file, for a fixed evaluation set."""
        n = min(n, self.n_windows)
        return list(range(0, self.n_windows, self.n_windows // n))[:n]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n_windows:
            raise IndexError(f"window {index} out of range for {self.n_windows} windows")
        if self._tokens is None:
            # Opened lazily in each process (the main one or a DataLoader worker).
            self._tokens = np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r")
        start = index * self.block_size
        window = torch.from_numpy(self._tokens[start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        # Workers started with "spawn" get the path, not a pickled copy of the mapped file.
        return {**self.__dict__, "_tokens": None}


@dataclass
class TrainingData:
    """What the loop reads: a loader of ``(x, y)`` batches, fixed validation pairs, a line for the log."""

    loader: Any  # a ResumableDataLoader here, a StreamLoader in documents.StreamData
    val: list[tuple[torch.Tensor, torch.Tensor]]
    description: str
    # The corpus's, compared on resume; None for documents (the stream checks each shard it resumes in).
    sha256: str | None = field(default=None, kw_only=True)

    def batches(self) -> Iterator[Any]:
        """Batches forever: each new ``iter()`` continues the loader's epoch, or starts the next."""
        return (batch for _ in itertools.count() for batch in self.loader)

    def epoch_length(self, grad_accum: int) -> str:
        return f"{len(self.loader) // grad_accum} optimizer steps per epoch"

    def done(self) -> str:
        """How far into its epoch the loader is, for the resume log."""
        done = self.loader.position // (self.loader.batch_size * self.loader.sampler.world_size)
        return f"{done} of {len(self.loader)} batches done"

    def peek(self, n: int) -> list[Any]:
        """What the next ``n`` batches are, for the resume audit (changes nothing): their window indices."""
        return self.loader.peek_indices(n)

    def skip(self, batches: int) -> None:
        """Move the loader past its next ``batches`` batches, recorded in its state as skipped (``--skip-batches``)."""
        self.loader.load_state_dict(skip_state(self.loader.state_dict(), batches=batches))


def training_data(config: TrainConfig, block_size: int, par: Parallel, say: Callable[[str], None]) -> TrainingData:
    """``--data``'s text corpus (:func:`prepare_data`) as windows in a resumable order, and as many
    validation windows as an evaluation takes, spread over the split.

    Raises:
        ValueError: the training split holds less than one batch per rank.
    """
    data = prepare_data(config.data, Path(config.cache_dir or default_cache_dir()), say)
    train_windows, val_windows = TokenWindows(data.train, block_size), TokenWindows(data.val, block_size)
    loader = ResumableDataLoader(
        train_windows,
        batch_size=config.batch_size,
        shuffle=True,
        seed=config.seed,
        rank=par.rank,
        world_size=par.world_size,
        drop_last=True,  # every step sees the same number of tokens
        num_workers=config.num_workers,
        pin_memory=par.device.type == "cuda",
    )
    if len(loader) == 0:  # drop_last with fewer windows than a batch: an endless empty loop
        raise ValueError(
            f"the training split has {len(train_windows)} windows of {block_size} bytes, fewer "
            f"than one batch of {config.batch_size} per rank on {par.world_size} ranks; use a smaller "
            "--batch-size or --block-size, or more data"
        )
    val = [val_windows[i] for i in val_windows.spread(config.eval_batches * config.batch_size)]
    return TrainingData(loader, val, data.describe(), sha256=data.sha256)
