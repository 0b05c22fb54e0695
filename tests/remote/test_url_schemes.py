"""URL schemes: a client that is not installed, and the scheme of a glob's matches.

Specification: a ``gs://`` or ``az://`` shard (or glob) without gcsfs or adlfs fails when the stream
is built, with an ImportError that names the URL and the package, and says how to install it. A
glob's matches are named in the pattern's own scheme, whatever the filesystem calls itself.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import pytest
from fsspec import registry

from resumable_data.streams import ShardedIterable, TokenShardReader


@pytest.mark.parametrize(("url", "package"), [("gs://bucket/tokens/*.bin", "gcsfs"), ("az://box/x.bin", "adlfs")])
def test_a_url_whose_client_is_not_installed_names_the_package(
    monkeypatch: pytest.MonkeyPatch, url: str, package: str
) -> None:
    scheme = url.split("://", 1)[0]
    if scheme in registry:
        pytest.skip(f"{package} is already loaded in this process")
    monkeypatch.setitem(sys.modules, package, None)  # not installed, whether it is here or not
    with pytest.raises(
        ImportError, match=re.escape(f"cannot read '{url}': it needs the package '{package}': pip install {package} (")
    ):
        ShardedIterable(url, read_shard=TokenShardReader(8))


def test_a_glob_names_its_matches_in_the_patterns_scheme(s3_server: Any) -> None:
    bucket, options = s3_server.bucket(), s3_server.options()
    for s in range(2):
        s3_server.put(f"s3://{bucket}/t/x{s}.bin", bytes(16))
    listed = ShardedIterable(f"s3a://{bucket}/t/*.bin", read_shard=TokenShardReader(8, storage_options=options)).shards
    assert listed == [f"s3a://{bucket}/t/x{s}.bin" for s in range(2)]  # s3fs names them s3://
