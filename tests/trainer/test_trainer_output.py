"""What a person running the trainer sees: a line while the corpus is built, a resume line that says
where the run continues, a progress bar drawn once per step at a fixed width (also in a terminal that
reports no width), and one way of printing the learning rate."""

from __future__ import annotations

import collections
import os
import re
import select
import sys
from pathlib import Path

import pytest

from helpers.trainer_runs import text_corpus, tiny
from trainer.config import TrainConfig
from trainer.data import prepare_data
from trainer.metrics import FALLBACK_COLUMNS, Progress, format_lr, read_metrics
from trainer.train import train

# The TINY run for 8 steps with no evaluation or checkpoint on the way (FRAME reads "/8").
EIGHT_STEPS = {"max_steps": 8, "eval_every": 100, "checkpoint_every": 100}
FRAME = re.compile(r"(\d+)/8 \[.*loss=\s*(\S+), lr=\s*(\S+), tok/s=\s*(\S+)\]")


def eight_steps(tmp_path: Path, **overrides: object) -> TrainConfig:
    return tiny(tmp_path, "run", data=text_corpus(tmp_path, 1000), **{**EIGHT_STEPS, **overrides})


def test_the_first_build_of_the_corpus_says_what_it_is_doing_and_a_cached_one_says_nothing(tmp_path: Path) -> None:
    corpus = tmp_path / "text.txt"
    corpus.write_bytes(b"some text\n" * 100)
    said: list[str] = []
    prepare_data(corpus, tmp_path / "cache", said.append)
    assert len(said) == 2
    assert said[0].startswith(f"tokenizing 1 files of {corpus} into {tmp_path / 'cache'}")
    assert re.fullmatch(r"tokenized: .*: 1 files, 901 train bytes, 100 val bytes in \d+\.\d s", said[1])
    prepare_data(corpus, tmp_path / "cache", said.append)
    assert len(said) == 2


def test_the_resume_line_says_where_the_run_continues_and_the_bar_draws_each_step_once_at_one_width(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The resume line names the step, the epoch and the batch, and the next learning rate printed as
    the bar prints it (no bare fingerprint: the hash of the next batch is for the audit, not for
    people). Every frame of the bar pairs a step count with that step's loss and learning rate (never
    the new loss beside the old count), no step is drawn twice but the last (redrawn under the final
    messages and when the bar closes), and all frames are equally wide, the first (no values yet) too."""
    train(eight_steps(tmp_path, stop_at=5))
    capsys.readouterr()
    result = train(eight_steps(tmp_path, progress=True))
    captured = capsys.readouterr()
    lrs = {e["step"]: e["lr"] for e in read_metrics(tmp_path / "run") if e["event"] == "step"}
    [line] = [line for line in captured.out.splitlines() if line.startswith("resuming at")]
    assert line == (
        "resuming at step 5: epoch 0, 5 of 14 batches done; the next step's batch indices and learning rate "
        f"{format_lr(lrs[6])} match what the checkpoint recorded"
    )
    frames = [frame.rstrip("\n") for frame in captured.err.split("\r") if "/8 [" in frame]
    drawn = [m for m in map(FRAME.search, frames) if m and m[1] != "5"]  # 5: the first frame, values not yet known
    assert drawn and all(n == 1 for step, n in collections.Counter(int(m[1]) for m in drawn).items() if step != 8)
    for m in drawn:
        assert (m[2], m[3]) == (f"{result.losses[int(m[1])]:.4f}", format_lr(lrs[int(m[1])]))
    assert {len(frame) for frame in frames} == {FALLBACK_COLUMNS}  # not a terminal: the fallback width


def test_a_terminal_that_reports_no_width_still_gets_a_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new pseudo-terminal reports 0 columns, as some containers and CI runners do; tqdm's own
    width detection then draws nothing at all."""
    master, replica = os.openpty()
    with open(replica, "w") as terminal:
        assert os.get_terminal_size(terminal.fileno()).columns == 0
        monkeypatch.setattr(sys, "stderr", terminal)
        with Progress(3, 0, enabled=True) as bar:
            bar.update(1, 2.5, 3e-3, 1234.0)
        terminal.flush()
        drawn = b""
        while select.select([master], [], [], 0.5)[0]:  # the terminal passes the output on in pieces
            drawn += os.read(master, 1 << 16)
    os.close(master)
    assert "1/3 [" in drawn.decode() and "loss= 2.5000, lr=3.000e-03, tok/s=    1,234]" in drawn.decode()
