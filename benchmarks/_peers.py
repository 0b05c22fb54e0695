"""Peer streaming libraries for bench_streams.py, each used the way its documentation teaches.

- litdata (``pip install litdata``): ``litdata.optimize`` writes chunked data, read by
  ``StreamingDataset(input_dir, shuffle=True, seed=...)`` through ``StreamingDataLoader``, whose
  ``state_dict()`` / ``load_state_dict()`` resume. ``optimize`` runs in a *separate process*: after
  it has run in a process, that process's forked DataLoader workers start about 100x slower. From
  object storage: ``input_dir="s3://..."`` with ``storage_options`` (boto3's client arguments),
  ``cache_dir`` and ``max_cache_size``.
- Mosaic Streaming (``pip install mosaicml-streaming``): ``MDSWriter`` writes MDS shards, read by
  ``StreamingDataset(local=..., shuffle=True, shuffle_seed=..., batch_size=...)`` through its
  ``StreamingDataLoader``, whose ``state_dict()`` / ``load_state_dict()`` resume. From object
  storage: ``remote="s3://..."`` with ``local`` its cache, ``cache_limit`` and ``predownload``, the
  endpoint in ``S3_ENDPOINT_URL``. Its import needs
  torchvision's C ops; on a torch ``+cpu`` wheel with PyPI's torchvision the tests' workaround
  (``tests/torchvision_compat.py``) declares them.

Both are optional (the ``[peers]`` extra); :func:`available` says which import, and why not.
Records are the same as ours: record ``i`` is the int64 pair ``[i, i]`` (two tokens), so every
library's batches are checked for exactness by their record ids.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def available() -> dict[str, str | None]:
    """``{peer: None when importable, else why not}``."""
    found: dict[str, str | None] = {}
    try:
        import litdata  # noqa: F401
    except Exception as exc:  # any import failure means "not usable here"
        found["litdata"] = f"not installed ({type(exc).__name__}: {exc}); pip install '.[peers]'"
    else:
        found["litdata"] = None
    try:
        _import_streaming()
    except Exception as exc:
        found["mosaic"] = f"not installed ({type(exc).__name__}: {exc}); pip install '.[peers]'"
    else:
        found["mosaic"] = None
    return found


def _import_streaming() -> None:
    """``import streaming``, with torchvision's C ops declared first (the tests' workaround): in
    every process that uses it, a benchmark cell's included."""
    if str(REPO_ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / "tests"))
    from torchvision_compat import load_torchvision

    load_torchvision()
    import streaming  # noqa: F401


_LITDATA_WRITER = """
import sys
import numpy as np
import litdata

def record(i):
    return np.array([i, i], dtype=np.int64)

if __name__ == "__main__":
    n, out, per_chunk = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    size = {"chunk_size": per_chunk} if per_chunk else {"chunk_bytes": "16MB"}
    litdata.optimize(fn=record, inputs=list(range(n)), output_dir=out, num_workers=1, **size)
"""


def write_litdata(directory: Path, n: int, per_chunk: int = 0) -> Path:
    """``n`` records in litdata's format, written by ``litdata.optimize`` in another process, in chunks
    of ``per_chunk`` records (0: of 16 MB)."""
    out = directory / f"litdata-{n}"
    script = directory / "write_litdata.py"
    script.write_text(_LITDATA_WRITER)
    command = [sys.executable, str(script), str(n), str(out), str(per_chunk)]
    subprocess.run(command, check=True, capture_output=True, timeout=1800)
    return out


def write_mosaic(directory: Path, n: int, size_limit: int = 1 << 24) -> Path:
    """``n`` records as Mosaic MDS shards of at most ``size_limit`` bytes."""
    _import_streaming()
    from streaming import MDSWriter

    out = directory / f"mosaic-{n}"
    with MDSWriter(out=str(out), columns={"tokens": "ndarray:int64:2"}, size_limit=size_limit) as writer:
        for i in range(n):
            writer.write({"tokens": np.array([i, i], dtype=np.int64)})
    return out


def litdata_loader(data: Path | str, *, batch_size: int, workers: int, transform: Any = None, **options: Any) -> Any:
    """litdata's loader over ``data`` (a folder or a URL); ``options`` go to its ``StreamingDataset``
    (``storage_options``, ``cache_dir``, ``max_cache_size``)."""
    import litdata

    dataset = litdata.StreamingDataset(str(data), shuffle=True, seed=0, transform=transform, **options)
    return litdata.StreamingDataLoader(dataset, batch_size=batch_size, num_workers=workers)


_MOSAIC_LIVE: list[Any] = []


def mosaic_loader(data: Path, *, batch_size: int, workers: int, transform: Any = None, **options: Any) -> Any:
    """Mosaic's loader over the shards in ``data``, or with ``remote=`` in ``options``, over the remote
    ones with ``data`` their local cache (``cache_limit``, ``predownload``: Mosaic's own options)."""
    _import_streaming()
    from streaming import StreamingDataLoader, StreamingDataset

    release_mosaic()  # one live dataset per local directory (its shared memory is named after it)

    class Dataset(StreamingDataset):
        def __getitem__(self, index: int) -> Any:
            sample = torch.from_numpy(super().__getitem__(index)["tokens"])
            return sample if transform is None else transform(sample)

    dataset = Dataset(local=str(data), shuffle=True, shuffle_seed=0, batch_size=batch_size, **options)
    _MOSAIC_LIVE.append(dataset)
    return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=workers)


def release_mosaic() -> None:
    _MOSAIC_LIVE.clear()
    gc.collect()
