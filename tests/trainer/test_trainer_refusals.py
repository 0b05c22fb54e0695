"""A relaunch that cannot continue the run exactly stops with one error line and exit code 2, and
changes nothing: a run folder holds one history, and nothing ever loses a checkpoint that was complete.

Each case here trained from scratch (exit 0) or resumed onto other data on main (issue 36, items 8,
9, 10 and 15): the other ``--checkpoint-format``, no usable checkpoint, a corpus whose content
changed, a DCP save on a full disk.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from full_disk import fill, small_disk
from helpers.trainer_runs import tiny
from resumable_data import ResumeError
from system.verify import config_to_argv
from trainer.__main__ import main
from trainer.checkpointing import CHECKPOINT_FOLDER
from trainer.config import TrainConfig
from trainer.metrics import read_metrics
from trainer.train import train


def files_of(run_dir: str) -> dict[str, bytes]:
    """Every file of a run folder but the locks, by relative path: what a refused relaunch must not change."""
    root = Path(run_dir)
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"
    }


def refused(config: TrainConfig, capsys: pytest.CaptureFixture[str]) -> str:
    """Relaunch ``config`` on the command line; assert exit 2, one error line and an untouched run folder."""
    before = files_of(config.run_dir)
    capsys.readouterr()
    assert main(config_to_argv(config)) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert files_of(config.run_dir) == before
    assert [e["event"] for e in read_metrics(config.run_dir)].count("start") == 1
    return errors[0]


@pytest.mark.parametrize(("saved_with", "resumed_with"), [("file", "dcp"), ("dcp-async", "file")])
def test_a_relaunch_in_the_other_checkpoint_format_is_refused_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], saved_with: str, resumed_with: str
) -> None:
    """The other format's folder looked empty, so main trained from scratch beside the run (exit 0,
    two starts in metrics.jsonl)."""
    config = tiny(tmp_path, "run", max_steps=8, stop_at=4, eval_every=100, checkpoint_format=saved_with)
    train(config)
    error = refused(replace(config, stop_at=None, checkpoint_format=resumed_with), capsys)
    saved_flag = f"--checkpoint-format {saved_with.split('-')[0]}"
    assert f"--checkpoint-format {resumed_with}, but" in error and f"written with {saved_flag}" in error, error
    assert f"resume with {saved_flag}" in error and "step-00000004" in error, error


def _flip_a_byte(folder: Path) -> None:
    payload = folder / "state.pt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 1
    payload.write_bytes(bytes(data))


def _from_a_newer_release(folder: Path) -> None:
    manifest = folder / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "version": 2}))


@pytest.mark.parametrize(
    ("damage", "reason"), [(_flip_a_byte, "checksum mismatch"), (_from_a_newer_release, "has version 2")]
)
def test_auto_refuses_when_no_checkpoint_can_be_resumed_naming_each_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: object, reason: str
) -> None:
    """On main ``--resume auto`` trained from scratch (exit 0), and its saves replaced step 4 and 8."""
    config = tiny(tmp_path, "run", max_steps=8, eval_every=100)
    train(config)  # checkpoints at steps 4 and 8
    folders = sorted((Path(config.run_dir) / CHECKPOINT_FOLDER).glob("step-*"))
    assert [f.name for f in folders] == ["step-00000004", "step-00000008"]
    for folder in folders:
        damage(folder)  # type: ignore[operator]
    error = refused(config, capsys)
    for folder in folders:
        assert f"{folder.name}: " in error, error
    assert error.count(reason) == 2 and "Nothing was changed" in error and "--resume never" in error, error


def test_a_resume_on_a_corpus_whose_content_changed_is_refused(tmp_path: Path) -> None:
    """The audit fingerprints the next batch's window *indices*: a corpus of the same length but other
    bytes (another Python's standard library) passed it on main, and the run went on with other data."""
    config = tiny(tmp_path, "run", max_steps=8, stop_at=4, eval_every=100)
    train(config)
    corpus = Path(str(config.data))
    text = bytearray(corpus.read_bytes())
    text[len(text) // 3] ^= 1  # the same length, one byte of other content
    corpus.write_bytes(bytes(text))
    with pytest.raises(ResumeError, match=r"resume audit failed: .*trained on a corpus of sha256 .*content changed"):
        train(replace(config, stop_at=None))


def test_a_dcp_save_on_a_full_disk_exits_2_naming_the_errno_and_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On main the error line said ``[enforce fail at inline_container.cc:672] unexpected pos ...``."""
    with small_disk(tmp_path / "disk") as disk:
        config = replace(tiny(tmp_path, "run", max_steps=4, eval_every=100), run_dir=str(disk / "run"))
        config = replace(config, checkpoint_format="dcp", checkpoint_every=2)
        train(replace(config, max_steps=1, run_dir=str(tmp_path / "warm")))  # tokenized outside the small disk
        fill(disk, leave=32 * 1024)  # room for metrics.jsonl, not for a checkpoint
        capsys.readouterr()
        assert main(config_to_argv(config)) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "enforce fail" not in errors[0], errors
        assert f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}" in errors[0], errors[0]
        assert ".tmp-step-00000002/__0_0.distcp" in errors[0], errors[0]
