"""A "remote" that is a local folder, for the shard cache's tests: each download is a real file copy,
logged to a file (so processes sharing a cache count their downloads together), with faults on demand."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from resumable_data.storage.cache import RemoteShard


def identity_of(data: bytes) -> str:
    """What the folder's "server" reports for an object: its size and a digest (like an ETag)."""
    return f"{len(data)}:{hashlib.sha256(data).hexdigest()[:16]}"


def disk_usage(cache_dir: str | Path) -> int:
    """Bytes of the cache's shard files, complete and partial (a file renamed while we look counts once)."""
    seen: dict[int, int] = {}
    for sub in ("partial", "shards"):  # partial first: a rename in between shows the same inode twice
        for item in os.scandir(Path(cache_dir) / sub):
            try:
                stat = item.stat()
            except FileNotFoundError:  # evicted while we looked
                continue
            seen[stat.st_ino] = stat.st_size
    return sum(seen.values())


class FolderRemote:
    """``download(url, dest)`` for URLs ``folder://<name>`` of files in ``root``.

    Args:
        root: the folder that plays the server.
        log: each download appends its URL here, before copying.
        delay: seconds each download takes (to make downloads overlap).
        fail: names whose next download raises OSError (once each: a transient fault).
        hang: a name whose download writes half, creates ``marker`` and sleeps (to be SIGKILLed).
        usage_log: after each copy, the cache's disk usage is appended here (the moments it peaks).
    """

    def __init__(
        self,
        root: str | Path,
        log: str | Path,
        *,
        delay: float = 0.0,
        fail: set[str] | None = None,
        hang: str | None = None,
        marker: str | Path | None = None,
        usage_log: str | Path | None = None,
    ) -> None:
        self.root, self.log, self.delay, self.fail = Path(root), Path(log), delay, set(fail or ())
        self.hang, self.marker, self.usage_log = hang, marker, usage_log

    def shard(self, name: str) -> RemoteShard:
        """The shard as a listing of the folder gives it now."""
        data = (self.root / name).read_bytes()
        return RemoteShard(f"folder://{name}", len(data), identity_of(data))

    def downloads(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []

    def __call__(self, url: str, dest: str) -> str:
        name = url.removeprefix("folder://")
        with open(self.log, "a") as log:
            log.write(url + "\n")
        if name in self.fail:
            self.fail.remove(name)
            raise OSError(f"injected failure reading {url}")
        data = (self.root / name).read_bytes()
        with open(dest, "wb") as out:
            if name == self.hang:
                out.write(data[: len(data) // 2])
                out.flush()
                Path(str(self.marker)).touch()
                time.sleep(600)
            time.sleep(self.delay)
            out.write(data)
        if self.usage_log is not None:
            usage = disk_usage(Path(dest).parent.parent)
            with open(self.usage_log, "a") as log:
                log.write(f"{usage}\n")
        return identity_of(data)


def make_remote(root: Path, count: int, size: int) -> list[str]:
    """``count`` objects of ``size`` distinct bytes each in ``root``; their names."""
    root.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(count):
        name = f"s{i:03d}.bin"
        (root / name).write_bytes(hashlib.sha256(str(i).encode()).digest() * (size // 32))
        names.append(name)
    return names
