"""One slot of a shard cache in its own process, for tests/storage/test_cache.py.

Usage: ``python cache_child.py CONFIG_JSON``. Reads ``names`` in order through a ShardCache (planned,
with ``prefetch``), checks each local copy against the remote, and prints its counters as JSON. With
``ready``/``go`` paths it waits (after imports) until ``go`` exists, so that processes start together.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from remote_folder import FolderRemote

from resumable_data.storage.cache import ShardCache


def main(config: dict) -> None:
    remote = FolderRemote(
        config["root"],
        config["log"],
        delay=config.get("delay", 0.0),
        hang=config.get("hang"),
        marker=config.get("marker"),
        usage_log=config.get("usage_log"),
    )
    shards = [remote.shard(name) for name in config["names"]]
    cache = ShardCache(config["cache_dir"], config.get("limit"), download=remote, prefetch=config.get("prefetch", 0))
    if "go" in config:
        Path(config["ready"]).touch()
        while not Path(config["go"]).exists():
            time.sleep(0.01)
    cache.plan(shards)
    for shard in shards:
        with cache.use(shard) as path:
            if Path(path).read_bytes() != (Path(config["root"]) / shard.url.removeprefix("folder://")).read_bytes():
                raise SystemExit(f"{shard.url}: the cached copy differs from the remote")
    cache.close()
    print(json.dumps(dataclasses.asdict(cache.counters)))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
