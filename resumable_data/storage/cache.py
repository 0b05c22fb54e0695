"""A node-local cache of remote shards: one download per shard per machine, bounded in size, evicting
the shard whose next use is furthest away.

Every (rank, worker) slot knows the shards it will read next, in order and across the epoch boundary,
because the order is keyed. So the cache is told that schedule (:meth:`ShardCache.plan`), downloads
exactly what comes next in the background (``prefetch=``), and when it must make room evicts by
Belady's rule (the cached shard needed furthest in the future) instead of guessing by recency.

Sharing. Every slot on a machine (all workers of all ranks) builds its own ``ShardCache`` on the same
``cache_dir``; the instances share through the directory and ``fcntl.flock`` locks only, so they may
live in any processes (a ``ShardCache`` pickles to its settings, and a forked copy starts its own
plan). The directory holds::

    shards/<url key>.<identity key>     complete shards, named by URL and identity (sha-256 prefixes)
    partial/<url key>.<identity key>.<size>.<nonce>   downloads in progress; the name reserves the size
    locks/<url key>                     per-URL download lock: one download per shard per machine
    plans/<nonce>.lock, <nonce>.plan    each live slot's schedule (the lock is held while it lives)
    .lock                               the accounting lock: eviction, reservations, renames, plans
    peak                                the most bytes the shards and downloads took at once

Crash safety. A download writes to ``partial/`` and is renamed into ``shards/`` only after its size
and identity were checked and it was fsynced, so a process killed mid-download leaves a partial file
that nothing reads (and a cached file of the wrong size, what a machine that went down could leave, is
fetched again); partial files whose download lock is free (their writer died) are deleted by the next scan. A reader
holds a shared lock on the shard file it uses (:class:`CachedShard`) and an eviction takes an
exclusive lock without waiting, so a shard in use in any process is never evicted.

Identity. A cached shard is the object whose identity (for example ``"size:etag"``) the caller names;
the identity is part of the file name. A cached file of another identity for the same URL (the object
was rewritten, or an old job cached it) is not used: the shard is downloaded again, and the download
is checked to have the identity expected, or :class:`~resumable_data.errors.ResumeError` names the
shard and both identities. So the checkpoint's shard identity check works through the cache.

Bound. Before a download the cache evicts until the shards plus the downloads in flight fit in
``cache_limit`` bytes: first shards that no live slot plans to read (least recently used first), then
the one whose soonest planned use is furthest away. A prefetch only evicts shards needed later than
the one it fetches, and is skipped when that does not make room; a read (:meth:`ShardCache.use`)
downloads even when the shards in use leave no room, so the limit is exceeded only by the shards in
use, at most one per slot reading them one at a time. All processes on a cache dir should pass the
same ``cache_limit``. The bytes only grow at a reservation, which every process makes under the
accounting lock, so the high-water mark taken there (:meth:`ShardCache.peak_bytes`) is exact.

Integration: a reader plans, then uses each shard (see the :class:`ShardCache` example);
``download(url, dest_path)`` writes the object to ``dest_path`` and returns the identity it read (from
the same response, so it names the bytes written). One slot calls :meth:`ShardCache.plan` and
:meth:`ShardCache.use` (a plan may come from another thread: the two take turns on the schedule); the
background downloads run in the cache's own threads.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

from ..core.state import check_int_arg
from ..errors import ResumeError
from .files import redact
from .locks import flocked, held, open_shared, release, remove, try_exclusive, unlock

__all__ = ["CacheCounters", "CachedShard", "RemoteShard", "ShardCache"]

Policy = Literal["next-use", "lru"]
POLICIES: tuple[Policy, ...] = ("next-use", "lru")
_CURSOR_WIDTH = 20  # a plan file starts with its cursor, written in place as fixed-width digits
_PEAK = "peak"  # the high-water mark of the cache's bytes, written under the accounting lock


@dataclass(frozen=True)
class RemoteShard:
    """One remote object as a reader expects it.

    Args:
        url: where it is (any URL the ``download`` function takes).
        size: its size in bytes; known before downloading so that room is made first.
        identity: what the object must be (e.g. ``"size:etag"``); a download of anything else is refused.
    """

    url: str
    size: int
    identity: str

    def __repr__(self) -> str:
        # the dataclass's repr but for the URL's credentials (see files.redact)
        return f"RemoteShard(url={redact(self.url)!r}, size={self.size!r}, identity={self.identity!r})"

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not isinstance(self.identity, str):
            raise ValueError(
                f"RemoteShard url and identity should be str, but got {redact(self.url)!r}, {self.identity!r}"
            )
        check_int_arg("RemoteShard size", self.size, minimum=0)


@dataclass
class CacheCounters:
    """What one ``ShardCache`` did (in its process): for tests and benchmarks."""

    hits: int = 0  # uses served by a shard already cached (by anyone, or prefetched)
    downloads: int = 0
    bytes: int = 0  # bytes downloaded
    evictions: int = 0
    peak_bytes: int = 0  # the most the cache (every process's shards and downloads) held at this one's reservations


class CachedShard:
    """A cached shard in use: its local ``path``, held against eviction until :meth:`close` (as a
    context manager: gives the path, closes on exit)."""

    def __init__(self, shard: RemoteShard, path: str, file: BinaryIO) -> None:
        self.shard = shard
        self.path = path
        self._file = file  # holds a shared flock on the shard file while open

    def close(self) -> None:
        """Release the shard: it may be evicted from now on."""
        release(self._file)

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Entry:
    path: str
    url_key: str
    size: int
    used_ns: int  # the last use (the file's mtime, set at each use)


@functools.lru_cache(maxsize=4096)  # a shuffle reading by key reopens its few shards often
def _key(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


class ShardCache:
    """A node-local cache of remote shards, shared by every process on the machine through ``cache_dir``.

    Args:
        cache_dir: local directory (created if absent); every slot on the machine passes the same one.
        cache_limit: bytes the cached and downloading shards may take, or None for no bound.
        download: ``download(url, dest_path) -> identity`` writes the object to ``dest_path`` and
            returns its identity as read with it.
        prefetch: how many of the next planned shards to keep downloading in the background.
        workers: at most this many background downloads at once (per ``ShardCache``).
        policy: ``"next-use"`` evicts by the plans (Belady); ``"lru"`` by recency only, for comparison.

    Raises:
        ValueError: an argument out of range, named.

    Example::

        cache = ShardCache(cache_dir, 2 * 2**30, download=download, prefetch=2)
        cache.plan(upcoming)  # this slot's next shards, in order, into the next epoch
        for shard in upcoming:
            with cache.use(shard) as path:
                read(path)
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        cache_limit: int | None,
        *,
        download: Callable[[str, str], str],
        prefetch: int = 0,
        workers: int = 2,
        policy: Policy = "next-use",
    ) -> None:
        if cache_limit is not None:
            check_int_arg("cache_limit", cache_limit, minimum=1)
        check_int_arg("prefetch", prefetch, minimum=0)
        check_int_arg("workers", workers, minimum=1)
        if policy not in POLICIES:
            raise ValueError(f"policy should be one of {POLICIES}, but got policy={policy!r}")
        if not callable(download):
            raise ValueError(f"download should be a callable (url, dest_path) -> identity, but got {download!r}")
        self.cache_dir, self.cache_limit, self.policy = os.fspath(cache_dir), cache_limit, policy
        self.prefetch, self._workers, self._download_fn = prefetch, workers, download
        self._settings: dict[str, Any] = {"cache_dir": self.cache_dir, "cache_limit": cache_limit}
        self._settings.update(download=download, prefetch=prefetch, workers=workers, policy=policy)  # for pickling
        for sub in ("shards", "partial", "locks", "plans"):
            os.makedirs(os.path.join(self.cache_dir, sub), exist_ok=True)
        self._start_process()
        with self._accounting():
            self._scan(own_key=None)  # cleans what crashed downloads left

    # -- per process ------------------------------------------------------------------------------
    def _start_process(self) -> None:
        """This process's own plan, pool and counters (a forked copy must not share its parent's)."""
        self._pid = os.getpid()
        self.counters = CacheCounters()
        self._mutex, self._planning = threading.Lock(), threading.Lock()  # counters; schedule (plan vs use)
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[RemoteShard, Future[None]] = {}
        self._keys: list[str] = []
        self._shards: list[RemoteShard] = []
        self._cursor = 0
        self._reading = 0  # shards from the cursor that the slot reads now (prefetch counts past them)
        stem = os.path.join(self.cache_dir, "plans", uuid.uuid4().hex)
        self._plan_path, self._plan_lock = stem + ".plan", stem + ".lock"
        # Registered under the accounting lock, so that no scan takes the new lock file for a dead one.
        with self._accounting():
            self._plan_fd: int | None = os.open(self._plan_lock, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._plan_fd, fcntl.LOCK_EX)

    def _this_process(self) -> None:
        if self._pid != os.getpid():
            if self._plan_fd is not None:
                os.close(self._plan_fd)  # the parent's lock stays held by the parent's copy
            self._start_process()

    def __getstate__(self) -> dict[str, Any]:
        return dict(self._settings)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def close(self) -> None:
        """Stop background downloads (waiting for those running) and withdraw this slot's plan."""
        if self._pid != os.getpid() or self._plan_fd is None:
            return
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        with self._accounting():
            remove(self._plan_path)
            remove(self._plan_lock)
            unlock(self._plan_fd, self._pid)
            self._plan_fd = None
        self._keys, self._shards = [], []

    @staticmethod
    def peak_bytes(cache_dir: str | os.PathLike[str]) -> int:
        """The most bytes the cache on ``cache_dir`` held at once (shards and downloads, over every
        process that used it; 0 for a new one): at most ``cache_limit`` plus one shard per slot."""
        path = Path(cache_dir, _PEAK)  # never deleted once written
        return int(path.read_bytes() or 0) if path.exists() else 0

    def __enter__(self) -> ShardCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the public surface ---------------------------------------------------------------------------
    def plan(self, upcoming: Sequence[RemoteShard], *, reading: int = 0) -> None:
        """Set this slot's schedule: the shards it reads next, in order (may run into the next epoch).

        Each :meth:`use` of the next planned shard moves the schedule on. Eviction on the whole
        machine keeps the shards some live slot needs soonest; prefetching follows this schedule:
        the ``prefetch`` shards after the first ``reading``, which the slot reads now (a shuffle
        reading by key from several; they download too if they are not cached), until a use.
        """
        check_int_arg("reading", reading, minimum=0)
        self._this_process()
        shards = list(upcoming)
        for shard in shards:
            if not isinstance(shard, RemoteShard):
                raise ValueError(f"plan() takes RemoteShard values, but got {shard!r}")
        with self._planning:  # a reader may plan from another thread than the one in use()
            self._shards, self._keys, self._cursor = shards, [_key(shard.url, 32) for shard in shards], 0
            self._reading = reading
            header = f"{0:0{_CURSOR_WIDTH}d}\n".encode()
            with self._accounting(), open(self._plan_path, "wb") as out:
                out.write(header + "\n".join(self._keys).encode())
            self._top_up()

    def use(self, shard: RemoteShard) -> CachedShard:
        """The local copy of ``shard``, downloaded first if no process on the machine has it.

        Returns:
            A :class:`CachedShard` that keeps the shard from eviction until closed.

        Raises:
            ResumeError: the download is not the object ``shard.identity`` names.
            OSError: the download failed (also a background prefetch of this shard) or wrote a wrong size.
        """
        self._this_process()
        if not isinstance(shard, RemoteShard):
            raise ValueError(f"use() takes a RemoteShard, but got {shard!r}")
        future = self._futures.pop(shard, None)
        if future is not None:
            future.result()  # a prefetch's error surfaces here, at the read that needed it
        handle = self._open_cached(shard)
        if handle is not None:
            self._count(hits=1)
        while handle is None:  # again only if the fresh copy was deleted from outside the cache
            handle = self._download(shard, horizon=None)
        with self._planning:
            self._advance(_key(shard.url, 32))
            self._top_up()
        return handle

    def cached(self, shard: RemoteShard, *, join: bool = False) -> CachedShard | None:
        """The local copy of ``shard`` if some process on the machine has it now (held, as from
        :meth:`use`), else None, and the schedule does not move. With ``join``, a download of it
        that this process runs in the background is waited for first (its bytes are on their way:
        a read that would fetch much of them by ranged requests takes them twice).

        What a read that should not wait calls (a restore's first records, a shuffle's records read
        by key, by ranged requests meanwhile). A planned shard found missing downloads in the
        background (with ``prefetch`` > 0), with room as for a prefetch of its place in the plan:
        a window reading by key from more shards than ``prefetch`` covers gets them all cached.
        """
        self._this_process()
        if not isinstance(shard, RemoteShard):
            raise ValueError(f"cached() takes a RemoteShard, but got {shard!r}")
        future = self._futures.get(shard)
        if join and future is not None and not future.done():
            wait([future])  # an error stays for use() to raise
        handle = self._open_cached(shard)
        if handle is not None:
            self._count(hits=1)
        elif self.prefetch:
            with self._planning:
                try:
                    step = self._shards.index(shard, self._cursor) - self._cursor
                except ValueError:  # not planned: nothing says it is read again
                    return None
                self._fetch(shard, step)
        return handle

    def has(self, shard: RemoteShard) -> bool:
        """Whether some process on the machine has the local copy of ``shard`` now: one ``stat``, no
        lock taken and nothing moved. A hint for choosing how to read (the copy may be evicted before
        it is opened: :meth:`cached` and :meth:`use` say for sure)."""
        try:
            return os.stat(self._entry_path(shard)).st_size == shard.size
        except FileNotFoundError:
            return False

    # -- reading and downloading ----------------------------------------------------------------------
    def _entry_path(self, shard: RemoteShard) -> str:
        return os.path.join(self.cache_dir, "shards", f"{_key(shard.url, 32)}.{_key(shard.identity, 16)}")

    def _open_cached(self, shard: RemoteShard) -> CachedShard | None:
        """The cached shard under a shared lock, or None when absent (or evicted while we opened it, or
        cut short by a machine that went down before writing it back)."""
        path = self._entry_path(shard)
        try:
            file = open_shared(path)  # waits only while an eviction holds it; the CachedShard closes it
        except FileNotFoundError:
            return None
        stat = os.fstat(file.fileno())
        if stat.st_nlink == 0 or stat.st_size != shard.size:  # evicted between the open and the lock
            file.close()
            return None
        now = time.time_ns()
        os.utime(file.fileno(), ns=(now, now))  # the recency the LRU part of eviction reads
        return CachedShard(shard, path, file)

    def _download(self, shard: RemoteShard, horizon: int | None) -> CachedShard | None:
        """Download ``shard`` unless some process has it, and give it held. A prefetch (``horizon``: how
        many steps ahead the shard is planned) gives None when there is no room for it."""
        url_key = _key(shard.url, 32)
        with flocked(os.path.join(self.cache_dir, "locks", url_key), fcntl.LOCK_EX):
            handle = self._open_cached(shard)  # whoever held the lock before us may have downloaded it
            if handle is not None:
                self._count(hits=int(horizon is None))
                return handle
            with self._accounting():
                used = self._make_room(self._scan(own_key=url_key), shard.size, horizon)
                if horizon is not None and self.cache_limit is not None and used + shard.size > self.cache_limit:
                    return None  # only room by evicting what is needed sooner: read it on demand
                name = f"{url_key}.{_key(shard.identity, 16)}.{shard.size}.{uuid.uuid4().hex}"
                partial = os.path.join(self.cache_dir, "partial", name)
                open(partial, "xb").close()  # its name reserves shard.size bytes from here on
                self._note_peak(used + shard.size)
            try:
                identity = self._download_fn(shard.url, partial)
                self._verify(shard, partial, identity)
            except BaseException:
                remove(partial)
                raise
            self._count(downloads=1, bytes=shard.size)
            with self._accounting():
                os.replace(partial, self._entry_path(shard))
                # Held before the accounting lock is released, so that no eviction comes between.
                return self._open_cached(shard)

    def _verify(self, shard: RemoteShard, partial: str, identity: object) -> None:
        if not isinstance(identity, str):
            raise TypeError(f"download() should return the object's identity as a str, but got {identity!r}")
        if identity != shard.identity:
            raise ResumeError(
                f"shard {redact(shard.url)!r} is not the object expected: expected identity {shard.identity!r}, "
                f"the download has {identity!r}: it was rewritten since it was listed or checkpointed; to "
                f"read it as it is now, list it again and pass its current identity"
            )
        with open(partial, "rb") as written:
            size = os.fstat(written.fileno()).st_size
            if size != shard.size:
                raise OSError(f"download of {redact(shard.url)!r} wrote {size} bytes, but the object has {shard.size}")
            os.fsync(written.fileno())  # on disk before its name says complete: a preempted VM keeps its disk

    # -- accounting and eviction (under the accounting lock) ----------------------------------------
    def _accounting(self) -> contextlib.AbstractContextManager[int]:
        return flocked(os.path.join(self.cache_dir, ".lock"), fcntl.LOCK_EX)

    def _scan(self, own_key: str | None) -> list[_Entry]:
        """The cached shards, with the downloads in flight as entries that cannot be evicted; deletes
        partial files whose writer died, and other versions of ``own_key`` (being downloaded) not in use."""
        entries = []
        partial_dir = os.path.join(self.cache_dir, "partial")
        for item in os.scandir(partial_dir):
            url_key, _, size, _ = item.name.split(".")
            # We hold own_key's download lock: its partial files are a dead writer's.
            if url_key == own_key or not held(os.path.join(self.cache_dir, "locks", url_key)):
                remove(item.path)
            else:
                entries.append(_Entry(item.path, url_key, int(size), -1))
        for item in os.scandir(os.path.join(self.cache_dir, "shards")):
            url_key = item.name.split(".")[0]
            if url_key == own_key and self._evict(item.path):
                self._count(evictions=1)
                continue
            with contextlib.suppress(FileNotFoundError):
                stat = item.stat()
                entries.append(_Entry(item.path, url_key, stat.st_size, stat.st_mtime_ns))
        return entries

    def _make_room(self, entries: list[_Entry], size: int, horizon: int | None) -> int:
        """Evict until ``size`` more bytes fit; a prefetch (``horizon`` given) only evicts shards
        planned after ``horizon`` steps. The bytes the cache holds then (fitting or not)."""
        used = sum(entry.size for entry in entries)
        if self.cache_limit is None:
            return used
        for entry in self._eviction_order(entries, horizon):
            if used + size <= self.cache_limit:
                break
            if self._evict(entry.path):
                used -= entry.size
                self._count(evictions=1)
        return used

    def _note_peak(self, total: int) -> None:
        """Raise the high-water marks (this process's counter, the directory's ``peak`` file) to ``total``."""
        self._count(peak_bytes=max(0, total - self.counters.peak_bytes))  # serial: under the accounting lock
        if total > self.peak_bytes(self.cache_dir):
            with open(os.path.join(self.cache_dir, _PEAK), "wb") as peak:
                peak.write(str(total).encode())

    def _eviction_order(self, entries: list[_Entry], horizon: int | None) -> list[_Entry]:
        cached = [entry for entry in entries if entry.used_ns >= 0]
        if self.policy == "lru":
            return sorted(cached, key=lambda entry: (entry.used_ns, entry.path))
        soonest = self._next_uses()
        unplanned = sorted((e for e in cached if e.url_key not in soonest), key=lambda e: (e.used_ns, e.path))
        planned = [e for e in cached if e.url_key in soonest and (horizon is None or soonest[e.url_key] > horizon)]
        return unplanned + sorted(planned, key=lambda e: (-soonest[e.url_key], e.path))

    def _evict(self, path: str) -> bool:
        """Delete a cached shard unless some reader holds it; whether it was deleted."""
        with try_exclusive(path) as taken:
            if taken:
                os.unlink(path)  # under the exclusive lock: a reader that opened it sees it unlinked
            return bool(taken)

    def _next_uses(self) -> dict[str, int]:
        """URL key -> steps until its next planned use, the soonest over the live slots' plans; deletes
        the plans of dead slots."""
        soonest: dict[str, int] = {}
        plans = os.path.join(self.cache_dir, "plans")
        for item in os.scandir(plans):
            if not item.name.endswith(".lock"):
                continue
            stem = item.path[: -len(".lock")]
            if not held(item.path):
                remove(stem + ".plan")
                remove(item.path)
                continue
            try:
                with open(stem + ".plan", "rb") as plan:
                    header, _, body = plan.read().decode().partition("\n")
            except FileNotFoundError:  # a live slot that has not planned yet
                continue
            keys = body.split("\n") if body else []
            cursor = int(header)
            for step, url_key in enumerate(keys[cursor:]):
                if step < soonest.get(url_key, step + 1):
                    soonest[url_key] = step
        return soonest

    def _advance(self, url_key: str) -> None:
        """Move this slot's plan past the next planned use of ``url_key`` (none: the plan stays)."""
        try:
            at = self._keys.index(url_key, self._cursor)
        except ValueError:
            return
        self._cursor, self._reading = at + 1, 0
        with self._accounting():
            fd = os.open(self._plan_path, os.O_WRONLY)
            try:
                os.pwrite(fd, f"{self._cursor:0{_CURSOR_WIDTH}d}".encode(), 0)
            finally:
                os.close(fd)

    # -- prefetching ----------------------------------------------------------------------------------
    def _top_up(self) -> None:
        """Keep the planned shards read now and the ``prefetch`` after them downloading (or cached),
        nearest first."""
        if self.prefetch == 0:
            return
        for step, shard in enumerate(self._shards[self._cursor : self._cursor + self._reading + self.prefetch]):
            if not self._fetch(shard, step):
                return

    def _fetch(self, shard: RemoteShard, step: int) -> bool:
        """Download ``shard`` (``step`` shards ahead in the plan) in the background unless it is cached
        or downloading; False when the interpreter is exiting (no new work is taken then)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="shard-cache")
        future = self._futures.get(shard)
        running_or_failed = future is not None and (not future.done() or future.exception() is not None)
        if running_or_failed or os.path.exists(self._entry_path(shard)):
            return True  # a failure stays for use() to raise
        try:
            self._futures[shard] = self._pool.submit(self._prefetch, shard, step)
        except RuntimeError:  # the interpreter is exiting (a late lookup's re-plan)
            return False
        return True

    def _prefetch(self, shard: RemoteShard, horizon: int) -> None:
        handle = self._download(shard, horizon)
        if handle is not None:
            handle.close()

    def _count(self, **increments: int) -> None:
        with self._mutex:
            for name, value in increments.items():
                setattr(self.counters, name, getattr(self.counters, name) + value)
