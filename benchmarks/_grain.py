"""Grain for bench_resume.py, used the way its documentation teaches.

``grain.python.DataLoader(data_source=..., sampler=IndexSampler(...), operations=[Batch(...)],
worker_count=w)`` over the benchmark's own map-style dataset (anything with ``__len__`` and
``__getitem__`` is a Grain data source); its iterator's ``get_state()`` returns the JSON bytes that
Grain's checkpoint handler writes, and ``set_state()`` on a fresh iterator restores them.

Grain is optional (the ``[peers]`` extra, ``pip install grain==0.2.18``): :func:`unavailable` says
why it cannot run here, and the benchmark then skips it with that line.

How Grain's DataLoader orders records (read in ``grain/_src/python/data_loader.py`` and checked by
the benchmark against an uninterrupted run at every N it can afford to run): the sampler's position
``p`` holds record ``sampler[p].record_key``; with ``w`` workers, worker ``i`` reads positions
``i, i + w, i + 2w, ...`` and batches them on its own, and the loader takes one batch from each
worker in turn, starting at worker 0. Its state names, per worker, the last position it consumed.
"""

from __future__ import annotations

import json
from collections.abc import Sized
from typing import Any

NAME = "Grain"


def unavailable() -> str | None:
    """None when ``grain.python`` imports, else the reason (one line)."""
    try:
        import grain.python  # noqa: F401
    except Exception as exc:  # any import failure means "not usable here"
        return f"not installed ({type(exc).__name__}: {exc}); pip install 'grain==0.2.18' (the [peers] extra)"
    return None


def version() -> str:
    from importlib.metadata import version

    return version("grain")


def _sampler(n: int, seed: int) -> Any:
    import grain.python as grain

    return grain.IndexSampler(n, shard_options=grain.NoSharding(), shuffle=True, num_epochs=1, seed=seed)


def loader(dataset: Sized, *, batch_size: int, seed: int, workers: int) -> Any:
    """One shuffled epoch of ``dataset`` in batches of ``batch_size``, read by ``workers`` processes."""
    import grain.python as grain

    return grain.DataLoader(
        data_source=dataset,
        sampler=_sampler(len(dataset), seed),
        operations=[grain.Batch(batch_size, drop_remainder=False)],
        worker_count=workers,
    )


def state_at(state: bytes, k: int, *, batch_size: int, workers: int) -> bytes:
    """``state`` (any ``get_state()`` of the same loader) moved to just after global batch ``k - 1``."""
    fields = json.loads(state)
    if workers == 0:
        fields["last_seen_indices"] = {"0": k * batch_size - 1}
    else:
        # Batch j came from worker j % workers; worker i has made ceil((k - i) / workers) batches.
        made = [max(0, -(-(k - i) // workers)) for i in range(workers)]
        fields["last_seen_indices"] = {str(i): i + workers * (made[i] * batch_size - 1) for i in range(workers)}
        # Grain writes -1 after the last worker's batch, as it does before the first one.
        fields["last_worker_index"] = k % workers - 1
    return json.dumps(fields).encode()


def batches_at(
    n: int, ks: list[int], count: int, *, batch_size: int, seed: int, workers: int
) -> dict[int, list[list[int]]]:
    """Global batches ``k .. k + count - 1`` (those that exist) for each k, from the sampler alone."""
    sampler = _sampler(n, seed)
    lanes = max(workers, 1)
    found: dict[int, list[list[int]]] = {}
    for k in ks:
        found[k] = []
        for j in range(k, k + count):
            lane, local = j % lanes, j // lanes
            positions = range(lane + lanes * local * batch_size, n, lanes)[:batch_size]
            if not positions:
                break
            found[k].append([int(sampler[p].record_key) for p in positions])
    return found
