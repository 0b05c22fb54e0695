"""Reading shards from object storage (S3-compatible, GCS, Azure, HTTP) through fsspec.

The stream readers (:class:`~resumable_data.streams.TokenShardReader`,
:class:`~resumable_data.streams.TextLineReader`, :class:`~resumable_data.streams.ParquetReader`)
and :class:`~resumable_data.streams.ShardedIterable` take URLs; this package is what they read them
with. It imports no other part of the library.
"""

from .files import StorageError, expand_shards, is_url

__all__ = ["StorageError", "expand_shards", "is_url"]
