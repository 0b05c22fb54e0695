"""``--data`` of token shards (``trainer/shards.py``): what names them, and the shard sets refused.

The run over ``s3://`` shards, SIGKILLed and resumed, is in tests/remote/test_trainer_s3.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers.trainer_runs import text_corpus, tiny
from resumable_data.streams import write_token_shards
from trainer.shards import shard_index
from trainer.train import train


def shards(folder: Path, n_tokens: int, shard_tokens: int, dtype: type = np.uint8) -> Path:
    write_token_shards([np.arange(n_tokens) % 256], folder, shard_tokens=shard_tokens, dtype=dtype)
    return folder


def test_data_names_token_shards_by_their_index_its_folder_or_a_url(tmp_path: Path) -> None:
    folder = shards(tmp_path / "tokens", 300, 100)
    index = shard_index(str(folder))
    assert index is not None and index == shard_index(str(folder / "index.json"))
    assert index.locations == [str(folder / f"shard-0000{i}.bin") for i in range(3)]
    assert shard_index(str(text_corpus(tmp_path))) is None  # text stays text
    assert shard_index(str(tmp_path)) is None  # a folder without an index too
    assert shard_index(None) is None


def test_one_shard_or_wide_tokens_are_refused_naming_why(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="token shards need 2 or more"):
        train(tiny(tmp_path, "one", data=shards(tmp_path / "one", 300, 300)))
    with pytest.raises(ValueError, match=r"the shards hold uint32 tokens.*--dtype uint16"):
        train(tiny(tmp_path, "wide", data=shards(tmp_path / "wide", 300, 100, np.uint32)))
