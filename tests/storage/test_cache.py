"""The node-local shard cache: one download per shard per machine, crash-safe, bounded, plan-driven.

The "remote" is a local folder and each download a real copy (tests/storage/remote_folder.py); the
processes that share a cache are real processes (tests/storage/cache_child.py), each with a timeout.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from remote_folder import FolderRemote, disk_usage, make_remote

from resumable_data.core import Permutation
from resumable_data.errors import ResumeError
from resumable_data.storage.cache import RemoteShard, ShardCache
from resumable_data.storage.locks import flocked, held, try_exclusive

CHILD = Path(__file__).with_name("cache_child.py")
TIMEOUT = 120  # seconds a cache process may take (they take about one on an idle machine)


def _start(config: dict) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), json.dumps(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(process: subprocess.Popen[str]) -> dict:
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"a cache process did not finish in {TIMEOUT} s:\n{err[-3000:]}") from None
    assert process.returncode == 0, err[-3000:]
    return json.loads(out)


def _wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        assert time.monotonic() < deadline, f"{what} did not happen in {TIMEOUT} s"
        time.sleep(0.01)


def _run_together(tmp_path: Path, configs: list[dict]) -> list[dict]:
    """Run cache processes that start reading at the same moment (after their imports)."""
    go = tmp_path / "go"
    processes = []
    for i, config in enumerate(configs):
        processes.append(_start({**config, "ready": str(tmp_path / f"ready{i}"), "go": str(go)}))
    for i in range(len(configs)):
        _wait_for(tmp_path / f"ready{i}", f"cache process {i} starting")
    go.touch()
    return [_finish(process) for process in processes]


def _files(cache_dir: Path, sub: str) -> list[Path]:
    return sorted((cache_dir / sub).iterdir())


def test_two_processes_sharing_a_cache_download_each_shard_once(tmp_path: Path) -> None:
    names = make_remote(tmp_path / "remote", 8, 4096)
    log = tmp_path / "downloads.log"
    config = {"root": str(tmp_path / "remote"), "log": str(log), "cache_dir": str(tmp_path / "cache")}
    # Both read the same shards in the same order, downloads overlap, both prefetch: every shard is
    # raced for, and each process checks every copy it reads against the remote.
    counters = _run_together(tmp_path, [{**config, "names": names, "delay": 0.05, "prefetch": 2}] * 2)
    assert Counter(FolderRemote(tmp_path, log).downloads()) == {f"folder://{name}": 1 for name in names}
    assert sum(c["downloads"] for c in counters) == len(names)
    assert sum(c["bytes"] for c in counters) == 8 * 4096


def test_a_sigkill_mid_download_leaves_no_used_partial_file(tmp_path: Path) -> None:
    names = make_remote(tmp_path / "remote", 2, 8192)
    log, marker, cache_dir = tmp_path / "downloads.log", tmp_path / "half-written", tmp_path / "cache"
    process = _start(
        {
            "root": str(tmp_path / "remote"),
            "log": str(log),
            "cache_dir": str(cache_dir),
            "names": names,
            "hang": names[0],
            "marker": str(marker),
        }
    )
    try:
        _wait_for(marker, "the half-written download")
        [partial] = _files(cache_dir, "partial")
        assert partial.stat().st_size == 4096 and not _files(cache_dir, "shards")
    finally:
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=TIMEOUT)
    assert process.returncode == -signal.SIGKILL

    remote = FolderRemote(tmp_path / "remote", log)
    cache = ShardCache(cache_dir, None, download=remote)  # a new job on the same cache
    assert not _files(cache_dir, "partial"), "a dead download's partial file was left behind"
    with cache.use(remote.shard(names[0])) as path:
        assert Path(path).read_bytes() == (tmp_path / "remote" / names[0]).read_bytes()
    assert remote.downloads() == [f"folder://{names[0]}"] * 2
    assert cache.counters.downloads == 1


def test_the_limit_holds_with_two_processes_over_three_epochs(tmp_path: Path) -> None:
    size, count, limit = 4096, 24, 5 * 4096
    names = make_remote(tmp_path / "remote", count, size)
    usage_log = tmp_path / "usage.log"
    config = {
        "root": str(tmp_path / "remote"),
        "log": str(tmp_path / "downloads.log"),
        "cache_dir": str(tmp_path / "cache"),
        "limit": limit,
        "prefetch": 2,
        "usage_log": str(usage_log),
    }

    def slot_order(seed: int) -> list[str]:  # each slot its own keyed order, three epochs of it
        return [names[i] for epoch in range(3) for i in Permutation(count, seed, epoch)(np.arange(count))]

    _run_together(tmp_path, [{**config, "names": slot_order(seed)} for seed in (1, 2)])
    usages = [int(line) for line in usage_log.read_text().split()]
    # Measured by each download when its copy is complete (the moments the cache peaks). Each slot
    # holds one shard in use and at most one more prefetch in flight besides the one it waits for, so
    # with room for five nothing forces a read past the limit.
    assert len(usages) >= count and max(usages) <= limit, (max(usages), limit)
    assert disk_usage(tmp_path / "cache") <= limit
    assert max(usages) <= ShardCache.peak_bytes(tmp_path / "cache") <= limit


def test_a_read_exceeds_the_limit_only_by_the_shards_in_use(tmp_path: Path) -> None:
    names = make_remote(tmp_path / "remote", 4, 4096)
    remote = FolderRemote(tmp_path / "remote", tmp_path / "downloads.log")
    shards = [remote.shard(name) for name in names]
    cache = ShardCache(tmp_path / "cache", 2 * 4096, download=remote)
    cache.plan(shards)
    first, second = cache.use(shards[0]), cache.use(shards[1])
    with cache.use(shards[2]) as path:  # both others are in use: this one goes over, it cannot wait
        assert Path(path).exists() and Path(first.path).exists() and Path(second.path).exists()
        assert disk_usage(tmp_path / "cache") == 3 * 4096
    first.close()
    second.close()
    with cache.use(shards[3]):
        assert disk_usage(tmp_path / "cache") <= 2 * 4096
    assert cache.counters.evictions == 2
    # The high-water mark, taken at each reservation under the accounting lock: the three in use.
    assert cache.counters.peak_bytes == ShardCache.peak_bytes(tmp_path / "cache") == 3 * 4096


def test_a_shard_evicted_while_a_reader_opens_it_is_downloaded_again(tmp_path: Path) -> None:
    names = make_remote(tmp_path / "remote", 1, 4096)
    remote = FolderRemote(tmp_path / "remote", tmp_path / "downloads.log")
    shard = remote.shard(names[0])
    cache = ShardCache(tmp_path / "cache", None, download=remote)
    with cache.use(shard) as path:
        pass
    evictor = os.open(path, os.O_RDONLY)  # this test plays an eviction in another process
    fcntl.flock(evictor, fcntl.LOCK_EX)
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(cache.use, shard)
        # Once the reader has the file open, it waits for our lock.
        deadline = time.monotonic() + TIMEOUT
        while sum(os.path.realpath(f"/proc/self/fd/{fd}") == path for fd in os.listdir("/proc/self/fd")) < 2:
            assert time.monotonic() < deadline and not reading.done(), "the reader never opened the shard"
            time.sleep(0.001)
        os.unlink(path)
        os.close(evictor)
        with reading.result(timeout=TIMEOUT) as again:
            assert Path(again).read_bytes() == (tmp_path / "remote" / names[0]).read_bytes()
    assert cache.counters.downloads == 2


def _downloaded_bytes(tmp_path: Path, policy: str, prefetch: int, plan: list[RemoteShard], remote: FolderRemote) -> int:
    cache = ShardCache(
        tmp_path / f"cache-{policy}-{prefetch}", 16 * 4096, download=remote, prefetch=prefetch, policy=policy
    )  # type: ignore[arg-type]
    cache.plan(plan)
    for shard in plan:
        with cache.use(shard):
            pass
    cache.close()
    return cache.counters.bytes


@pytest.mark.parametrize("prefetch", [0, 2])
def test_next_use_eviction_downloads_the_minimum_and_less_than_lru(tmp_path: Path, prefetch: int) -> None:
    count, size = 32, 4096
    names = make_remote(tmp_path / "remote", count, size)
    remote = FolderRemote(tmp_path / "remote", tmp_path / "downloads.log")
    plan = [remote.shard(names[i]) for epoch in range(3) for i in Permutation(count, 7, epoch)(np.arange(count))]
    planned = _downloaded_bytes(tmp_path, "next-use", prefetch, plan, remote)
    lru = _downloaded_bytes(tmp_path, "lru", prefetch, plan, remote)
    # No cache of half the data does better: every epoch reads all shards and starts with half at
    # most, so it downloads the other half at least, after the first epoch's whole.
    assert planned == (count + 2 * (count - 16)) * size
    assert lru > planned
    print(f"\nbytes over 3 epochs, limit half the data: next-use {planned}, lru {lru}, ratio {planned / lru:.3f}")


def test_a_changed_object_is_refused_and_a_rewritten_one_downloaded_again(tmp_path: Path) -> None:
    names = make_remote(tmp_path / "remote", 2, 4096)
    remote = FolderRemote(tmp_path / "remote", tmp_path / "downloads.log")
    cache = ShardCache(tmp_path / "cache", None, download=remote)
    listed = remote.shard(names[0])
    (tmp_path / "remote" / names[0]).write_bytes(b"rewritten" * 100)
    with pytest.raises(ResumeError, match=f"shard 'folder://{names[0]}' is not the object expected"):
        cache.use(listed)  # the server no longer has what the checkpoint names
    assert not _files(tmp_path / "cache", "shards") and not _files(tmp_path / "cache", "partial")

    old = remote.shard(names[1])
    cache.use(old).close()
    (tmp_path / "remote" / names[1]).write_bytes(b"new" * 100)
    new = remote.shard(names[1])
    with cache.use(new) as path:  # listed again: the cached old version is replaced
        assert Path(path).read_bytes() == b"new" * 100
    assert len(_files(tmp_path / "cache", "shards")) == 1

    wrong_size = RemoteShard(new.url, new.size + 1, new.identity)
    (tmp_path / "remote" / names[1]).write_bytes(b"new" * 100)
    os.remove(_files(tmp_path / "cache", "shards")[0])
    with pytest.raises(OSError, match=f"download of '{new.url}' wrote 300 bytes, but the object has 301"):
        cache.use(wrong_size)


def test_a_prefetch_error_surfaces_at_the_read_of_that_shard(tmp_path: Path) -> None:
    names = make_remote(tmp_path / "remote", 3, 4096)
    remote = FolderRemote(tmp_path / "remote", tmp_path / "downloads.log", fail={names[1]})
    shards = [remote.shard(name) for name in names]
    cache = ShardCache(tmp_path / "cache", None, download=remote, prefetch=2)
    cache.plan(shards + shards)  # prefetches shards 0 and 1 (fails) in the background
    cache.use(shards[0]).close()  # and now shard 2
    with pytest.raises(OSError, match=f"injected failure reading folder://{names[1]}"):
        cache.use(shards[1])  # the prefetch's error, though downloading it now would work
    cache.use(shards[1]).close()  # read again: downloaded now
    cache.use(shards[2]).close()
    assert (cache.counters.hits, cache.counters.downloads) == (2, 3)  # 0 and 2 were prefetched
    cache.close()


def test_a_plan_read_by_key_from_its_first_shards_prefetches_the_shards_after_them(tmp_path: Path) -> None:
    # A shuffle window reads by key from the two shards it spans: "the next prefetch shards" are the
    # ones after those (before, the window's own two used up prefetch=2 and the next shard was read
    # by ranged requests until its first records made it download).
    names = make_remote(tmp_path / "remote", 6, 4096)
    remote = FolderRemote(tmp_path / "remote", tmp_path / "downloads.log")
    shards = [remote.shard(name) for name in names]
    with ShardCache(tmp_path / "cache", None, download=remote, prefetch=2) as cache:
        cache.plan(shards, reading=2)
        deadline = time.monotonic() + TIMEOUT
        while len(remote.downloads()) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # a fifth download would have begun by now
        assert sorted(remote.downloads()) == sorted(shard.url for shard in shards[:4])
        for shard in shards[:2]:  # the shards read now: cached, and no use() moved the plan
            handle = cache.cached(shard)
            assert handle is not None
            handle.close()
        cache.use(shards[2]).close()  # reading in order from here: prefetch counts past the shard used
        while len(remote.downloads()) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert sorted(remote.downloads()) == sorted(shard.url for shard in shards[:5])
    with pytest.raises(ValueError, match="reading should be"):
        ShardCache(tmp_path / "cache", None, download=remote).plan(shards, reading=-1)


def test_a_resumed_job_reads_the_cache_it_left_without_downloading(tmp_path: Path) -> None:
    names = make_remote(tmp_path / "remote", 4, 4096)
    remote = FolderRemote(tmp_path / "remote", tmp_path / "downloads.log")
    shards = [remote.shard(name) for name in names]
    with ShardCache(tmp_path / "cache", None, download=remote) as first_job:
        for shard in shards:
            first_job.use(shard).close()
    resumed = pickle.loads(pickle.dumps(ShardCache(tmp_path / "cache", None, download=remote)))
    for shard in shards:
        with resumed.use(shard) as path:
            assert Path(path).read_bytes() == (tmp_path / "remote" / shard.url[len("folder://") :]).read_bytes()
    assert (resumed.counters.hits, resumed.counters.downloads) == (4, 0)
    assert len(remote.downloads()) == 4


def test_a_cached_file_cut_short_is_downloaded_again(tmp_path: Path) -> None:
    # What a machine that went down before writing the file back could leave (the cache fsyncs a
    # download before naming it complete; this is the check behind that).
    names = make_remote(tmp_path / "remote", 1, 4096)
    remote = FolderRemote(tmp_path / "remote", tmp_path / "downloads.log")
    cache = ShardCache(tmp_path / "cache", None, download=remote)
    with cache.use(remote.shard(names[0])) as path:
        os.truncate(path, 100)
    with cache.use(remote.shard(names[0])) as path:
        assert Path(path).read_bytes() == (tmp_path / "remote" / names[0]).read_bytes()
    assert cache.counters.downloads == 2


def _use_in_fork(cache: ShardCache, shard: RemoteShard) -> None:
    cache.plan([shard])
    cache.use(shard).close()
    assert cache.counters.downloads == 0 and cache.counters.hits == 1


def test_a_forked_copy_reads_through_the_same_cache_with_its_own_plan(tmp_path: Path) -> None:
    names = make_remote(tmp_path / "remote", 1, 4096)
    remote = FolderRemote(tmp_path / "remote", tmp_path / "downloads.log")
    cache = ShardCache(tmp_path / "cache", None, download=remote)
    cache.plan([remote.shard(names[0])])
    cache.use(remote.shard(names[0])).close()
    process = multiprocessing.get_context("fork").Process(target=_use_in_fork, args=(cache, remote.shard(names[0])))
    process.start()
    process.join(TIMEOUT)
    assert process.exitcode == 0, "the forked reader failed or hung"
    assert len(list((tmp_path / "cache" / "plans").glob("*.lock"))) == 2  # the child's plan is stale now
    cache.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cache_limit": 0}, "cache_limit should be an integer >= 1, but got cache_limit=0"),
        ({"cache_limit": "1GB"}, "cache_limit should be an integer >= 1, but got cache_limit='1GB'"),
        ({"prefetch": -1}, "prefetch should be an integer >= 0, but got prefetch=-1"),
        ({"workers": 0}, "workers should be an integer >= 1, but got workers=0"),
        ({"policy": "fifo"}, "policy should be one of"),
    ],
)
def test_bad_arguments_are_named_with_what_was_expected(tmp_path: Path, kwargs: dict, message: str) -> None:
    arguments = {"cache_limit": None, **kwargs}
    with pytest.raises(ValueError, match=message):
        ShardCache(tmp_path, arguments.pop("cache_limit"), download=lambda url, dest: "", **arguments)


def test_a_bad_remote_shard_is_named() -> None:
    with pytest.raises(ValueError, match="RemoteShard size should be an integer >= 0, but got RemoteShard size=-1"):
        RemoteShard("s3://bucket/a.bin", -1, "1:etag")


def forked_child() -> Any:
    """A forked child process that lives 30 s, started and past the fork's hooks; kill it after."""
    fork = multiprocessing.get_context("fork")
    started = fork.Event()

    def live() -> None:
        started.set()
        time.sleep(30)

    child = fork.Process(target=live)
    child.start()
    assert started.wait(TIMEOUT)
    return child


def test_a_child_forked_while_a_thread_holds_a_cache_lock_does_not_keep_it(tmp_path: Path) -> None:
    # What a DataLoader does when it starts its workers while the cache downloads in the background:
    # the child's copy of the locked file must not keep the lock after the parent's thread lets go.
    path, taken, release = str(tmp_path / "lock"), threading.Event(), threading.Event()

    def hold() -> None:
        with flocked(path, fcntl.LOCK_EX):
            taken.set()
            release.wait(TIMEOUT)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(TIMEOUT)
    child = forked_child()
    try:
        release.set()
        holder.join(TIMEOUT)
        assert not held(path), "the forked child kept the parent's lock"
    finally:
        child.kill()
        child.join(TIMEOUT)


def test_a_shard_in_use_when_a_child_is_forked_is_released_by_the_parent_alone(tmp_path: Path) -> None:
    names = make_remote(tmp_path / "remote", 1, 4096)
    remote = FolderRemote(tmp_path / "remote", tmp_path / "downloads.log")
    cache = ShardCache(tmp_path / "cache", None, download=remote)
    handle = cache.use(remote.shard(names[0]))
    child = forked_child()
    try:
        with try_exclusive(handle.path) as taken:
            assert taken is False  # in use: not evictable
        handle.close()
        with try_exclusive(handle.path) as taken:
            assert taken is True, "the forked child still holds the shard the parent released"
    finally:
        child.kill()
        child.join(TIMEOUT)


def test_a_read_that_joins_a_download_in_flight_gets_the_copy_and_no_second_download(tmp_path: Path) -> None:
    # A window's read by key of a shard whose background download is running: without join it is read
    # by ranged requests meanwhile (None here); with join it waits for the bytes already on their way
    # (issue 48: small records read by key while their shard downloaded fetched most of it twice).
    [name] = make_remote(tmp_path / "remote", 1, 4096)
    remote = FolderRemote(tmp_path / "remote", tmp_path / "downloads.log")
    started, gate = threading.Event(), threading.Event()

    def held_download(url: str, dest: str) -> str:
        started.set()
        gate.wait(TIMEOUT)
        return remote(url, dest)

    shard = remote.shard(name)
    with ShardCache(tmp_path / "cache", None, download=held_download, prefetch=1) as cache:
        cache.plan([shard], reading=1)  # the shard read now: it downloads in the background
        assert started.wait(TIMEOUT)
        assert cache.cached(shard) is None  # in flight: not there yet
        threading.Timer(0.2, gate.set).start()
        handle = cache.cached(shard, join=True)
        assert handle is not None, "join returned before the download in flight was in"
        handle.close()
    assert remote.downloads() == [shard.url]
