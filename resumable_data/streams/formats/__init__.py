"""Readers for shards another library wrote, read as that library wrote them: no conversion.

Each reader is a ``read_shard`` for :class:`~resumable_data.streams.ShardedIterable` with an O(1)
seek (the format's own sample offsets, or a member index built once), shard identities, and the
record counts from the format's index, so a stream over them restores exactly like one over our
own token shards.
"""

from __future__ import annotations

from .litdata import LitdataReader, litdata_stream
from .mds import MDSReader, mds_stream
from .webdataset import WebDatasetReader, expand_braces, webdataset_stream

__all__: list[str] = [
    "LitdataReader",
    "MDSReader",
    "WebDatasetReader",
    "expand_braces",
    "litdata_stream",
    "mds_stream",
    "webdataset_stream",
]
