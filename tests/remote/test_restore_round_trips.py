"""What a restore's first records wait for over remote shards: round trips, not client start-up.

Specification: a restored shuffle window re-reads its records from several shards with every
ranged read and every identity check in flight at once (one round trip, not two per shard), and
yields bitwise what the same pipeline yields over local files; a record past the end of a shard
that shrank is still refused by name; a process builds one S3 client for the same options (the
library's defaults are not changed by the clients built from them).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import json_roundtrip
from resumable_data import ResumeError
from resumable_data.storage.files import S3_DEFAULTS, Remote
from resumable_data.streams import ShardedIterable, ShardIndex, TokenShardReader, write_token_shards
from resumable_data.testing import assert_same

WINDOW = 8  # tokens per record
SHARD_RECORDS = 64
SHUFFLE = 200  # records in a shuffle window: it spans four shards


def pipeline(index: Any, options: dict[str, Any] | None) -> Any:
    reader = TokenShardReader(WINDOW, storage_options=options)
    return ShardedIterable.from_index(index, read_shard=reader, storage_options=options, seed=3).shuffle_window(
        SHUFFLE, seed=4
    )


def write(s3_server: Any, tmp_path: Path, shard_records: int = SHARD_RECORDS) -> tuple[str, Any, str]:
    bucket = s3_server.bucket()
    tokens = (np.arange(WINDOW * SHARD_RECORDS * 10) % 65536).astype(np.uint16)
    index = write_token_shards(
        [tokens], f"s3://{bucket}/tokens", shard_tokens=WINDOW * shard_records, storage_options=s3_server.options()
    )
    local = write_token_shards([tokens], tmp_path / "local", shard_tokens=WINDOW * shard_records)
    return bucket, index, local


@pytest.mark.parametrize("read", [SHUFFLE + SHUFFLE // 3, SHUFFLE], ids=["a third into a window", "a window's end"])
def test_a_restored_window_reads_its_shards_and_checks_them_at_once(
    s3_server: Any, proxy: Any, tmp_path: Path, read: int
) -> None:
    # At a window's end the next record opens a window: the identities of the shards it enters are
    # taken alongside its first reads (not one round trip each before them).
    bucket, index, local = write(s3_server, tmp_path)
    options = s3_server.options(proxy.endpoint)
    first = pipeline(index, options)
    reading = iter(first)
    before = [next(reading) for _ in range(read)]
    state = json_roundtrip(first.state_dict())
    restored = pipeline(index, options)
    restored.load_state_dict(state)

    proxy.reset_counters()
    proxy.hold = lambda method, path: path.startswith(f"/{bucket}/tokens/shard-")  # every shard request waits
    head: list[Any] = []
    reading = iter(restored)
    first_record = threading.Thread(target=lambda: head.append(next(reading)), daemon=True)
    first_record.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len({path for method, path, _ in proxy.log if method == "GET"}) < 2:
        time.sleep(0.05)
    held = list(proxy.log)
    proxy.release()
    first_record.join(30)

    got = {path for method, path, _ in held if method == "GET"}
    checked = {path for method, path, _ in held if method == "HEAD"}
    print(f"in flight at once: GET {sorted(got)}, HEAD {sorted(checked)}")
    # The records of the first fetch come from several shards: all their ranged reads and the
    # identity checks (of the shards the checkpoint named, or the window enters) are asked before
    # any answer.
    assert len(got) >= 2, f"the shards were read one after the other: only {held} were asked before an answer"
    assert checked >= got, f"the identity checks waited for the reads (or the reads for them): {held}"
    assert len(head) == 1, "the restored stream gave no record once the requests were let through"
    assert_same(before + head + list(reading), list(pipeline(local, None)), "restored window, reads at once")


def test_a_batch_spanning_two_windows_waits_for_one_round_of_requests(
    s3_server: Any, proxy: Any, tmp_path: Path
) -> None:
    # Restored 16 records before a window's end, a batch of 32 takes the rest of that window and the
    # start of the next: the next window's reads and the identities of the shards it enters are
    # asked together with the open window's (a loader's first batch waited for two rounds in turn,
    # then for a third: the identity a state takes of a shard entered). Shards of 160 records: the
    # batch's records lie in three of them, as a 10,000-record window over shards of 15,625 does.
    bucket, index, local = write(s3_server, tmp_path, shard_records=160)
    options = s3_server.options(proxy.endpoint)
    first = pipeline(index, options)
    reading = iter(first)
    before = [next(reading) for _ in range(2 * SHUFFLE - 16)]
    state = json_roundtrip(first.state_dict())
    restored = pipeline(index, options)
    restored.load_state_dict(state)
    upcoming = restored.upcoming_keys(32)
    assert upcoming is not None
    shards = ShardIndex.load(index, storage_options=s3_server.options()).locations
    wanted = {"/" + shards[key[1]].removeprefix("s3://") for key in upcoming}

    proxy.reset_counters()
    proxy.hold = lambda method, path: path.startswith(f"/{bucket}/tokens/shard-")
    batch: list[Any] = []
    reading = iter(restored)

    def take_a_batch() -> None:
        batch.extend(next(reading) for _ in range(32))
        restored.state_dict()  # what a loader takes after each batch

    thread = threading.Thread(target=take_a_batch, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not wanted <= {path for method, path, _ in proxy.log if method == "GET"}:
        time.sleep(0.05)
    time.sleep(0.2)  # anything else the batch asks before an answer
    held = list(proxy.log)
    proxy.release()
    thread.join(30)

    got = {path for method, path, _ in held if method == "GET"}
    assert wanted <= got, f"the reads of {sorted(wanted - got)} waited for others: {held}"
    assert len(batch) == 32, "the batch did not come once the requests were let through"
    assert proxy.log == held, f"requests after the first answers: {proxy.log[len(held) :]}"
    assert_same(before + batch + list(reading), list(pipeline(local, None)), "restored across two windows")


def test_a_record_past_the_end_of_a_shard_that_shrank_is_refused_by_name(s3_server: Any, tmp_path: Path) -> None:
    # Read without asking the shard's size first, a record the shard no longer holds is still a
    # ResumeError naming it (the size is asked once the ranged read comes back short).
    bucket = s3_server.bucket()
    url = f"s3://{bucket}/short.bin"
    s3_server.put(url, np.arange(WINDOW * 4, dtype=np.uint16).tobytes())
    reader = TokenShardReader(WINDOW, storage_options=s3_server.options())
    assert [r.tolist() for r in reader.read_records(url, [1, 3])] == [
        list(range(WINDOW, 2 * WINDOW)),
        list(range(3 * WINDOW, 4 * WINDOW)),
    ]
    with pytest.raises(ResumeError, match=r"short\.bin.*has 4 windows but the checkpoint needs the one at offset 6"):
        TokenShardReader(WINDOW, storage_options=s3_server.options()).read_records(url, [2, 6])


def test_a_process_builds_one_s3_client_for_the_same_options(s3_server: Any) -> None:
    # botocore rewrites the retries dict it is given (max_attempts becomes total_max_attempts): were
    # the library's defaults handed over as they are, the options of the next call would differ, so
    # fsspec would give another filesystem, which builds another client on first use (tens of ms of
    # CPU, paid on a restore's path by the first request after the index was read).
    bucket = s3_server.bucket()
    s3_server.put(f"s3://{bucket}/x.bin", b"\0" * 16)
    first = Remote(s3_server.options()).resolve(f"s3://{bucket}/x.bin")[0]
    Remote(s3_server.options()).identity(f"s3://{bucket}/x.bin")  # builds the client
    assert Remote(s3_server.options()).resolve(f"s3://{bucket}/x.bin")[0] is first
    assert S3_DEFAULTS["retries"] == {"mode": "standard", "max_attempts": 4}


def test_the_identities_of_a_folders_shards_come_from_one_listing(s3_server: Any, proxy: Any, tmp_path: Path) -> None:
    # The cache's lookups of a restore's planned shards (sizes and ETags of the rest of the epoch and
    # the next): one listing of their folder, not a HEAD each competing with the first batch.
    _, index, _ = write(s3_server, tmp_path)
    urls = ShardIndex.load(index, storage_options=s3_server.options()).locations
    assert len(urls) == 10
    remote = Remote(s3_server.options(proxy.endpoint))
    proxy.reset_counters()
    found = remote.identities(urls)
    assert dict(proxy.methods) == {"GET": 1}, f"not one listing: {proxy.log}"
    assert found == {url: remote.identity(url) for url in urls}
    with pytest.raises(FileNotFoundError):
        remote.identities([*urls, urls[0].rsplit("/", 1)[0] + "/gone.bin"])


def test_a_shard_a_window_entered_and_changed_since_is_refused_by_name(s3_server: Any, tmp_path: Path) -> None:
    # The identities a window's opening takes alongside its first reads end up in the state: a shard
    # rewritten after the checkpoint is refused at the restore, naming it.
    bucket, index, _ = write(s3_server, tmp_path)
    options = s3_server.options()
    first = pipeline(index, options)
    reading = iter(first)
    for _ in range(SHUFFLE + 1):  # the second window open, one record of it read
        next(reading)
    state = json_roundtrip(first.state_dict())
    assert 3 in {int(k) for k in state["source"]["identities"]}  # a shard the second window entered
    url = f"s3://{bucket}/tokens/shard-00003.bin"
    original = s3_server.fs(url).cat_file(url.removeprefix("s3://"))
    s3_server.put(url, bytes(reversed(original)))
    restored = pipeline(index, options)
    restored.load_state_dict(state)
    with pytest.raises(ResumeError, match=r"shard-00003\.bin.*changed since the checkpoint"):
        list(restored)
