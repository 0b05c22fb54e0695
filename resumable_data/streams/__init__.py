"""Resumable stream pipelines: sharded sources, readers, wrappers and a worker/rank-aware loader.

Build a pipeline from a source and the fluent wrappers of :class:`Stream`, then iterate it
directly or through :class:`StreamLoader`::

    stream = ShardedIterable(paths, read_shard=TokenShardReader(1025), seed=0)  # or ParquetReader()
    stream = stream.shuffle_buffer(1000, seed=0).map(augment, seed=0)
    loader = StreamLoader(stream, batch_size=32, num_workers=2)

Every stage's state nests its source's; see :mod:`resumable_data.streams.base` for record keys
and :mod:`resumable_data.streams.loader` for workers, ranks and layout changes.
"""

from .base import Stream
from .batch import Batch
from .epoch_positions import EpochPositions
from .filter import Filter
from .foreign import IterableSource, ReplayWarning
from .loader import StreamLoader
from .map import Map
from .mix import Mix, mix
from .pack import Pack, cu_seqlens
from .parquet import ParquetReader
from .positional import Positional
from .readers import TextLineReader, TokenShardReader
from .repeat import Repeat
from .shard_index import ShardEntry, ShardIndex
from .sharded import RecordCounter, ShardedIterable
from .shuffle import ShuffleBuffer
from .take import Take
from .token_batch import BatchByTokens, BucketedBatchByTokens
from .window import ShuffleWindow
from .write import jsonl_documents, write_token_shards

__all__ = [
    "Batch",
    "BatchByTokens",
    "BucketedBatchByTokens",
    "EpochPositions",
    "Filter",
    "IterableSource",
    "Map",
    "Mix",
    "Pack",
    "ParquetReader",
    "Positional",
    "RecordCounter",
    "Repeat",
    "ReplayWarning",
    "ShardEntry",
    "ShardIndex",
    "ShardedIterable",
    "ShuffleBuffer",
    "ShuffleWindow",
    "Stream",
    "StreamLoader",
    "Take",
    "TextLineReader",
    "TokenShardReader",
    "cu_seqlens",
    "jsonl_documents",
    "mix",
    "write_token_shards",
]
