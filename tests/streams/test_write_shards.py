"""write_token_shards writes documents' tokens as equal shards and their index file, last.

Specification: the shards read back through ``ShardedIterable.from_index`` + ``TokenShardReader`` are
the documents' tokens (each followed by ``eos``) concatenated, cut into shards of ``shard_tokens``
and read as fixed windows; the index gives the sizes without opening a shard, so the state is a
position (under 1 KB at 1,000 shards) and ``shuffle_window`` reads by position; a run interrupted
and restored over written shards equals the uninterrupted one; a writing that stops part way leaves
no index and no partial file under a shard's name; the same input gives the same bytes; a token
that does not fit the dtype is refused, named. The same through the CLI, and to ``file://`` and
fsspec (``memory://``) URLs. (An S3 destination is tested with the S3 server fixture of tests/remote.)
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harness import assert_resumes_identically
from resumable_data import ResumeError
from resumable_data.__main__ import main
from resumable_data.streams import (
    ShardedIterable,
    ShardIndex,
    StreamLoader,
    TokenShardReader,
    jsonl_documents,
    write_token_shards,
)
from resumable_data.testing import assert_same

WINDOW = 5
SHARD_TOKENS = 4 * WINDOW
EOS = 999


def documents(count: int = 40, seed: int = 0, high: int = 900) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(0, 17))) for _ in range(count)]


def expected_windows(docs: list[Any], shard_tokens: int, window: int, eos: int | None) -> list[torch.Tensor]:
    """The windows in shard order, computed from the documents alone."""
    stream = [t for doc in docs for t in [*np.asarray(doc).tolist(), *([] if eos is None else [eos])]]
    shards = [stream[i : i + shard_tokens] for i in range(0, len(stream), shard_tokens)]
    return [
        torch.tensor(shard[k : k + window], dtype=torch.int64)
        for shard in shards
        for k in range(0, len(shard) - window + 1, window)
    ]


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize(("fmt", "dtype"), [("bin", np.uint16), ("npy", np.uint16), ("bin", np.uint32)])
def test_shards_read_back_are_the_documents_tokens_cut_into_shards_and_windows(
    tmp_path: Path, fmt: str, dtype: Any
) -> None:
    docs = documents()
    index = write_token_shards(docs, tmp_path, shard_tokens=SHARD_TOKENS, dtype=dtype, format=fmt, eos=EOS)
    assert index == str(tmp_path / "index.json")
    stream = ShardedIterable.from_index(tmp_path, read_shard=TokenShardReader(WINDOW, dtype=dtype), shuffle=False)
    assert_same(expected_windows(docs, SHARD_TOKENS, WINDOW, EOS), list(stream), "windows read back")
    loaded = ShardIndex.load(index)
    total = sum(len(d) + 1 for d in docs)
    assert (loaded.tokens, loaded.dtype, loaded.format, loaded.eos) == (total, np.dtype(dtype).name, fmt, EOS)
    assert [e.tokens for e in loaded.shards] == [SHARD_TOKENS] * (total // SHARD_TOKENS) + [total % SHARD_TOKENS]
    assert [e.bytes for e in loaded.shards] == [os.path.getsize(p) for p in loaded.locations]


def test_the_index_gives_the_sizes_without_opening_a_shard(tmp_path: Path) -> None:
    docs = documents()
    write_token_shards(docs, tmp_path, shard_tokens=SHARD_TOKENS, eos=EOS)
    reader = TokenShardReader(WINDOW)
    counted = ShardedIterable(sorted(tmp_path.glob("*.bin")), read_shard=reader).sizes
    (tmp_path / "shard-00003.bin").unlink()  # counting would fail on it; the index never opens it
    stream = ShardedIterable.from_index(tmp_path, read_shard=reader, shuffle=False)
    assert stream.sizes == counted
    with pytest.raises(ResumeError, match=r"shard-00003\.bin"):
        list(stream)


def pipeline(folder: Path, workers: int = 0) -> Any:
    stream = ShardedIterable.from_index(folder, read_shard=TokenShardReader(WINDOW), seed=3)
    return StreamLoader(stream.shuffle_window(12, seed=1).shuffle_buffer(5, seed=2), batch_size=4, num_workers=workers)


def test_a_run_over_written_shards_resumes_exactly(tmp_path: Path) -> None:
    write_token_shards(documents(120), tmp_path, shard_tokens=SHARD_TOKENS, eos=EOS)
    # Cuts: before the first batch, mid-epoch twice at the same point, the next epoch.
    assert_resumes_identically(lambda: pipeline(tmp_path), cuts=[0, 7, 7, 40], total=60)


def test_the_state_over_1000_written_shards_is_a_position_under_1kb(tmp_path: Path) -> None:
    per_shard = 70  # windows per shard, more than the shuffle window holds: it spans 2 shards at most
    docs = [np.arange(i % 7, i % 7 + per_shard * WINDOW) for i in range(1000)]  # one shard per document
    write_token_shards(docs, tmp_path, shard_tokens=per_shard * WINDOW)
    stream = ShardedIterable.from_index(tmp_path, read_shard=TokenShardReader(WINDOW), seed=0)
    assert len(stream.shards) == 1000
    loader = StreamLoader(stream.shuffle_window(64, seed=1), batch_size=32)
    batches = 2 * (1000 * per_shard // 128) + 1  # half the epoch: an odd number of half windows
    list(itertools.islice(iter(loader), batches))
    state = json.loads(json.dumps(loader.state_dict()))
    window = state["slots"]["0"]["source"]
    assert (window["count"], window["taken"], window["positional"]) == (64, 32, True), "not read by position"
    assert window["source"]["position"] == batches * 32 + 32  # the open window's records, by position
    assert "remaining" not in window["source"]
    assert len(json.dumps(state)) < 1024, json.dumps(state)


def test_a_writing_that_stops_part_way_leaves_no_index_and_no_partial_shard(tmp_path: Path) -> None:
    docs = documents(60)

    def failing() -> Iterator[np.ndarray]:
        yield from docs[:30]
        raise RuntimeError("the tokenizer died")

    with pytest.raises(RuntimeError, match="tokenizer died"):
        write_token_shards(failing(), tmp_path, shard_tokens=SHARD_TOKENS, eos=EOS)
    assert not (tmp_path / "index.json").exists()
    whole = sum(len(d) + 1 for d in docs[:30]) // SHARD_TOKENS
    # Only the shards completed before the failure, each whole; no temporary file is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"shard-{i:05d}.bin" for i in range(whole)]
    assert {p.stat().st_size for p in tmp_path.iterdir()} == {SHARD_TOKENS * 2}
    with pytest.raises(ResumeError, match=r"index\.json.* is missing"):
        ShardedIterable.from_index(tmp_path, read_shard=TokenShardReader(WINDOW))
    # Written again (overwrite: the shards are replaced), the folder is whole and indexed.
    write_token_shards(docs, tmp_path, shard_tokens=SHARD_TOKENS, eos=EOS, overwrite=True)
    assert ShardIndex.load(tmp_path).tokens == sum(len(d) + 1 for d in docs)


def test_an_indexed_folder_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    write_token_shards(documents(), tmp_path, shard_tokens=SHARD_TOKENS)
    before = files(tmp_path)
    with pytest.raises(ValueError, match=r"index\.json exists: pass overwrite=True"):
        write_token_shards(documents(seed=1), tmp_path, shard_tokens=SHARD_TOKENS)
    assert files(tmp_path) == before


def test_the_same_documents_give_the_same_bytes(tmp_path: Path) -> None:
    for name in ("a", "b"):
        write_token_shards(documents(), tmp_path / name, shard_tokens=SHARD_TOKENS, format="npy", eos=EOS)
    assert files(tmp_path / "a") == files(tmp_path / "b")
    assert len(files(tmp_path / "a")) > 3


@pytest.mark.parametrize(("token", "dtype"), [(65536, np.uint16), (-1, np.uint32), (256, np.uint8)])
def test_a_token_that_does_not_fit_the_dtype_is_refused_naming_it(tmp_path: Path, token: int, dtype: Any) -> None:
    docs = [[1, 2, 3], [4, token, 5]]
    name = np.dtype(dtype).name
    with pytest.raises(ValueError, match=rf"document 1 holds token {token}, which does not fit dtype={name}"):
        write_token_shards(docs, tmp_path, shard_tokens=2, dtype=dtype)
    assert not (tmp_path / "index.json").exists()
    with pytest.raises(ValueError, match=rf"eos is {token}.*dtype={name}" if token >= 0 else "eos should be"):
        write_token_shards([[1]], tmp_path, shard_tokens=2, dtype=dtype, eos=token)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "pass one of shard_tokens="),
        ({"shard_tokens": 4, "shard_bytes": 8}, "pass one of shard_tokens="),
        ({"shard_bytes": 7}, "shard_bytes=7 is not a multiple of 2"),
        ({"shard_tokens": 4, "format": "parquet"}, "format should be one of"),
        ({"shard_tokens": 4, "dtype": np.float32}, "dtype should be an integer type"),
        ({"shard_tokens": 4, "name": "shard"}, "name should be .* an {index} field"),
        ({"shard_tokens": 0}, "shard_tokens should be an integer >= 1"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_read_or_written(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    def unread() -> Iterator[list[int]]:
        raise AssertionError("a document was read before the arguments were checked")
        yield [1, 2]

    with pytest.raises(ValueError, match=message):
        write_token_shards(unread(), tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_shard_bytes_gives_the_shard_size_in_bytes(tmp_path: Path) -> None:
    write_token_shards(documents(), tmp_path / "t", shard_tokens=SHARD_TOKENS, dtype=np.uint32)
    write_token_shards(documents(), tmp_path / "b", shard_bytes=SHARD_TOKENS * 4, dtype=np.uint32)
    assert files(tmp_path / "t") == files(tmp_path / "b")


def test_a_reader_of_another_dtype_or_a_bad_index_is_refused(tmp_path: Path) -> None:
    write_token_shards(documents(), tmp_path, shard_tokens=SHARD_TOKENS, dtype=np.uint32)
    with pytest.raises(ResumeError, match=r"hold uint32 tokens, but the reader reads uint16.*dtype='uint32'"):
        ShardedIterable.from_index(tmp_path, read_shard=TokenShardReader(WINDOW))
    data = json.loads((tmp_path / "index.json").read_text())
    for change, message in [
        ({"version": 2}, "has version 2, this release reads version 1"),
        ({"shards": [{**data["shards"][0], "path": "../x.bin"}]}, "'path' should be a path relative"),
        ({"tokens": 1}, "'tokens' is 1, but its shards hold"),
    ]:
        (tmp_path / "index.json").write_text(json.dumps({**data, **change}))
        with pytest.raises(ResumeError, match=message):
            ShardIndex.load(tmp_path)


def test_a_file_url_destination_writes_the_local_folder(tmp_path: Path) -> None:
    write_token_shards(documents(), tmp_path / "local", shard_tokens=SHARD_TOKENS, eos=EOS)
    index = write_token_shards(documents(), (tmp_path / "url").as_uri(), shard_tokens=SHARD_TOKENS, eos=EOS)
    assert index == str(tmp_path / "url" / "index.json")
    assert files(tmp_path / "url") == files(tmp_path / "local")
    assert ShardIndex.load((tmp_path / "url" / "index.json").as_uri()).tokens == ShardIndex.load(index).tokens


def test_an_fsspec_url_destination_gets_the_same_files(tmp_path: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    write_token_shards(documents(), tmp_path, shard_tokens=SHARD_TOKENS, format="npy", eos=EOS)
    url = "memory://written/tokens"
    index = write_token_shards(documents(), url, shard_tokens=SHARD_TOKENS, format="npy", eos=EOS)
    try:
        assert index == url + "/index.json"
        fs = fsspec.filesystem("memory")
        assert {Path(p).name: fs.cat_file(p) for p in fs.ls("/written/tokens", detail=False)} == files(tmp_path)
        loaded = ShardIndex.load(url + "/")
        assert loaded.locations[0] == url + "/shard-00000.npy"
    finally:
        fsspec.filesystem("memory").rm("/written", recursive=True)


def test_a_tokenized_hf_dataset_column_and_jsonl_are_written_as_their_token_lists(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    docs = [d.tolist() for d in documents()]
    write_token_shards(docs, tmp_path / "lists", shard_tokens=SHARD_TOKENS, eos=EOS)
    dataset = datasets.Dataset.from_dict({"input_ids": docs, "text": ["x"] * len(docs)})
    write_token_shards(dataset, tmp_path / "hf", shard_tokens=SHARD_TOKENS, eos=EOS, column="input_ids")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    jsonl = jsonl_documents(tmp_path / "docs.jsonl", field="input_ids")
    write_token_shards(jsonl, tmp_path / "jsonl", shard_tokens=SHARD_TOKENS, eos=EOS)
    assert files(tmp_path / "hf") == files(tmp_path / "lists") == files(tmp_path / "jsonl")


def cli(*args: str) -> list[str]:
    return ["write-shards", *args]


def test_the_cli_writes_jsonl_token_ids_and_text_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = [d.tolist() for d in documents()]
    texts = ["héllo", "", "résumé exact", "x" * 30]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    command = cli("--input", str(tmp_path / "ids.jsonl"), "--field", "input_ids", "--dest", str(tmp_path / "ids"),
                  "--shard-tokens", str(SHARD_TOKENS), "--eos", str(EOS))  # fmt: skip
    ids = subprocess.run([sys.executable, "-m", "resumable_data", *command], capture_output=True, text=True, timeout=60)
    assert (ids.returncode, ids.stdout.strip()) == (0, str(tmp_path / "ids" / "index.json")), ids.stderr
    stream = ShardedIterable.from_index(tmp_path / "ids", read_shard=TokenShardReader(WINDOW), shuffle=False)
    assert_same(expected_windows(docs, SHARD_TOKENS, WINDOW, EOS), list(stream), "windows written by the CLI")

    # In this process from here on (the same main()): text as UTF-8 bytes, then a refusal.
    assert main(cli("--input", str(tmp_path / "text.jsonl"), "--field", "text", "--bytes", "--dest",
                    str(tmp_path / "text"), "--shard-tokens", "8", "--eos", "256", "--format", "npy")) == 0  # fmt: skip
    tokens = np.concatenate([np.load(p) for p in ShardIndex.load(tmp_path / "text").locations])
    assert tokens.tolist() == [b for t in texts for b in [*t.encode(), 256]]
    capsys.readouterr()
    assert main(cli("--input", str(tmp_path / "ids.jsonl"), "--field", "input_ids", "--dest", str(tmp_path / "bad"),
                    "--shard-tokens", "8", "--dtype", "uint8")) == 1  # fmt: skip
    error = capsys.readouterr().err
    assert error.startswith("error: document ") and "does not fit dtype=uint8" in error and error.endswith("\n")
    assert error.count("\n") == 1 and not (tmp_path / "bad" / "index.json").exists()
