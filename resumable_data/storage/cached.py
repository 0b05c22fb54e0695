"""What a reader with ``cache_dir=`` reads remote shards through: the node-local :class:`ShardCache`,
fed with the slot's schedule, and the shards' sizes and identities as the reader last saw them.

A reader asks :meth:`CachedRemote.local` for a shard's local copy. Reading a shard from its start
waits for the download (usually done already: the schedule's next shards are prefetched); any
other read (a restore's first records, records fetched by key) takes the copy only if it is there
and otherwise reads by ranged requests, as without a cache, while the shard downloads in the
background. So a restore fetches what its first batch needs first and never downloads the shards
its epoch read before the checkpoint.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..core.state import check_int_arg
from .cache import CachedShard, RemoteShard, ShardCache
from .files import Remote, is_url

__all__ = ["CachedRemote"]

# Shards a reader keeps open (held against eviction) while they are among the next of its schedule:
# a shuffle reads by key from the few shards its window or buffer spans.
_HELD = 4
_LOOKUPS = 8  # concurrent requests for the sizes and identities of planned shards not seen yet


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
        if cache_limit is not None:
            check_int_arg("cache_limit", cache_limit, minimum=1)
        self.remote = remote
        self.cache_dir = os.fspath(cache_dir)
        self.cache_limit = cache_limit
        self.prefetch = check_int_arg("prefetch", prefetch, minimum=0)
        self._known: dict[str, str] = {}  # url -> identity ("size:etag") as last read
        self._cache: ShardCache | None = None
        self._held: OrderedDict[str, tuple[CachedShard, Any]] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": None, "_held": OrderedDict()}

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
        identity = self._known[url] = self.remote.identity(url)
        return identity

    def note(self, url: str, size: int, tag: str | None) -> None:
        """A size and ETag the reader read anyway (counting records): no request for them later."""
        if tag is not None:
            self._known[url] = f"{size}:{tag}"

    def _shard(self, url: str) -> RemoteShard:
        identity = self._known.get(url) or self.identity(url)
        return RemoteShard(url, int(identity.split(":", 1)[0]), identity)

    def plan(self, upcoming: Sequence[Any]) -> None:
        """The shards this slot reads next, in order (the rest of its epoch, then the next one): the
        cache prefetches the first ones and evicts by these next uses. Local paths are skipped."""
        urls = [str(shard) for shard in upcoming if is_url(shard)]
        unknown = list(dict.fromkeys(url for url in urls if url not in self._known))
        if unknown:
            with ThreadPoolExecutor(min(_LOOKUPS, len(unknown))) as pool:
                list(pool.map(self.identity, unknown))
        self.cache.plan([self._shard(url) for url in urls])
        near = set(urls[:_HELD])
        for url in [url for url in self._held if url not in near]:  # read: now evictable
            self._held.pop(url)[0].close()

    def local(self, url: str, load: Callable[[str], Any], *, wait: bool) -> Any | None:
        """``load(local path)`` of the shard's cached copy, kept open with the shard held against
        eviction while the reader may read it again; with ``wait``, downloaded first if no process
        has it, else None when it is not cached yet."""
        shard = self._shard(url)
        held = self._held.get(url)
        if held is not None and held[0].shard == shard:
            self._held.move_to_end(url)
            return held[1]
        handle = self.cache.use(shard) if wait else self.cache.cached(shard)
        if handle is None:
            return None
        try:
            loaded = load(handle.path)
        except BaseException:
            handle.close()
            raise
        if held is not None:
            held[0].close()
        self._held[url] = (handle, loaded)
        self._held.move_to_end(url)
        while len(self._held) > _HELD:
            self._held.popitem(last=False)[1][0].close()
        return loaded
