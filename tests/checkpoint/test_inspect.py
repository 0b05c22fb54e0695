"""``python -m resumable_data inspect PATH``: a verified summary of a good checkpoint, one error line for
a bad one — never a traceback, never a payload run."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_data import CheckpointManager, ResumableDataLoader
from resumable_data.__main__ import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A trainer-shaped checkpoint: a loader stopped after 3 batches of 4, with world size 1."""
    loader = ResumableDataLoader(torch.arange(100), batch_size=4, seed=0)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    model = {"w": torch.ones(10, 10), "tied": None}
    model["tied"] = model["w"]  # shared storage counts once
    state = {"model": model, "dataloader": loader.state_dict(), "train_state": {"step": 42}}
    with CheckpointManager(tmp_path / "run") as manager:
        return manager.save(42, state, metric=0.25)


def run_inspect(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["inspect", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(code: int, out: str, err: str, *fragments: str) -> None:
    assert code != 0
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_a_step_folder_is_verified_and_summarized(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_inspect(capsys, checkpoint)
    assert code == 0 and err == ""
    assert "step          42" in out
    assert "integrity     ok" in out
    assert "/dataloader: epoch 0, position 12, world size 1" in out
    payload_bytes = (checkpoint / "state.pt").stat().st_size
    assert f"{payload_bytes:,} bytes in state.pt" in out
    assert "400 bytes in 2 tensors" in out  # one 10x10 float32 storage, shared by two tensors
    # Its state file gives the same report; --json gives it as data.
    assert run_inspect(capsys, checkpoint / "state.pt")[1] == out
    code, out, _ = run_inspect(capsys, checkpoint, "--json")
    report = json.loads(out)
    assert report["verified"] and report["step"] == 42 and report["metric"] == 0.25
    assert report["data_states"]["/dataloader"]["position"] == 12
    assert report["tensor_bytes"]["model"] == {"count": 2, "bytes": 400}


def test_a_plain_state_file_is_shown_as_not_verified(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "exported.pt"
    torch.save({"dataloader": {"version": 1, "epoch": 2, "position": 7, "world_size": 4}}, path)
    code, out, _ = run_inspect(capsys, path)
    assert code == 0
    assert "NOT VERIFIED" in out and "epoch 2, position 7, world size 4" in out and "step          unknown" in out


def test_a_checkpoint_copied_under_another_name_is_verified_by_its_manifest(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "best-model"
    copy.mkdir()
    for name in ("state.pt", "manifest.json"):
        (copy / name).write_bytes((checkpoint / name).read_bytes())
    code, out, _ = run_inspect(capsys, copy)
    assert code == 0 and "step          42" in out and "integrity     ok" in out


def flipped(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 2] ^= 1
    return bytes(b)


@pytest.mark.parametrize("target", ["folder", "file"])
def test_a_payload_that_no_longer_matches_its_manifest_is_an_error(
    checkpoint: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    payload = checkpoint / "state.pt"
    payload.write_bytes(flipped(payload.read_bytes()))
    code, out, err = run_inspect(capsys, checkpoint if target == "folder" else payload)
    assert_one_error_line(code, out, err, str(checkpoint), "checksum mismatch")


def torch_saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (lambda good: b"", "empty file"),
        (lambda good: good[: len(good) // 2], "not a readable torch checkpoint"),
        (lambda good: bytes(range(256)) * 8, ""),  # refused as a pickle or as a zip, depending on the bytes
        (lambda good: flipped(good), ""),
        (lambda good: torch_saved([1, 2, 3]), "expected a dict"),
    ],
    ids=["zero-byte", "truncated", "random", "bit-flipped", "a list"],
)
def test_bad_files_give_one_error_line(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], content: Any, problem: str
) -> None:
    path = tmp_path / "bad.pt"
    path.write_bytes(content((checkpoint / "state.pt").read_bytes()))
    code, out, err = run_inspect(capsys, path)
    if code == 0:  # a flipped bit inside tensor data still loads: without a manifest nothing can tell
        assert "NOT VERIFIED" in out
        return
    assert_one_error_line(code, out, err, str(path), problem)


def test_missing_paths_and_non_checkpoint_folders_give_one_error_line(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_error_line(*run_inspect(capsys, tmp_path / "nope.pt"), "nope.pt", "no such file")
    # The run folder: say which step folders to pass instead.
    assert_one_error_line(*run_inspect(capsys, checkpoint.parent), "not a checkpoint folder", "step-00000042")
    (checkpoint / "manifest.json").unlink()
    assert_one_error_line(*run_inspect(capsys, checkpoint), str(checkpoint), "missing manifest")
    os.mkfifo(tmp_path / "fifo.pt")
    assert_one_error_line(*run_inspect(capsys, tmp_path / "fifo.pt"), "not a regular file")


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("forge_manifest", [False, True])
def test_a_pickle_payload_is_refused_and_never_runs(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], forge_manifest: bool
) -> None:
    marker = tmp_path / "payload-ran"
    payload = checkpoint / "state.pt"
    torch.save({"model": Payload(marker)}, payload)
    if forge_manifest:  # the manifest vouches for the bomb: only weights_only loading stands in the way
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        manifest.update(sha256=hashlib.sha256(payload.read_bytes()).hexdigest(), size=payload.stat().st_size)
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = run_inspect(capsys, checkpoint)
    expected = "refused by weights_only loading, nothing was executed" if forge_manifest else "the manifest records"
    assert_one_error_line(code, out, err, str(checkpoint), expected)
    assert not marker.exists()


def test_command_line_help_names_the_program_and_has_no_raw_markup() -> None:
    script = Path(sys.executable).parent / "resumable-data"
    commands = [[sys.executable, "-m", "resumable_data", "--help"]]
    if script.exists():  # installed with pip install -e: the console script
        commands.append([str(script), "--help"])
    names = []
    for command in commands:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=120, check=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert "__main__" not in result.stdout and "``" not in result.stdout
        names.append(result.stdout.split()[1])
    assert names == ["python", "resumable-data"][: len(names)]


GOOD = torch_saved({"model": {"w": torch.arange(6.0)}, "dataloader": {"version": 1, "epoch": 0, "position": 3}})


@settings(max_examples=200)
@given(
    data=st.one_of(
        st.binary(max_size=3000),
        st.integers(0, len(GOOD)).map(lambda n: GOOD[:n]),
        st.tuples(st.integers(0, len(GOOD) - 1), st.integers(0, 7)).map(
            lambda at: GOOD[: at[0]] + bytes([GOOD[at[0]] ^ (1 << at[1])]) + GOOD[at[0] + 1 :]
        ),
    )
)
def test_any_bytes_give_a_report_or_one_error_line(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.pt"
        path.write_bytes(data)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["inspect", str(path)])
    if code == 0:
        assert "NOT VERIFIED" in out.getvalue() and err.getvalue() == ""
    else:
        assert_one_error_line(code, out.getvalue(), err.getvalue(), str(path))
