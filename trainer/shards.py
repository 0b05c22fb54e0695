"""``--data`` as token shards that ``python -m resumable_data write-shards`` wrote, in a local folder
or in object storage (``s3://bucket/tokens/``), streamed: what the trainer reads at scale.

``--data`` names the shards' ``index.json`` (or its folder, or a URL of either); the index gives
every shard's token count, so no shard is opened to size the epoch. Each shard is cut into
windows of ``block_size + 1`` tokens, consecutive windows sharing one token so that every token
but the first is a target once (as the text corpus's ``TokenWindows``); the shard order is
shuffled per epoch, a ``shuffle_window`` mixes windows (its state is a position: a restore reads
only the windows it hands out, a few ranged requests on a remote shard), and the documents'
``StreamLoader`` batches them (see :mod:`trainer.documents`: workers, lockstep under torchrun).
The last shard is held out: its first windows are the validation set.

Credentials and the endpoint come from the environment as s3fs and botocore take them
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL`` for an
S3-compatible server): nothing secret is a flag, so nothing secret is logged with the config.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from functools import partial
from typing import Any

import numpy as np

from resumable_data import ShardedIterable, Stream, StreamLoader
from resumable_data.streams import TokenShardReader
from resumable_data.streams.shard_index import INDEX_NAME, ShardIndex, is_url

from .config import TrainConfig
from .documents import StreamData, on_every_rank, stream_loader
from .parallel import Parallel

# Windows a shuffle window mixes: its order is a keyed permutation, so a larger one costs no state.
SHUFFLE_WINDOWS = 1024


def shard_index(data: str | None) -> ShardIndex | None:
    """The index of ``--data`` when it names token shards (a URL, an ``index.json`` file, or a folder
    holding one); None for text and documents.

    Raises:
        ResumeError: the index is missing, unreadable or malformed.
    """
    if data is None:
        return None
    if not (is_url(data) or os.path.basename(data) == INDEX_NAME or os.path.isfile(os.path.join(data, INDEX_NAME))):
        return None
    return ShardIndex.load(data)


def shard_vocab_size(index: ShardIndex) -> int:
    """The model's vocabulary: every value of the shards' token type (uint16: 65,536), since the
    index does not say which ids the tokenizer uses.

    Raises:
        ValueError: a token type wider than 16 bits (its vocabulary would not fit a model).
    """
    dtype = np.dtype(index.dtype)
    if dtype.itemsize > 2:
        raise ValueError(
            f"--data {index.location}: the shards hold {dtype} tokens, and the trainer sizes its vocabulary by the "
            "token type; write them with --dtype uint16 (or uint8)"
        )
    return int(np.iinfo(dtype).max) + 1


def _reader(index: ShardIndex, block_size: int, **cache: Any) -> TokenShardReader:
    """Windows of the shards; ``cache``: ``cache_dir``, ``cache_limit``, ``prefetch`` for remote ones."""
    return TokenShardReader(block_size + 1, stride=block_size, dtype=index.dtype, **cache)


def shard_windows(index: ShardIndex, block_size: int, config: TrainConfig) -> Stream:
    """The windows of the shards of ``index``, in a resumable order (a window shuffle's positions)."""
    reader = _reader(
        index, block_size, cache_dir=config.cache_dir, cache_limit=config.cache_limit, prefetch=config.prefetch
    )
    shards = ShardedIterable.from_index(index, read_shard=reader, shuffle=True, seed=config.seed)
    return shards.shuffle_window(SHUFFLE_WINDOWS, seed=config.seed)


def shard_loader(index: ShardIndex, block_size: int, config: TrainConfig, par: Parallel) -> StreamLoader:
    """This rank's batches of the shards of ``index``."""
    return stream_loader(shard_windows(index, block_size, config), config, par)


def shard_data(config: TrainConfig, block_size: int, index: ShardIndex, par: Parallel) -> StreamData:
    """All shards but the last streamed for training; the last one's first windows, as many as an
    evaluation takes, for validation.

    Raises:
        ValueError: fewer than 2 shards, or a validation shard shorter than a window.
    """
    if len(index.shards) < 2:
        raise ValueError(
            f"--data {config.data}: token shards need 2 or more (the last is the validation set); "
            "write them with a smaller --shard-tokens"
        )
    val_shard = index.locations[-1]
    windows = _reader(index, block_size)(val_shard, 0)  # a few windows: ranged reads, no cache
    val = [(w[:-1], w[1:]) for w in itertools.islice(windows, config.eval_batches * config.batch_size)]
    if not val:
        raise ValueError(f"the validation shard {val_shard} holds fewer than {block_size + 1} tokens: one window")
    train = dataclasses.replace(index, shards=index.shards[:-1])
    described = (
        f"{config.data}: {len(train.shards)} token shards ({train.tokens:,} {index.dtype} tokens), streamed, "
        f"{len(val)} val windows of the last"
    )
    twin = partial(shard_loader, train, block_size, config, par)
    pipeline = partial(shard_windows, train, block_size, config)
    return StreamData(twin(), val, described, twin, pipeline, on_every_rank(par))
