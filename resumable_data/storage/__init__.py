"""Shards in object storage (S3-compatible, GCS, Azure, HTTP): reading them through fsspec, and keeping
them in a node-local cache.

The stream readers (:class:`~resumable_data.streams.TokenShardReader`,
:class:`~resumable_data.streams.TextLineReader`, :class:`~resumable_data.streams.ParquetReader`)
and :class:`~resumable_data.streams.ShardedIterable` take URLs; this package is what they read them
with. :class:`ShardCache` keeps downloaded shards on a node's disk, shared by its processes, bounded,
and evicted by next use from the keyed order; the readers' ``cache_dir=`` reads through it
(:mod:`resumable_data.storage.cached`). It imports no other part of the library.
"""

from .cache import CacheCounters, CachedShard, RemoteShard, ShardCache
from .files import StorageError, expand_shards, is_url

__all__ = [
    "CacheCounters",
    "CachedShard",
    "RemoteShard",
    "ShardCache",
    "StorageError",
    "expand_shards",
    "is_url",
]
