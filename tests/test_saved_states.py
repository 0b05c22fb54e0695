"""States saved by an earlier release load and resume exactly: the fixtures are kept, not remade.

``tests/fixtures/states/`` holds states written by resumable_data 0.1.0 (main at the commit named in
its ``index.json``) with the next outputs of the run that wrote them. Each test rebuilds the object
with the builders that wrote it (``tests/fixtures/make_states.py``), loads the saved state with
``torch.load(weights_only=True)`` and checks what it yields against both the stored outputs and a
live uninterrupted run. A change that breaks loading an old state, or makes a resume from it yield
anything else, fails here even when the code's own save/load round trip still agrees with itself.

Do not regenerate the fixtures to make this pass: a state format may grow a version, but the states
already written must keep loading.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures import make_states as saved

from resumable_data.rng import capture_rng_state, restore_rng_state
from resumable_data.testing import assert_same

INDEX = json.loads((saved.STATES / saved.INDEX).read_text())


def load(name: str) -> dict[str, Any]:
    return torch.load(saved.STATES / f"{name}.pt", weights_only=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The token shards the fixtures were made from, written again."""
    root = tmp_path_factory.mktemp("shards")
    saved.write_data(root)
    return root


@pytest.fixture
def global_rngs() -> Iterator[None]:
    """Put the global RNGs back as they were: a test here draws from them or restores a saved state."""
    with saved.global_rngs_kept():
        yield


CASES = pytest.mark.parametrize("case", saved.CASES, ids=[case.title for case in saved.CASES])


@CASES
def test_a_state_saved_by_0_1_0_main_resumes_exactly(case: saved.Case, data: Path, global_rngs: None) -> None:
    fixture = load(case.name)
    resumed = saved.resume(case, data, fixture["state"])
    assert_same(fixture["expected"], resumed, f"{case.name}: outputs after loading the saved state, vs the saved run's")
    live = saved.run_to_save_point(case, data)
    if case.same_stream:
        assert_same(live.after, resumed, f"{case.name}: outputs after loading the saved state, vs an uninterrupted run")
    else:
        # A layout change re-deals the rest of the epoch: the same records, each once, with the same
        # per-record draws, in another order (and other batches, so other per-batch global draws).
        assert_same(records(live.after), records(resumed), f"{case.name}: records of the rest of the epoch")


@CASES
def test_a_state_saved_by_0_1_0_main_reads_back_as_saved(case: saved.Case, data: Path) -> None:
    state = load(case.name)["state"]
    obj = (case.resume_into or case.build)(data)
    obj.load_state_dict(state)
    if case.resume_into is not None:
        # Loaded into another layout, the state is re-dealt: that one must round-trip in its layout.
        state = obj.state_dict()
        obj = case.resume_into(data)
        obj.load_state_dict(state)
    assert_same(state, obj.state_dict(), f"{case.name}: state_dict() right after load_state_dict")


def records(batches: list[dict[str, torch.Tensor]]) -> list[tuple[int, list[int], int]]:
    """Every record of a stream loader's batches as (id, tokens, its own generator's draw), by id."""
    rows = [(t, d) for batch in batches for t, d in zip(batch["tokens"], batch["draws"], strict=True)]
    return sorted((int(t[0]), t.tolist(), int(d[0])) for t, d in rows)


def test_a_saved_capture_rng_state_restores_every_global_rng_exactly(global_rngs: None) -> None:
    fixture = load(saved.RNG)
    saved.seed_and_draw()
    uninterrupted = saved.draws()
    saved.seed_and_draw()
    saved.draws()  # move every RNG on, so that only the restore can bring them back
    restore_rng_state(fixture["state"])
    assert_same(fixture["state"], capture_rng_state(), "the RNG state captured right after restoring the saved one")
    resumed = saved.draws()
    assert_same(fixture["expected"], resumed, "draws after restoring the saved RNG state, vs the saved run's")
    assert_same(uninterrupted, resumed, "draws after restoring the saved RNG state, vs an uninterrupted run")


def test_a_checkpoint_folder_saved_by_0_1_0_main_resumes_training_exactly(tmp_path: Path) -> None:
    expected = load(saved.CHECKPOINT_RUN)["expected"]
    run_folder = tmp_path / "run"
    shutil.copytree(saved.STATES / saved.CHECKPOINT_RUN, run_folder)  # the manager takes a lock in it
    resumed_run, resumed = saved.resume_training(run_folder)
    live = saved.train(saved.training(), saved.TRAIN_STEPS)
    after = {key: values[saved.CHECKPOINT_STEP :] for key, values in live.items() if key != "weights"}
    after["weights"] = live["weights"]
    assert_same(after, resumed, "training resumed from the saved checkpoint, vs an uninterrupted run")
    # The data order and the schedule are the library's and plain python: exactly the saved run's.
    for key in ("indices", "lrs"):
        assert_same(expected[key], resumed[key], f"resumed training's {key}, vs the saved run's")
    # Losses and weights went through CPU kernels that may round differently on another CPU (FMA,
    # vector width), so against the run that was saved on another machine they are compared closely,
    # not bitwise; against the live run on this machine (above) they are bitwise.
    torch.testing.assert_close(resumed["losses"], expected["losses"], rtol=1e-9, atol=0)
    torch.testing.assert_close(resumed["weights"], expected["weights"], rtol=1e-9, atol=0)
    assert resumed_run.step == saved.TRAIN_STEPS


def test_the_fixtures_are_the_cases_and_were_made_from_a_commit() -> None:
    names = [case.name for case in saved.CASES] + [saved.RNG, saved.CHECKPOINT_RUN]
    assert list(INDEX["cases"]) == names, "a case without its fixture, or a fixture without its case"
    assert len(INDEX["commit"]) == 40 and INDEX["resumable_data_changed_since_commit"] == []
    on_disk = sorted(p.stem for p in saved.STATES.glob("*.pt"))
    assert on_disk == sorted(names)
    assert [p.name for p in (saved.STATES / saved.CHECKPOINT_RUN).iterdir()] == [f"step-{saved.CHECKPOINT_STEP:08d}"]
