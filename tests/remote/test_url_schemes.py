"""URL schemes whose client is not installed: one clear error naming the package to install.

Specification: a ``gs://`` or ``az://`` shard (or glob) without gcsfs or adlfs fails when the stream
is built, with an ImportError that names the URL and the package, and says how to install it.
"""

from __future__ import annotations

import re
import sys

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
