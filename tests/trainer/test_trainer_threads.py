"""The trainer's ``--threads``: one intra-op thread by default, carried to the runs it starts.

verify-resume (``tests/system/``) starts ``python -m trainer train`` children; they read the count
from ``$TRAINER_THREADS``, so a parent's ``--threads`` reaches them and both runs compute alike.
"""

from __future__ import annotations

import pytest
import torch

from system import cli
from trainer.__main__ import DEFAULT_THREADS, THREADS_ENV, _parser, main


@pytest.fixture()
def keep_threads(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    before = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(before)


def test_default_is_one_thread_and_the_environment_overrides_it(keep_threads) -> None:
    assert DEFAULT_THREADS == 1
    assert _parser().parse_args(["train"]).threads == 1
    assert cli._parser().parse_args(["verify-resume"]).threads == 1
    keep_threads.setenv(THREADS_ENV, "2")
    assert _parser().parse_args(["train"]).threads == 2
    assert _parser().parse_args(["train", "--threads", "3"]).threads == 3


def test_negative_thread_count_is_refused_before_training(keep_threads, tmp_path, capsys) -> None:
    assert main(["train", "--threads", "-1", "--run-dir", str(tmp_path / "run")]) == 2
    assert "--threads should be >= 0, but got --threads -1" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
