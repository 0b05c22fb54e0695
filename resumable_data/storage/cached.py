"""What a reader with ``cache_dir=`` reads remote shards through: the node-local :class:`ShardCache`,
fed with the slot's schedule, and the shards' sizes and identities as the reader last saw them.

A reader asks :meth:`CachedRemote.local` for a shard's local copy. Reading a shard from its start
waits for the download (usually done already: the schedule's next shards are prefetched); any
other read (a restore's first records, records fetched by key) takes the copy only if it is there
and otherwise reads by ranged requests, as without a cache, while the shard downloads in the
background. So a restore fetches what its first batch needs first and never downloads the shards
its epoch read before the checkpoint.

Bound. A slot holds one shard against eviction at a time: the one it reads now. Moving to another
shard (in order, or by key) releases it first, and so does a download the read waits for. So a
download that finds no room (the cache full of shards other slots hold or download) adds at most
one shard per slot on top of ``cache_limit``: the cache holds at most ``cache_limit`` plus, per
slot, its largest shard. A shuffle that reads by key from a few shards in turn reopens the one it
moves to (an ``open``, a lock and a ``mmap``: microseconds) instead of keeping them all held.

:class:`RemoteReading` is what the ready-made readers share: ``storage_options`` for URLs, and the
three cache arguments with their checks.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..core.state import check_int_arg
from .cache import CachedShard, RemoteShard, ShardCache
from .files import Remote, in_listing, is_url

__all__ = ["CachedRemote", "RemoteReading"]

# A plan that no longer starts within this many shards of the held one releases it: the slot has
# moved past it (a shuffle reading by key from a few shards keeps the plan's head on the earliest).
_NEAR = 4
_LOOKUPS = 8  # concurrent requests for the sizes and identities of planned shards not seen yet
_LISTING = 64  # planned shards looked up together (one listing of their folder, see Remote.identities)


class CachedRemote:
    """A reader's remote shards through a node-local cache (see the module docstring).

    Args:
        remote: how the objects are read (its ``storage_options``).
        cache_dir: the cache directory; every process on the machine passes the same one.
        cache_limit: bytes the cache may take, or None for no bound.
        prefetch: shards of the schedule downloaded ahead, in the background.

    Pickles to its settings and the sizes it knows: each process opens the cache itself.
    """

    def __init__(
        self, remote: Remote, cache_dir: str | os.PathLike[str], cache_limit: int | None, prefetch: int
    ) -> None:
        self.remote = remote
        self.cache_dir = os.fspath(cache_dir)
        self.cache_limit = cache_limit  # checked by RemoteReading (and by the ShardCache it opens)
        self.prefetch = prefetch
        self._known: dict[str, RemoteShard] = {}  # url -> the object as last read (its "size:etag")
        self._cache: ShardCache | None = None
        # The shard read now, what load() made of it, and the process holding it (a forked copy does not).
        self._held: tuple[CachedShard, Any, int] | None = None
        self._partial = False  # whether the cache was given only the known head of the schedule
        self._schedule: list[str] = []  # the slot's shards from the one it reads now, as last planned
        self._reading = 0  # how many of them the slot reads now (see plan())
        self._lookups: tuple[ThreadPoolExecutor, list[Future[None]], int] | None = None  # and their process
        self._guarded: tuple[threading.RLock, int] | None = None  # see _guard()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": None, "_held": None, "_lookups": None, "_guarded": None}

    @property
    def cache(self) -> ShardCache:
        """This process's cache on ``cache_dir`` (opened on first use)."""
        if self._cache is None:
            self._cache = ShardCache(
                self.cache_dir, self.cache_limit, download=self.remote.download, prefetch=self.prefetch
            )
        return self._cache

    def identity(self, url: str) -> str:
        """The object's identity asked now (:meth:`Remote.identity`), noted for the cache."""
        return self._remember(url, self.remote.identity(url))

    def _remember(self, url: str, identity: str) -> str:
        """Note ``identity`` (``"size:tag"``) as the object at ``url`` last read."""
        self._known[url] = RemoteShard(url, int(identity.split(":", 1)[0]), identity)
        return identity

    def _look_up(self, urls: list[str]) -> None:
        """Note the sizes and identities of ``urls`` (a listing of their folder where it can answer)."""
        for url, identity in self.remote.identities(urls).items():
            self._remember(url, identity)

    def note(self, url: str, size: int, tag: str | None) -> None:
        """A size and ETag the reader read anyway (counting records): no request for them later."""
        if tag is not None:
            self._known[url] = RemoteShard(url, size, f"{size}:{tag}")

    def _shard(self, url: str) -> RemoteShard:
        if url not in self._known:
            self.identity(url)
        return self._known[url]

    def plan(self, upcoming: Sequence[Any], *, reading: int = 0) -> None:
        """The shards this slot reads next, in order (the rest of its epoch, then the next one), the
        first ``reading`` of them read now: the cache prefetches the ones after those and evicts by
        these next uses. Local paths are skipped.

        Sizes and identities of shards not seen yet are asked in the background, an object store's
        64 at a time (a listing of their folder), 8 such at once (a restore's first batch waits for
        none of them): until they are in, the cache is given the schedule's known head, and the
        whole schedule as soon as they are.
        """
        urls = [str(shard) for shard in upcoming if is_url(shard)]
        if not urls and self._cache is None:  # local shards only: no cache to open
            return
        with self._guard():
            self._schedule, self._reading = urls, reading
            unknown = list(dict.fromkeys(url for url in urls if url not in self._known))
            if unknown and not self._looking_up():
                if self._lookups is None or self._lookups[2] != os.getpid():  # none yet, or a forked copy's
                    pool = ThreadPoolExecutor(_LOOKUPS, thread_name_prefix="shard-lookup")
                    self._lookups = (pool, [], os.getpid())
                # An object store's shards 64 at a time (a listing of their folder answers for all of
                # them: see Remote.identities), any other URL on its own.
                listed = [url for url in unknown if in_listing(url)]
                groups = [listed[i : i + _LISTING] for i in range(0, len(listed), _LISTING)]
                groups += [[url] for url in unknown if not in_listing(url)]
                futures = [self._lookups[0].submit(self._look_up, group) for group in groups]
                self._lookups = (self._lookups[0], futures, os.getpid())
                for future in futures:
                    future.add_done_callback(self._looked_up)
            self._send_plan()
            if self._held is not None and self._held[0].shard.url not in urls[:_NEAR]:  # read: now evictable
                self.release()

    def _guard(self) -> threading.RLock:
        """This process's lock over the schedule and the cache's plan (a forked copy gets its own: the
        parent's may have been held by a lookup thread at the fork)."""
        if self._guarded is None or self._guarded[1] != os.getpid():
            self._guarded = (threading.RLock(), os.getpid())
        return self._guarded[0]

    def _looking_up(self) -> bool:
        """Whether this process's lookups of planned shards are still running (a failed one raises)."""
        if self._lookups is None or self._lookups[2] != os.getpid():
            return False
        if not all(future.done() for future in self._lookups[1]):
            return True
        for future in self._lookups[1]:
            future.result()  # a lookup's error (a shard deleted, no credentials) surfaces at a read
        return False

    def _looked_up(self, _: Future[None]) -> None:
        """When the last lookup is in: the cache gets the whole schedule (prefetch starts now)."""
        with self._guard():
            lookups = self._lookups[1] if self._lookups is not None else []
            if self._partial and all(f.done() and f.exception() is None for f in lookups):
                self._send_plan()

    def _send_plan(self) -> None:
        """Give the cache the schedule's head whose shards are known (all of it once they are)."""
        known = list(itertools.takewhile(self._known.__contains__, self._schedule))
        self.cache.plan([self._known[url] for url in known], reading=min(self._reading, len(known)))
        self._partial = len(known) < len(self._schedule)

    def local(self, url: str, load: Callable[[str], Any], *, wait: bool, join: bool = False) -> Any | None:
        """``load(local path)`` of the shard's cached copy, the shard held against eviction until the
        slot reads another one; with ``wait``, downloaded first if no process has it, else None when
        it is not cached yet (or its size and identity are not known yet: the read goes on by ranged
        requests rather than wait for them). The shard held before is released first (see the
        module docstring). With ``join``, a background download of the shard in this process is
        waited for (see :meth:`ShardCache.cached`)."""
        if not wait and url not in self._known:
            return None
        shard = self._shard(url)
        held = self._held
        if self._holds(held, shard):
            return held[1]  # type: ignore[index]
        with self._guard():
            self.release()
            if url in self._schedule[:_NEAR]:  # the schedule from the shard read now, for a late re-plan
                at = self._schedule.index(url)
                self._schedule, self._reading = self._schedule[at:], max(0, self._reading - at)
            if self._partial and not self._looking_up():
                self._send_plan()
        # Not under the guard: a download may take long, and the lookups' re-plan must not wait for it.
        handle = self.cache.use(shard) if wait else self.cache.cached(shard, join=join)
        if handle is None:
            return None
        try:
            loaded = load(handle.path)
        except BaseException:
            handle.close()
            raise
        with self._guard():  # a reader reading shards at once: the last one read is held
            self.release()
            self._held = (handle, loaded, os.getpid())
        return loaded

    def known_size(self, url: str) -> int | None:
        """The shard's size if this process has it (looked up for the plan, or read), else None: no request."""
        shard = self._known.get(url)
        return None if shard is None else shard.size

    def has(self, url: str) -> bool:
        """Whether the shard's copy is in the cache now, so that :meth:`local` would find it (a hint,
        see :meth:`ShardCache.has`); False while its size and identity are not known."""
        shard = self._known.get(url)
        if shard is None:
            return False
        return self._holds(self._held, shard) or self.cache.has(shard)

    @staticmethod
    def _holds(held: tuple[CachedShard, Any, int] | None, shard: RemoteShard) -> bool:
        """Whether ``held`` (the slot's held shard, read once by the caller) is ``shard``, held in this process."""
        return held is not None and held[0].shard == shard and held[2] == os.getpid()

    def cached_identity(self, url: str) -> str | None:
        """The identity of the shard's copy in the cache (the object it was downloaded as) if it is
        there now (see :meth:`has`), else None: no request either way."""
        return self._known[url].identity if self.has(url) else None

    def release(self) -> None:
        """Let the shard held be evicted (what was loaded from it stays readable: an open file or a
        mapping outlives the name)."""
        if self._held is not None:
            self._held[0].close()  # a forked copy's file is closed already (see storage.locks)
            self._held = None


class RemoteReading:
    """What the ready-made readers share: URLs read with ``storage_options``, and with ``cache_dir``
    through a node-local cache that the slot's schedule feeds (:meth:`planner`).

    Args:
        storage_options: for URLs, the filesystem's options as fsspec takes them.
        cache_dir: a local directory to keep remote shards in, shared by every process on the
            machine that passes it (None: no cache).
        cache_limit: bytes the cache may take (None: no bound); the same in every process.
        prefetch: with a cache, how many of the slot's next shards download in the background.

    Raises:
        ValueError: ``cache_limit`` or ``prefetch`` out of range, or ``cache_limit`` without ``cache_dir``.
    """

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None,
        cache_dir: str | os.PathLike[str] | None,
        cache_limit: int | None,
        prefetch: int,
    ) -> None:
        check_int_arg("prefetch", prefetch, minimum=0)
        if cache_limit is not None:
            check_int_arg("cache_limit", cache_limit, minimum=1)
            if cache_dir is None:
                raise ValueError(f"cache_limit={cache_limit} needs cache_dir= (the cache it bounds), but got None")
        self._remote = Remote(storage_options)
        self.storage_options = self._remote.storage_options
        self._shard_cache = None if cache_dir is None else CachedRemote(self._remote, cache_dir, cache_limit, prefetch)

    def planner(self) -> Callable[[Sequence[Any]], None] | None:
        """With a cache, what takes the shards the reading slot reads next, in order (the rest of its
        epoch, then the next): :class:`ShardedIterable` calls it as it moves from shard to shard."""
        return None if self._shard_cache is None else self._shard_cache.plan

    def _remote_identity(self, url: str) -> str:
        """The object's size and ETag, asked now (and noted for the cache)."""
        return (self._remote if self._shard_cache is None else self._shard_cache).identity(url)

    def reads_locally(self, shard: Any) -> bool:
        """Whether reading ``shard`` now asks nothing of the network: a local path, or a remote shard
        whose copy is in the cache (a hint: the copy may be evicted before the read opens it, which
        then reads by ranged requests)."""
        if not is_url(shard):
            return True
        return self._shard_cache is not None and self._shard_cache.has(str(shard))

    def known_identity(self, shard: Any) -> str | None:
        """The identity of a remote shard's copy in the cache, without a request (None: not cached, a
        local path, or no cache). A slot entering the shard takes it: it names the bytes the reads
        take; a restore's check asks the server (:meth:`identity`)."""
        if self._shard_cache is None or not is_url(shard):
            return None
        return self._shard_cache.cached_identity(str(shard))

    def _local_copy(self, shard: Any, load: Callable[[str], Any], *, wait: bool, join: bool = False) -> Any | None:
        """``load(path)`` of a remote shard's cached copy (downloaded first with ``wait``; with ``join``,
        once this process's download of it in flight is in), held while the slot reads it; None
        without a cache, for a local path, or when not cached yet."""
        if self._shard_cache is None or not is_url(shard):
            return None
        return self._shard_cache.local(str(shard), load, wait=wait, join=join)
