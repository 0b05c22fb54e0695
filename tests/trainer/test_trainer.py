"""The trainer's promise: a run interrupted anywhere and resumed equals one never interrupted, bitwise.

Each exactness test trains a tiny model (dropout on, so the RNG restore matters) once straight
through and once stopped and resumed, then compares every step's loss and the whole final
checkpoint: model, optimizer, scheduler, loader position, RNG states, train state.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint import stateful as torch_stateful

import resumable_data
from helpers.trainer_runs import TINY, final_checkpoint, text_corpus, tiny
from resumable_data import CheckpointManager, ResumeError
from resumable_data.checkpoint import CheckpointLockedError
from resumable_data.testing import assert_same
from system.verify import config_to_argv, verify_resume
from trainer.__main__ import main
from trainer.checkpointing import CHECKPOINT_FOLDER, CHECKPOINT_KEYS
from trainer.config import TrainConfig
from trainer.data import TokenWindows, prepare_data
from trainer.metrics import read_metrics
from trainer.plot import plot_run
from trainer.train import TrainResult, train
from trainer.train_state import TrainState

REPO = Path(__file__).resolve().parents[2]
# A tiny corpus of real text: with block 16 and batch 4 an epoch is 14 steps, so runs of 20 steps
# cross an epoch boundary in well under a second.
CORPUS_BYTES = 1000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("corpus"), CORPUS_BYTES)


def scramble_global_rngs() -> None:
    """What a fresh process would have: global RNGs somewhere else entirely."""
    random.seed(12345)
    np.random.seed(12345)
    torch.manual_seed(12345)


def assert_resumes_identically(
    tmp_path: Path, corpus: Path, stops: Sequence[int], resumed_with: dict[str, Any] | None = None, **overrides: Any
) -> list[TrainResult]:
    """Train straight through, then stopped at each of ``stops`` and resumed; compare bitwise.

    Args:
        resumed_with: settings that differ in the legs after the first (e.g. num_workers).
        overrides: settings of every run.

    Returns:
        The legs of the interrupted run.
    """
    reference = train(tiny(tmp_path, "reference", data=corpus, **overrides))
    legs = []
    for stop in [*stops, None]:
        scramble_global_rngs()
        settings = {**overrides, **(resumed_with or {})} if legs else overrides
        legs.append(train(tiny(tmp_path, "interrupted", data=corpus, stop_at=stop, **settings)))
        expected_step = stop if stop is not None else reference.step
        assert legs[-1].step == expected_step
    for previous, leg in itertools.pairwise(legs):
        assert leg.resumed_from is not None and CheckpointManager.step_of(leg.resumed_from) == previous.step

    losses = {step: loss for leg in legs for step, loss in leg.losses.items()}
    assert_same(reference.losses, losses, "losses")  # every step, floats compared bit for bit
    assert_same(reference.val_losses, {s: v for leg in legs for s, v in leg.val_losses.items()}, "val_losses")
    assert_same(final_checkpoint(reference.run_dir), final_checkpoint(legs[-1].run_dir), "final checkpoint")
    return legs


def steps_per_epoch(tmp_path: Path, corpus: Path) -> int:
    data = prepare_data(corpus, tmp_path / "cache")
    return len(TokenWindows(data.train, TINY["block_size"])) // TINY["batch_size"]


# -- exact resume ------------------------------------------------------------------------------


@pytest.mark.slow  # the default suite keeps the workers and SIGKILL resumes
def test_resume_mid_epoch(tmp_path: Path, corpus: Path) -> None:
    assert steps_per_epoch(tmp_path, corpus) > 5
    assert_resumes_identically(tmp_path, corpus, [5])


@pytest.mark.slow  # the default suite keeps the workers and SIGKILL resumes (and the loaders' epoch-boundary tests)
def test_resume_at_epoch_boundary(tmp_path: Path, corpus: Path) -> None:
    epoch_end = steps_per_epoch(tmp_path, corpus)
    assert epoch_end < TINY["max_steps"]  # the next epoch is compared too
    legs = assert_resumes_identically(tmp_path, corpus, [epoch_end])
    epochs = {e["step"]: e["epoch"] for e in read_metrics(legs[0].run_dir) if e["event"] == "step"}
    assert (epochs[epoch_end], epochs[epoch_end + 1]) == (0, 1)  # stopped on the last batch of epoch 0


@pytest.mark.slow  # the default suite keeps the workers and SIGKILL resumes
def test_resume_right_after_an_evaluation(tmp_path: Path, corpus: Path) -> None:
    legs = assert_resumes_identically(tmp_path, corpus, [TINY["eval_every"]])
    assert TINY["eval_every"] in legs[0].val_losses


@pytest.mark.slow  # the default suite keeps the workers and SIGKILL resumes
def test_resume_with_gradient_accumulation(tmp_path: Path, corpus: Path) -> None:
    assert_resumes_identically(tmp_path, corpus, [5], grad_accum=3, max_steps=12)


@pytest.mark.slow  # the default suite keeps the workers and SIGKILL resumes
def test_resume_several_times_in_a_row(tmp_path: Path, corpus: Path) -> None:
    assert_resumes_identically(tmp_path, corpus, [3, 4, 11, 17])


def test_resume_with_a_different_number_of_workers(tmp_path: Path, corpus: Path) -> None:
    """Worker processes prefetch batches; the position counts only those handed to the loop."""
    assert_resumes_identically(tmp_path, corpus, [5], resumed_with={"num_workers": 0}, num_workers=2, max_steps=10)


def test_sigkill_in_a_subprocess_resumes_identically(tmp_path: Path, corpus: Path) -> None:
    config = tiny(tmp_path, "verify", data=corpus, max_steps=12)
    assert verify_resume(config, kill_at_step=7)  # checkpoints at 4 and 6: step 7 is replayed from 6


# -- finding and refusing checkpoints -----------------------------------------------------------


def corrupt(checkpoint: Path) -> None:
    """Flip bytes in the middle of the payload, keeping its size (only the checksum can tell)."""
    payload = checkpoint / "state.pt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(16)
    payload.write_bytes(bytes(data))


@pytest.mark.slow  # tests/checkpoint/test_faults.py and tests/trainer/test_chaos.py cover falling back in the default suite
def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, corpus: Path) -> None:
    reference = train(tiny(tmp_path, "reference", data=corpus))
    first = train(tiny(tmp_path, "run", data=corpus, stop_at=8))  # checkpoints at 6 (eval) and 8
    corrupt(Path(first.run_dir) / CHECKPOINT_FOLDER / "step-00000008")
    with pytest.warns(UserWarning, match="skipping checkpoint .*step-00000008"):
        second = train(tiny(tmp_path, "run", data=corpus))
    assert second.resumed_from is not None and CheckpointManager.step_of(second.resumed_from) == 6
    assert_same(reference.losses, {**first.losses, **second.losses}, "losses")
    assert_same(final_checkpoint(reference.run_dir), final_checkpoint(second.run_dir), "final checkpoint")


def test_resume_path_to_a_corrupt_checkpoint_is_a_clear_error(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = train(tiny(tmp_path, "run", data=corpus, stop_at=4))
    target = Path(first.run_dir) / CHECKPOINT_FOLDER / "step-00000004"
    corrupt(target)
    config = tiny(tmp_path, "run", data=corpus, resume=str(target))
    with pytest.raises(ResumeError, match=r"step-00000004.*checksum mismatch"):
        train(config)
    # The command line says the same in one line, with exit code 2.
    argv = [
        "train",
        "--run-dir",
        config.run_dir,
        "--data",
        str(corpus),
        "--cache-dir",
        str(config.cache_dir),
        "--resume",
        str(target / "state.pt"),
        "--no-progress",
    ]
    assert main(argv) == 2
    assert "error: cannot load checkpoint" in capsys.readouterr().err
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ResumeError, match=r"garbage.pt is not a checkpoint"):
        train(replace(config, resume=str(garbage)))


def test_second_trainer_on_a_run_folder_refuses_and_sigterm_saves(tmp_path: Path, corpus: Path) -> None:
    config = tiny(tmp_path, "run", data=corpus, max_steps=100_000, eval_every=1000, checkpoint_every=1000)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(
        [sys.executable, "-m", "trainer", "train", *config_to_argv(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(e["event"] == "step" for e in _events(config.run_dir)):
            assert first.poll() is None and time.monotonic() < deadline, "the first trainer did not start"
            time.sleep(0.1)
        with pytest.raises(CheckpointLockedError, match=f"locked by pid {first.pid}"):
            train(config)
        first.send_signal(signal.SIGTERM)
        output, _ = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == 0, output
    assert "stopped by SIGTERM" in output
    last_step = max(e["step"] for e in read_metrics(config.run_dir) if e["event"] == "step")
    resumed = train(replace(config, stop_at=last_step + 2))
    assert resumed.resumed_from is not None and CheckpointManager.step_of(resumed.resumed_from) == last_step


def _events(run_dir: str) -> list[dict[str, Any]]:
    return read_metrics(run_dir) if (Path(run_dir) / "metrics.jsonl").is_file() else []


def test_resume_never_refuses_a_folder_with_checkpoints(tmp_path: Path, corpus: Path) -> None:
    train(tiny(tmp_path, "run", data=corpus, stop_at=4))
    with pytest.raises(ResumeError, match=r"--resume never, but .* already holds checkpoints"):
        train(tiny(tmp_path, "run", data=corpus, resume="never"))


def test_architecture_comes_from_the_checkpoint_and_a_conflicting_flag_is_an_error(
    tmp_path: Path, corpus: Path
) -> None:
    first = train(tiny(tmp_path, "run", data=corpus, stop_at=4))
    # Architecture flags left unset: the checkpoint's are used.
    unset = dict.fromkeys(("n_layer", "n_head", "n_embd", "block_size", "dropout"))
    assert train(tiny(tmp_path, "run", data=corpus, stop_at=5, **unset)).resumed_from is not None
    with pytest.raises(ResumeError, match=r"--n-embd 32 \(checkpoint: 16\)"):
        train(tiny(tmp_path, "run", data=corpus, n_embd=32))
    assert first.step == 4


def test_resume_audit_catches_a_changed_schedule_data_order_or_weight_decay(tmp_path: Path, corpus: Path) -> None:
    train(tiny(tmp_path, "run", data=corpus, stop_at=5))
    with pytest.raises(ResumeError, match=r"resume audit failed.*learning rate"):
        train(tiny(tmp_path, "run", data=corpus, max_steps=30))
    with pytest.raises(ResumeError, match=r"resume audit failed.*next batch"):
        train(tiny(tmp_path, "run", data=corpus, grad_accum=2))
    # The restored optimizer would quietly keep the old value (found in review: no error, no effect).
    with pytest.raises(ResumeError, match=r"resume audit failed.*weight decay 0.1.*--weight-decay 0.3"):
        train(tiny(tmp_path, "run", data=corpus, weight_decay=0.3))
    ok = train(tiny(tmp_path, "run", data=corpus))
    assert any(e["event"] == "resume" and e["audit"] == "ok" for e in read_metrics(ok.run_dir))


def test_a_train_state_without_the_batch_layout_is_refused_before_anything_is_built(
    tmp_path: Path, corpus: Path
) -> None:
    """Trainer 0.1.0 wrote train_state version 1 without world_size, batch_size and grad_accum."""
    train(tiny(tmp_path, "run", data=corpus, stop_at=4))
    with CheckpointManager(tmp_path / "run" / CHECKPOINT_FOLDER, lock=False) as manager:
        old = manager.load()
        for key in ("world_size", "batch_size", "grad_accum"):
            del old["train_state"][key]
        manager.save(5, old)
    with pytest.raises(ResumeError, match=r"train_state lacks \['world_size', 'batch_size', 'grad_accum'\].*0\.1\.0"):
        train(tiny(tmp_path, "run", data=corpus))
    assert not any(e["event"] == "start" and e["step"] == 5 for e in read_metrics(tmp_path / "run"))


# -- the train state ----------------------------------------------------------------------------

TRAIN_STATE = {
    "version": 1,
    "step": 6,
    "tokens_seen": 384,
    "best_val_loss": 2.5,
    "world_size": 2,
    "batch_size": 4,
    "grad_accum": 3,
}


def test_train_state_round_trips_and_takes_the_checkpoints_batch_layout() -> None:
    state = TrainState(world_size=1, batch_size=8, grad_accum=1)
    assert isinstance(state, resumable_data.Stateful) and isinstance(state, torch_stateful.Stateful)
    state.load_state_dict(TRAIN_STATE)
    assert state == TrainState(world_size=2, batch_size=4, grad_accum=3, step=6, tokens_seen=384, best_val_loss=2.5)
    assert state.state_dict() == TRAIN_STATE
    fresh = TrainState(world_size=1, batch_size=8, grad_accum=1).state_dict()
    assert fresh["step"] == fresh["tokens_seen"] == 0 and fresh["best_val_loss"] == float("inf")


@given(
    key=st.sampled_from(sorted(TRAIN_STATE)),
    value=st.one_of(
        st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=3), st.just([1])
    ),
)
def test_a_bad_train_state_is_refused_by_name_and_changes_nothing(key: str, value: Any) -> None:
    """Any one key replaced by any value: it loads only when the value is valid for that key;
    otherwise a ResumeError names the key (or the version) and the state is unchanged."""
    bad = {**TRAIN_STATE, key: value}
    state = TrainState(world_size=1, batch_size=8, grad_accum=1)
    before = state.state_dict()
    minimum = {"step": 0, "tokens_seen": 0, "world_size": 1, "batch_size": 1, "grad_accum": 1}
    if key == "version":
        valid = type(value) is int and value == 1
    elif key == "best_val_loss":
        valid = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    else:
        valid = type(value) is int and value >= minimum[key]
    if valid:
        state.load_state_dict(bad)
        assert state.state_dict()[key] == value
        return
    with pytest.raises(ResumeError, match=rf"train_state.*{key}"):
        state.load_state_dict(bad)
    assert state.state_dict() == before
    with pytest.raises(ResumeError, match=r"lacks \['step'\]"):
        state.load_state_dict({k: v for k, v in TRAIN_STATE.items() if k != "step"})
    assert state.state_dict() == before


# -- data ---------------------------------------------------------------------------------------


def test_data_folder_is_read_in_order_without_hidden_files_and_cached(tmp_path: Path) -> None:
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_bytes(b"b" * 300)
    (folder / "sub" / "a.txt").write_bytes(b"a" * 300)
    (folder / ".notes").write_bytes(b"x" * 300)
    data = prepare_data(folder, tmp_path / "cache")
    assert data.train.read_bytes() + data.val.read_bytes() == b"b" * 300 + b"\n" + b"a" * 300 + b"\n"
    assert prepare_data(folder, tmp_path / "cache") == data  # built once
    (folder / "b.txt").write_bytes(b"c" * 300)  # same size: the modification time tells
    os.utime(folder / "b.txt", ns=(0, 10**9))
    assert prepare_data(folder, tmp_path / "cache").train.read_bytes().startswith(b"c" * 300)


def test_token_windows_are_non_overlapping_and_shifted_by_one(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    path.write_bytes(bytes(range(50)))
    windows = TokenWindows(path, block_size=16)
    assert len(windows) == 3  # 49 targets: three full windows
    x, y = windows[1]
    assert x.tolist() == list(range(16, 32)) and y.tolist() == list(range(17, 33))
    with pytest.raises(IndexError):
        windows[3]


# -- what a checkpoint holds, and what a person sees ----------------------------------------------


def test_checkpoint_layout(tmp_path: Path, corpus: Path) -> None:
    result = train(tiny(tmp_path, "run", data=corpus, stop_at=6))
    path = Path(result.run_dir) / CHECKPOINT_FOLDER / "step-00000006" / "state.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert tuple(state) == CHECKPOINT_KEYS
    # The step-0 evaluation is a baseline only: "best" is among evaluations that have a checkpoint.
    assert state["train_state"] == {
        "version": 1,
        "step": 6,
        "tokens_seen": 6 * 4 * 16,
        "best_val_loss": result.val_losses[6],
        "world_size": 1,
        "batch_size": 4,
        "grad_accum": 1,  # the layout an elastic resume starts from
    }
    assert state["model_config"] == {
        "vocab_size": 256,
        "block_size": 16,
        "n_layer": 1,
        "n_head": 2,
        "n_embd": 16,
        "dropout": 0.1,
    }
    assert state["dataloader"]["position"] == 6 * 4 and state["dataloader"]["epoch"] == 0
    assert set(state["audit"]) == {"next_batch", "next_lr", "data_sha256"}
    assert isinstance(state["library_version"], str)


def test_default_run_loss_falls(tmp_path: Path) -> None:
    """The default corpus (Python's own source) and the default schedule, on a tiny model."""
    config = TrainConfig(
        run_dir=str(tmp_path / "run"),
        cache_dir=str(tmp_path / "cache"),
        progress=False,
        n_layer=1,
        n_embd=32,
        n_head=2,
        block_size=32,
        batch_size=8,
        max_steps=40,
        warmup_steps=5,
        eval_every=20,
    )
    result = train(config)
    first, last = result.val_losses[0], result.val_losses[40]
    assert last < first - 1.0, f"val loss went from {first:.3f} to {last:.3f}"


def test_plot_marks_resume_points(tmp_path: Path, corpus: Path) -> None:
    train(tiny(tmp_path, "run", data=corpus, stop_at=5))
    train(tiny(tmp_path, "run", data=corpus))
    path = plot_run(tmp_path / "run")
    assert path.stat().st_size > 10_000
    assert [e["step"] for e in read_metrics(tmp_path / "run") if e["event"] == "resume"] == [5]
