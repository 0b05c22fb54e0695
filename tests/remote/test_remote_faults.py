"""Faults between a reader and the S3 server, injected by the proxy of proxy.py (real client, real
server): throttling and resets are retried by the client and change no record; a fault that does not
end is one error naming the URL within a bounded time; a shard rewritten on the server since the
checkpoint is refused by name; a missing bucket or missing credentials is a clear error at once.
"""

from __future__ import annotations

import itertools
import re
import time
from typing import Any

import numpy as np
import pytest

from harness import json_roundtrip
from proxy import CUT, RESET, SLOWDOWN
from resumable_data import ResumeError
from resumable_data.storage import StorageError
from resumable_data.streams import ShardedIterable, TokenShardReader
from resumable_data.testing import assert_same

SIZES = [8 * 40, 8 * 25 + 3, 8 * 33]
# Few, fast attempts, so that a permanent fault ends quickly: botocore's attempts per request (each
# under a 2 s timeout); s3fs adds its own few retries of throttling and interrupted bodies.
FAST = {"connect_timeout": 2, "read_timeout": 2, "retries": {"mode": "standard", "max_attempts": 3}}


@pytest.fixture(scope="module")
def bucket(s3_server: Any) -> str:
    name = s3_server.bucket()
    for s, n in enumerate(SIZES):
        s3_server.put(f"s3://{name}/tok_{s}.bin", (s * 1000 + np.arange(n)).astype(np.uint16).tobytes())
    return name


def stream(s3_server: Any, bucket: str, endpoint: str | None = None, **kwargs: Any) -> ShardedIterable:
    reader = TokenShardReader(8, storage_options=s3_server.options(endpoint, **FAST))
    return ShardedIterable(f"s3://{bucket}/*.bin", read_shard=reader, seed=1, **kwargs).shuffle_buffer(5, seed=2)


def local(s3_server: Any, bucket: str) -> list[Any]:
    paths = sorted(str(p) for p in (s3_server.root / bucket).glob("*.bin"))
    return list(ShardedIterable(paths, read_shard=TokenShardReader(8), seed=1).shuffle_buffer(5, seed=2))


def test_throttling_and_resets_are_retried_and_change_no_record(s3_server: Any, bucket: str, proxy: Any) -> None:
    reference = local(s3_server, bucket)
    proxy.inject(SLOWDOWN, RESET, CUT)  # the next requests, listing and counting included
    remote = stream(s3_server, bucket, proxy.endpoint)
    first = list(itertools.islice(iter(remote), 30))
    proxy.inject(RESET, SLOWDOWN)  # the restore's reads
    restored = stream(s3_server, bucket, proxy.endpoint)
    restored.load_state_dict(json_roundtrip(remote.state_dict()))
    assert_same(reference, first + list(restored), "records read through faults")
    assert proxy.faulted == 5


@pytest.mark.parametrize("fault", [SLOWDOWN, RESET])
def test_a_fault_that_does_not_end_is_one_error_naming_the_url_in_bounded_time(
    s3_server: Any, bucket: str, proxy: Any, fault: str
) -> None:
    remote = stream(s3_server, bucket, proxy.endpoint)
    reading = iter(remote)
    next(reading)
    proxy.always = fault
    started = time.monotonic()
    with pytest.raises(ResumeError, match=rf"s3://{bucket}/tok_\d\.bin") as raised:
        list(reading)
    assert time.monotonic() - started < 30
    cause = repr(raised.value.__cause__)
    assert isinstance(raised.value.__cause__, StorageError), cause
    # A HEAD answer has no body: botocore names the status, not the code.
    expected = "SlowDown|Service Unavailable" if fault == SLOWDOWN else "Could not connect|reset|Connection"
    assert re.search(rf"failed after [\d.]+ s: .*({expected})", cause), cause


def test_a_shard_rewritten_on_the_server_is_refused_by_name(s3_server: Any, bucket: str) -> None:
    s3_server.put(f"s3://{bucket}/changing/tok_0.bin", np.arange(8 * 20, dtype=np.uint16).tobytes())

    def make(**kwargs: Any) -> ShardedIterable:
        reader = TokenShardReader(8, storage_options=s3_server.options())
        return ShardedIterable(f"s3://{bucket}/changing/*.bin", read_shard=reader, **kwargs)

    first = make()
    head = list(itertools.islice(iter(first), 5))
    state = json_roundtrip(first.state_dict())
    rewritten = np.arange(8 * 20, dtype=np.uint16)[::-1].copy()  # as many records, other tokens
    s3_server.put(f"s3://{bucket}/changing/tok_0.bin", rewritten.tobytes())
    restored = make()
    restored.load_state_dict(state)
    with pytest.raises(
        ResumeError, match=rf"shard 0 's3://{bucket}/changing/tok_0\.bin' .*changed since the checkpoint"
    ):
        next(iter(restored))
    reading_on = make(allow_changed_shards=True)
    reading_on.load_state_dict(state)
    assert len(head) + len(list(reading_on)) == 20


def test_a_missing_bucket_is_a_clear_error_when_the_stream_is_built(s3_server: Any) -> None:
    reader = TokenShardReader(8, storage_options=s3_server.options())
    with pytest.raises(ResumeError, match=r"'s3://no-such-bucket-x/tok\.bin' is missing.*bucket does not exist"):
        ShardedIterable(["s3://no-such-bucket-x/tok.bin"], read_shard=reader)
    with pytest.raises(FileNotFoundError, match=r"s3://no-such-bucket-x/\*\.bin"):
        ShardedIterable("s3://no-such-bucket-x/*.bin", read_shard=reader)


def test_wrong_or_missing_credentials_are_a_clear_error_naming_the_url(
    s3_server: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{bucket}/tok_0.bin"
    wrong = {**s3_server.options(**FAST), "secret": "not-the-secret"}
    with pytest.raises(ResumeError, match=rf"'{url}' failed after .* s: PermissionError: Forbidden"):
        ShardedIterable([url], read_shard=TokenShardReader(8, storage_options=wrong))
    # No credentials anywhere: the environment, the profile files and the instance metadata say none.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    none = {k: v for k, v in s3_server.options(**FAST).items() if k not in ("key", "secret")}
    with pytest.raises(ResumeError, match=rf"'{url}'.*(credentials|Forbidden|Access)"):
        ShardedIterable([url], read_shard=TokenShardReader(8, storage_options=none))
