"""Specifications for CheckpointManager: atomic saves, newest-valid lookup, pruning, async, lock."""

from __future__ import annotations

import collections
import json
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from resumable_data import CheckpointManager, ResumeError
from resumable_data.checkpoint import CheckpointLockedError
from resumable_data.checkpoint import durable as _durable
from resumable_data.testing import assert_same


def make_state(step: int) -> dict[str, Any]:
    """A state shaped like a trainer's: model, optimizer-ish numbers, loader position, RNG bytes."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": collections.OrderedDict(w=torch.randn(4, 3, generator=g), b=torch.zeros(3)),
        "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "betas": (0.9, 0.95)},
        "dataloader": {"version": 1, "epoch": 2, "position": step * 8, "shuffle": True},
        "train_state": {"step": step, "best_val_loss": None, "name": "run"},
        "rng": torch.get_rng_state(),
    }


def steps(manager: CheckpointManager) -> list[int]:
    return [manager.step_of(p) for p in manager.checkpoints()]


def flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def manager(tmp_path: Path):
    with CheckpointManager(tmp_path / "run", keep_last=3) as m:
        yield m


# -- round trip and layout -----------------------------------------------------------------------


def test_round_trip_and_layout(manager: CheckpointManager) -> None:
    state = make_state(7)
    path = manager.save(7, state, metric=0.5)
    assert path == manager.directory / "step-00000007"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "state.pt"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["metric"] == 0.5 and manifest["version"] == 1
    assert manifest["size"] == (path / "state.pt").stat().st_size
    assert len(manifest["sha256"]) == 64 and manifest["library_version"]
    assert manager.latest() == path and manager.best() == path
    assert_same(manager.load(), state, strict_containers=True)
    # A step folder, its payload file, and a name relative to the run folder all load.
    assert_same(manager.load(path / "state.pt"), state, strict_containers=True)
    assert_same(manager.load("step-00000007"), state, strict_containers=True)


def test_payload_loads_with_weights_only(manager: CheckpointManager) -> None:
    state = make_state(3)
    path = manager.save(3, state)
    loaded = torch.load(path / "state.pt", weights_only=True)
    assert_same(loaded, state, strict_containers=True)


def test_module_state_dict_round_trips(manager: CheckpointManager) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    manager.save(1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    loaded = manager.load()
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fresh.load_state_dict(loaded["model"], strict=True)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    fresh_opt.load_state_dict(loaded["optimizer"])
    assert_same(fresh.state_dict(), model.state_dict(), strict_containers=True)


def test_step_of() -> None:
    assert CheckpointManager.step_of("a/step-00001200") == 1200
    assert CheckpointManager.step_of("a/step-00001200/state.pt") == 1200
    assert CheckpointManager.step_of("step-123456789") == 123456789
    with pytest.raises(ResumeError, match="not a checkpoint"):
        CheckpointManager.step_of("a/checkpoint_5.pt")


def test_checkpoints_are_ordered_by_step_not_name(manager: CheckpointManager) -> None:
    for step in (9, 100_000_000, 10):
        manager.save(step, make_state(step))
    assert steps(manager) == [9, 10, 100_000_000]
    assert manager.step_of(manager.latest()) == 100_000_000


def test_saving_an_existing_step_replaces_it(manager: CheckpointManager) -> None:
    manager.save(5, make_state(1))
    manager.save(5, make_state(2))
    assert steps(manager) == [5]
    assert_same(manager.load(), make_state(2), strict_containers=True)


# -- refusing bad input before writing -----------------------------------------------------------


class Opaque:
    pass


@pytest.mark.parametrize(
    ("state", "where"),
    [
        ({"train_state": {"sampler": Opaque()}}, "state['train_state']['sampler']"),
        ({"rng": [1, np.zeros(3)]}, "state['rng'][1]"),
        ({"x": np.float64(1.0)}, "state['x']"),
        ({"x": {Opaque(): 1}}, "state['x']"),
    ],
)
def test_non_weights_only_state_is_refused_before_writing(
    manager: CheckpointManager, state: dict[str, Any], where: str
) -> None:
    with pytest.raises(ResumeError) as info:
        manager.save(1, state)
    assert where in str(info.value)
    assert sorted(p.name for p in manager.directory.iterdir()) == [".lock"]


def test_invalid_arguments(tmp_path: Path, manager: CheckpointManager) -> None:
    with pytest.raises(ResumeError, match="keep_last must be an int >= 2"):
        CheckpointManager(tmp_path / "other", keep_last=1)
    with pytest.raises(ResumeError, match="step must be an int >= 0"):
        manager.save(-1, {})
    with pytest.raises(ResumeError, match="metric must be a float"):
        manager.save(1, {}, metric="low")  # type: ignore[arg-type]
    with pytest.raises(ResumeError, match="no valid checkpoint"):
        manager.load()


# -- atomicity and corruption --------------------------------------------------------------------


def test_crash_leftovers_are_skipped_with_a_warning_and_cleaned(manager: CheckpointManager) -> None:
    good = manager.save(2, make_state(2))
    # A crash mid-write: a temp folder with half a payload, and a step folder with no manifest.
    tmp = manager.directory / ".tmp-step-00000003-deadbeef"
    tmp.mkdir()
    (tmp / "state.pt").write_bytes(b"PK\x03\x04half")
    partial = manager.directory / "step-00000004"
    partial.mkdir()
    (partial / "state.pt").write_bytes((good / "state.pt").read_bytes())

    with pytest.warns(UserWarning, match="step-00000004.*missing manifest"):
        assert manager.latest() == good
    assert manager.checkpoints() == [good]
    with pytest.raises(ResumeError, match=r"step-00000004.*missing manifest"):
        manager.load(partial)

    manager.save(5, make_state(5))
    assert not tmp.exists()
    assert steps(manager) == [2, 5]


def test_failed_write_leaves_no_checkpoint(manager: CheckpointManager, monkeypatch) -> None:
    manager.save(1, make_state(1))

    def crash(state: dict[str, Any], path: Path) -> None:
        path.write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(_durable, "write_payload", crash)
    with pytest.raises(OSError, match="disk full"):
        manager.save(2, make_state(2))
    assert sorted(p.name for p in manager.directory.iterdir()) == [".lock", "step-00000001"]


def test_corrupt_newest_falls_back_to_previous(manager: CheckpointManager) -> None:
    older = manager.save(1, make_state(1))
    newest = manager.save(2, make_state(2))
    flip_byte(newest / "state.pt")
    with pytest.warns(UserWarning, match="step-00000002.*checksum mismatch"):
        assert manager.latest() == older
    with pytest.warns(UserWarning, match="checksum mismatch"):
        assert_same(manager.load(), make_state(1), strict_containers=True)


def test_load_corrupt_or_truncated_path_names_it(manager: CheckpointManager) -> None:
    path = manager.save(1, make_state(1))
    flip_byte(path / "state.pt")
    with pytest.raises(ResumeError, match=r"step-00000001.*checksum mismatch"):
        manager.load(path)

    payload = path / "state.pt"
    payload.write_bytes(payload.read_bytes()[:50])
    with pytest.raises(ResumeError, match=r"step-00000001.*truncated"):
        manager.load(path)
    with pytest.raises(ResumeError, match=r"step-00000001.*not a readable torch checkpoint"):
        manager.load(path, verify=False)
    with pytest.raises(ResumeError, match="no such file"):
        manager.load(manager.directory / "step-00000099")


def test_resaving_a_corrupt_step_replaces_it(manager: CheckpointManager) -> None:
    manager.save(1, make_state(1))
    flip_byte(manager.save(2, make_state(2)) / "state.pt")
    with pytest.warns(UserWarning):
        assert manager.step_of(manager.latest()) == 1
    manager.save(2, make_state(2))  # the run resumed from 1 and reached step 2 again
    assert_same(manager.load(), make_state(2), strict_containers=True)


# -- pruning -------------------------------------------------------------------------------------


def test_keep_last_prunes_but_keeps_best(tmp_path: Path) -> None:
    # NaN first: a diverged metric must never become (or block) the best.
    metrics = {1: float("nan"), 2: 0.1, 3: 0.5, 4: 0.9, 5: None, 6: 0.4}
    with CheckpointManager(tmp_path / "best", keep_last=2) as m:
        for step, metric in metrics.items():
            m.save(step, make_state(step), metric=metric)
            # Never more than keep_last + best, and the newest is always there.
            assert len(m.checkpoints()) <= 3 and steps(m)[-1] == step
        assert steps(m) == [2, 5, 6]
        assert m.step_of(m.best()) == 2
    with CheckpointManager(tmp_path / "nobest", keep_last=2, keep_best=False) as m:
        for step, metric in metrics.items():
            m.save(step, make_state(step), metric=metric)
        assert steps(m) == [5, 6]


def test_pruning_never_deletes_the_checkpoint_just_saved(manager: CheckpointManager) -> None:
    for step in (10, 20, 30):
        manager.save(step, make_state(step))
    manager.save(5, make_state(5))  # the user rewound to an early checkpoint and saved again
    assert 5 in steps(manager)


# -- async ---------------------------------------------------------------------------------------


class SlowWriter:
    """Stands in for the payload writer: blocks until released, and counts concurrent writes."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.active = 0
        self.max_active = 0
        self.lock = threading.Lock()
        self.real = _durable.write_payload

    def __call__(self, state: dict[str, Any], path: Path) -> None:
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        self.entered.set()
        try:
            if not self.release.wait(timeout=10):
                raise TimeoutError("test never released the writer")
            self.real(state, path)
        finally:
            with self.lock:
                self.active -= 1


@pytest.fixture
def slow_writer(monkeypatch) -> SlowWriter:
    writer = SlowWriter()
    monkeypatch.setattr(_durable, "write_payload", writer)
    return writer


def blocks_until_released(writer: SlowWriter, call: Callable[[], Any]) -> Any:
    """Run ``call`` in a thread while the writer is blocked: it must not return before release."""
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(call()))
    thread.start()
    thread.join(timeout=0.2)
    assert thread.is_alive()
    writer.release.set()
    thread.join(timeout=10)
    assert results, "call failed or never returned"
    return results[0]


def test_async_save_returns_before_the_write_and_snapshots_state(tmp_path: Path, slow_writer: SlowWriter) -> None:
    state = make_state(1)
    expected = make_state(1)
    with CheckpointManager(tmp_path / "run", async_save=True) as m:
        path = m.save(1, state)
        assert slow_writer.entered.wait(timeout=10)
        assert not path.exists()  # save() returned while the write is still blocked
        state["model"]["w"].add_(1.0)  # training goes on mutating its tensors
        state["train_state"]["step"] = 99
        slow_writer.release.set()
        m.wait()
        assert path.exists()
        assert_same(m.load(), expected, strict_containers=True)


def test_async_at_most_one_save_in_flight(tmp_path: Path, slow_writer: SlowWriter) -> None:
    with CheckpointManager(tmp_path / "run", async_save=True) as m:
        m.save(1, make_state(1))
        assert slow_writer.entered.wait(timeout=10)
        blocks_until_released(slow_writer, lambda: m.save(2, make_state(2)))
        m.wait()
        assert slow_writer.max_active == 1
        assert steps(m) == [1, 2]


def test_readers_wait_for_the_write_in_flight(tmp_path: Path, slow_writer: SlowWriter) -> None:
    with CheckpointManager(tmp_path / "run", async_save=True) as m:
        m.save(1, make_state(1))
        assert slow_writer.entered.wait(timeout=10)
        # latest() must not race the writer's rename and pruning.
        assert blocks_until_released(slow_writer, m.latest) == m.directory / "step-00000001"


def test_async_files_match_sync_files(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "sync") as m:
        sync_path = m.save(4, make_state(4), metric=1.5)
    with CheckpointManager(tmp_path / "async", async_save=True) as m:
        async_path = m.save(4, make_state(4), metric=1.5)
    assert (sync_path / "state.pt").read_bytes() == (async_path / "state.pt").read_bytes()
    sync_manifest = json.loads((sync_path / "manifest.json").read_text())
    async_manifest = json.loads((async_path / "manifest.json").read_text())
    for manifest in (sync_manifest, async_manifest):
        del manifest["created"], manifest["created_iso"]
    assert sync_manifest == async_manifest


def test_async_keeps_storage_sharing_like_sync(tmp_path: Path) -> None:
    """Tied weights and views stay on one storage in the async copy, as torch.save keeps them."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = torch.nn.Embedding(8, 4)
            self.lm_head = torch.nn.Linear(4, 8, bias=False)
            self.lm_head.weight = self.wte.weight

    torch.manual_seed(0)
    w = torch.randn(4, 4)
    v = torch.arange(6.0)
    state = {
        "a": w,
        "b": w.view(16),
        "c": w[1:],
        "d": w.t(),
        "e": w,  # the same object twice: one tensor when loaded, as with sync
        "v": v,
        "model": Tied().state_dict(),
        "alone": torch.ones(3),
    }
    with CheckpointManager(tmp_path / "sync") as m:
        sync_path = m.save(1, state)
    with CheckpointManager(tmp_path / "async", async_save=True) as m:
        async_path = m.save(1, state)
        # In-place updates once save() returns must not reach the checkpoint being written.
        with torch.no_grad():
            w.add_(100.0)
            state["model"]["wte.weight"].zero_()
            v.fill_(-1.0)
    assert (sync_path / "state.pt").read_bytes() == (async_path / "state.pt").read_bytes()

    def storage_groups(loaded: dict[str, Any]) -> list[list[str]]:
        flat = {k: t for k, t in loaded.items() if k != "model"}
        flat.update({f"model.{k}": t for k, t in loaded["model"].items()})
        groups: dict[int, list[str]] = {}
        for key, t in flat.items():
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(key)
        return sorted(sorted(keys) for keys in groups.values())

    sync_state = torch.load(sync_path / "state.pt", weights_only=True)
    async_state = torch.load(async_path / "state.pt", weights_only=True)
    assert storage_groups(async_state) == storage_groups(sync_state)
    assert ["a", "b", "c", "d", "e"] in storage_groups(async_state)
    assert ["model.lm_head.weight", "model.wte.weight"] in storage_groups(async_state)
    assert async_state["a"] is async_state["e"]
    assert_same(async_state, sync_state, strict_containers=True)
    assert not torch.equal(async_state["a"], w)

    # torch.save refuses one storage viewed as two dtypes; async copies each dtype apart, as before.
    with CheckpointManager(tmp_path / "dtypes", async_save=True) as m:
        path = m.save(1, {"v": v, "bits": v.view(torch.int32)})
    loaded = torch.load(path / "state.pt", weights_only=True)
    assert torch.equal(loaded["v"], v) and torch.equal(loaded["bits"], v.view(torch.int32))


def test_async_error_is_reraised_on_next_call(tmp_path: Path, monkeypatch) -> None:
    def fail(state: dict[str, Any], path: Path) -> None:
        raise OSError("disk full")

    m = CheckpointManager(tmp_path / "run", async_save=True)
    monkeypatch.setattr(_durable, "write_payload", fail)
    m.save(1, make_state(1))  # returns; the failure happens in the background
    with pytest.raises(OSError, match="disk full"):
        m.save(2, make_state(2))
    m.save(3, make_state(3))
    with pytest.raises(OSError, match="disk full"):
        m.wait()
    m.save(4, make_state(4))
    with pytest.raises(OSError, match="disk full"):
        m.close()
    # close() released the lock even though it raised.
    CheckpointManager(tmp_path / "run").close()


# -- lock ----------------------------------------------------------------------------------------


def test_second_manager_on_the_same_folder_is_refused(tmp_path: Path) -> None:
    first = CheckpointManager(tmp_path / "run")
    with pytest.raises(CheckpointLockedError) as info:
        CheckpointManager(tmp_path / "run")
    message = str(info.value)
    assert str(tmp_path / "run") in message and f"pid {os.getpid()}" in message
    assert isinstance(info.value, ResumeError)
    first.close()
    first.close()  # idempotent
    CheckpointManager(tmp_path / "run").close()  # released on close
    # lock=False opts out.
    with CheckpointManager(tmp_path / "run", lock=False) as a:
        CheckpointManager(a.directory, lock=False).close()


def test_closed_manager_refuses_to_save(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run") as m:
        pass
    with pytest.raises(ResumeError, match="closed"):
        m.save(1, {})


def test_no_warnings_on_a_clean_folder(manager: CheckpointManager) -> None:
    manager.save(1, make_state(1), metric=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert manager.latest() is not None and manager.best() is not None
