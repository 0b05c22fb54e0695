"""Forked DataLoader workers leave the parent's connections to the storage server working.

Specification: after the main process has read a bucket (its storage client keeps the connection
open in a pool), DataLoader workers forked from it read the same bucket; the main process's next
request is then answered at once, not after the client's read timeout.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from resumable_data.storage.files import Remote
from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader

READ_TIMEOUT_S = 3  # the client's read timeout here: a stalled request fails instead of retrying


def test_the_parents_next_request_after_forked_workers_read_the_bucket_is_answered_at_once(s3_server: Any) -> None:
    bucket = s3_server.bucket()
    options = s3_server.options(read_timeout=READ_TIMEOUT_S, retries={"mode": "standard", "max_attempts": 1})
    urls = [f"s3://{bucket}/tok_{s}.bin" for s in range(4)]
    for s, url in enumerate(urls):
        s3_server.put(url, (s * 1000 + np.arange(64, dtype=np.uint16)).tobytes())
    remote = Remote(options)
    assert remote.read_ranges(urls[0], [0], [2]) == [np.uint16(0).tobytes()]  # the parent's pooled connection

    stream = ShardedIterable(urls, read_shard=TokenShardReader(8, storage_options=options))
    batches = list(StreamLoader(stream, batch_size=4, num_workers=2, timeout=60))
    assert sorted(int(b) for batch in batches for b in batch[:, 0]) == [
        s * 1000 + i for s in range(4) for i in range(0, 64, 8)
    ]

    started = time.monotonic()
    assert remote.read_ranges(urls[1], [0], [2]) == [np.uint16(1000).tobytes()]
    assert time.monotonic() - started < 1.0, "the parent's request waited for its read timeout"
