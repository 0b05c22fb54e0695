"""torchtitan's data loader slot: a TitanLoader's state under ``"dataloader"`` survives DCP, at the same or
another data-parallel degree, with every rank's RNGs.

Without torchtitan (in the dev environment): ``torch.distributed.checkpoint`` itself on 2 gloo ranks saves
a TitanLoader over token shards mid-epoch; resumed on 2 ranks every batch and every rank's global-RNG draw
(the dropout a model would draw) is bitwise the uninterrupted run's; resumed on 1 and 3 ranks the rest of
the epoch is read with every record exactly once, and the rank the checkpoint never had is seeded by
``rank_seed``. In process: the refusals, which change nothing.

With torchtitan: torchtitan 0.3 pins ``datasets<4.8``, so it gets a virtual environment of its own
(``overlay_venv``: made once per machine, on top of the dev venv) and its checks
(``torchtitan_checks.py``: its ``CheckpointManager`` saves and loads the loader under ``"dataloader"``,
a SIGKILLed run resumes bitwise, its trainer config builds the loader) run there, in a pytest of their
own, from one test here (with ``--runslow`` passed on: its 2-rank runs are slow ones). Making that
environment takes a minute, so only ``--runslow`` makes it; a default run uses it when it is there
(about 15 s) and otherwise skips, saying how to make it.
"""

from __future__ import annotations

import random
import subprocess
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import overlay_venv
import resumable_data
from dist_harness import finish, init_gloo, results, spawn
from resumable_data import ResumeError
from resumable_data.distributed import DataLoaderState
from resumable_data.integrations.torchtitan import DATALOADER_KEY, TitanLoader, next_token_batch
from resumable_data.rng import capture_rng_state, rank_seed, restore_rng_state, seed_everything
from titan_harness import SEED, assert_each_token_once, seen_by_step, titan_loader, write_data

SAVED_AFTER = 5  # batches per rank before the save: mid-epoch (12 per rank in the epoch at 2 ranks)


def _save_main(rank: int, world_size: int, tmp: str, kind: str) -> None:
    init_gloo(rank, world_size, f"{tmp}/init-save-{kind}")
    titan = titan_loader(tmp, kind, rank=rank, world_size=world_size)
    seed_everything(rank_seed(SEED, rank))
    batches = iter(titan)
    before = [seen_by_step(next(batches)) for _ in range(SAVED_AFTER)]
    # Beside ours, what a loader keyed by rank would write: the same key, a value per rank.
    dcp.save({DATALOADER_KEY: titan, "per_rank": {"rank": f"rank {rank}"}}, checkpoint_id=f"{tmp}/step-{kind}")
    after = [seen_by_step(batch) for batch in batches]  # the uninterrupted run, to the epoch's end
    finish(tmp, f"save-{kind}", rank, {"before": before, "after": after})


def _resume_main(rank: int, world_size: int, tmp: str, kind: str) -> None:
    init_gloo(rank, world_size, f"{tmp}/init-resume{world_size}-{kind}")
    finish(tmp, f"resume{world_size}-{kind}", rank, _resume(tmp, kind, rank, world_size))


def _resume(tmp: str, kind: str, rank: int, world_size: int) -> dict[str, Any]:
    titan = titan_loader(tmp, kind, rank=rank, world_size=world_size)
    seed_everything(1000 + rank)  # RNGs the load must replace
    app = {DATALOADER_KEY: titan, "per_rank": {"rank": ""}}
    dcp.load(app, checkpoint_id=f"{tmp}/step-{kind}")
    return {"steps": [seen_by_step(batch) for batch in titan], "per_rank": app["per_rank"]["rank"]}


@pytest.fixture(scope="module")
def saved() -> Any:
    """A DCP checkpoint of a TitanLoader on 2 gloo ranks, mid-epoch, and both ranks' batches around it."""
    with tempfile.TemporaryDirectory() as tmp:
        write_data(Path(tmp))
        spawn(_save_main, 2, tmp, "shards", timeout=120)
        yield tmp, results(tmp, "save-shards", 2)


@pytest.fixture(scope="module")
def resumed_on_two(saved: Any) -> list[Any]:
    tmp, _ = saved
    spawn(_resume_main, 2, tmp, "shards", timeout=120)
    return results(tmp, "resume2-shards", 2)


# The 2- and 3-rank runs (about 30 s of CI's 2 cores; the default suite holds 5 minutes): --runslow. The
# default suite keeps the 1-rank resume from the same checkpoint and the state's own checks.
@pytest.mark.slow
def test_resumed_on_the_same_ranks_every_batch_and_rng_draw_is_the_uninterrupted_runs(
    saved: Any, resumed_on_two: list[Any]
) -> None:
    _, reference = saved
    resumed = resumed_on_two
    for rank in range(2):
        assert reference[rank]["after"], "the save must be mid-epoch"
        assert resumed[rank]["steps"] == reference[rank]["after"], f"rank {rank} resumed differently"


@pytest.mark.slow
def test_dcp_keeps_one_ranks_value_of_a_key_the_ranks_wrote_different_values_under(resumed_on_two: list[Any]) -> None:
    # Why TitanLoader's keys and values are the same on every rank: DCP writes each key once, silently.
    resumed = resumed_on_two
    assert resumed[0]["per_rank"] == resumed[1]["per_rank"] in ("rank 0", "rank 1")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP without a group
def test_resumed_on_one_rank_the_epoch_is_read_exactly_once_with_rank_zeros_rngs(saved: Any) -> None:
    tmp, reference = saved
    resumed = _resume(tmp, "shards", 0, 1)  # this process, no process group: DCP loads without one
    assert_each_token_once(*(ranks["before"] for ranks in reference), resumed["steps"])
    assert resumed["steps"][0]["rng"] == reference[0]["after"][0]["rng"]  # rank 0's RNGs, restored


@pytest.mark.slow
def test_resumed_on_three_ranks_each_record_once_and_the_new_rank_seeded_by_rank_seed(saved: Any) -> None:
    tmp, reference = saved
    spawn(_resume_main, 3, tmp, "shards", timeout=120)
    resumed = results(tmp, "resume3-shards", 3)
    assert_each_token_once(*(ranks["before"] for ranks in reference), *(r["steps"] for r in resumed))
    for rank in range(2):  # the ranks the checkpoint had get their own RNGs back
        assert resumed[rank]["steps"][0]["rng"] == reference[rank]["after"][0]["rng"]
    before = capture_rng_state()
    try:
        seed_everything(rank_seed(SEED, 2, SAVED_AFTER))  # 5 batches handed out per rank at the save
        expected = [torch.rand(1).item(), random.random(), float(np.random.rand())]
    finally:
        restore_rng_state(before)
    assert resumed[2]["steps"][0]["rng"] == expected


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["shards", "mix"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_mix_of_packed_sources_resumes_bitwise_on_the_same_ranks_and_each_token_once_on_others(
    tmp_path: Path, kind: str, world_size: int
) -> None:
    tmp = str(tmp_path)
    write_data(tmp_path)
    spawn(_save_main, 2, tmp, kind, timeout=120)
    reference = results(tmp, f"save-{kind}", 2)
    spawn(_resume_main, world_size, tmp, kind, timeout=120)
    resumed = results(tmp, f"resume{world_size}-{kind}", world_size)
    assert_each_token_once(*(ranks["before"] for ranks in reference), *(r["steps"] for r in resumed))
    for rank in range(min(2, world_size)):  # a rank the checkpoint had: its RNGs back
        assert resumed[rank]["steps"][0]["rng"] == reference[rank]["after"][0]["rng"]
    if world_size == 2:
        assert [r["steps"] for r in resumed] == [ranks["after"] for ranks in reference]


# -- in process: what the state holds, and refusals that change nothing --------------------------------


@pytest.fixture
def titan(tmp_path: Path) -> TitanLoader:
    write_data(tmp_path)
    return titan_loader(tmp_path)


def test_the_state_has_fixed_keys_whatever_the_number_of_ranks(titan: TitanLoader) -> None:
    batches = iter(titan)
    next(batches)
    state = titan.state_dict()
    assert sorted(state) == ["batches", "data", "rng_per_rank", "version"]
    assert state["batches"] == 1 and isinstance(state["rng_per_rank"], bytes)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: {**s, "version": 99}, "version"),
        (lambda s: {k: v for k, v in s.items() if k != "data"}, "missing the key 'data'"),
        (lambda s: {**s, "batches": -1}, "field 'batches' must be >= 0"),
        (lambda s: {**s, "rng_per_rank": b"not a torch file"}, "'rng_per_rank' cannot be read back"),
        (lambda s: {**s, "data": {**s["data"], "state_json": "{"}}, "not valid JSON"),
        (lambda s: {"dp_rank_0": b"...", "world_size": 2}, "torchtitan's own loader"),
    ],
)
def test_a_refused_state_changes_neither_the_loader_nor_the_rngs(titan: TitanLoader, change: Any, message: str) -> None:
    batches = iter(titan)
    next(batches)
    state = titan.state_dict()
    next(batches)
    loader_before, rng_before = titan.loader.state_dict(), capture_rng_state()
    with pytest.raises(ResumeError, match=message):
        titan.load_state_dict(change(state))
    assert titan.loader.state_dict() == loader_before and titan.batches == 2
    after = capture_rng_state()
    assert torch.equal(after["torch"], rng_before["torch"]) and after["python"] == rng_before["python"]


def test_batches_other_than_token_windows_need_a_to_batch() -> None:
    with pytest.raises(TypeError, match="to_batch="):
        next_token_batch({"input_ids": torch.zeros(2, 3)})


def test_a_loader_without_state_or_a_seed_that_is_not_an_int_is_refused(titan: TitanLoader) -> None:
    with pytest.raises(ResumeError, match="iterable loader with state_dict/load_state_dict"):
        TitanLoader([1, 2], seed=0)  # type: ignore[arg-type]
    with pytest.raises(ResumeError, match="iterable loader"):
        TitanLoader(DataLoaderState(titan.loader), seed=0)  # a Stateful that yields nothing
    with pytest.raises(ResumeError, match="seed should be an int"):
        TitanLoader(titan.loader, seed="7")  # type: ignore[arg-type]


# -- torchtitan's own pieces, in torchtitan's own environment -------------------------------------------------

# torch pinned to the dev venv's version: pip keeps the dev venv's torch instead of fetching another.
TORCHTITAN_REQUIREMENTS = ("torchtitan==0.3.0", f"torch=={torch.__version__.split('+')[0]}")
# What makes the environment usable: torchtitan's pieces import, torch and resumable_data are the dev venv's.
TORCHTITAN_CHECK = f"""
import torch, resumable_data
import torchtitan.components.checkpoint, torchtitan.components.dataloader, torchtitan.components.optimizer
assert torch.__version__ == {torch.__version__!r}, torch.__version__
assert resumable_data.__file__ == {resumable_data.__file__!r}, resumable_data.__file__
"""
CHECKS = Path(__file__).with_name("torchtitan_checks.py")
CHECKS_TIMEOUT_S = 900  # with --runslow: 2-rank runs and a torchrun SIGKILL-and-resume, about 3.5 minutes here


@pytest.fixture(scope="session")
def torchtitan_python(request: pytest.FixtureRequest) -> Path:
    """The interpreter of torchtitan's environment: made here with --runslow, else used if already made."""
    venv = overlay_venv.location("torchtitan", TORCHTITAN_REQUIREMENTS)
    if not overlay_venv.is_ready(venv):
        if not request.config.getoption("--runslow"):
            pytest.skip(
                f"torchtitan's environment is not made on this machine ({venv}): run with --runslow to make it "
                f"(pip install {' '.join(TORCHTITAN_REQUIREMENTS)}, about a minute)"
            )
        try:
            overlay_venv.make(venv, TORCHTITAN_REQUIREMENTS, TORCHTITAN_CHECK)
        except overlay_venv.OverlayError as exc:
            pytest.skip(f"torchtitan's environment cannot be made: {exc}")
    return overlay_venv.python(venv)


def test_torchtitans_checks_pass_in_their_own_environment(
    torchtitan_python: Path, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    report = tmp_path / "checks.xml"
    command = [str(torchtitan_python), "-m", "pytest", str(CHECKS), "-p", "no:cacheprovider", "-n", "0", "-q"]
    command += ["--junitxml", str(report), "--basetemp", str(tmp_path / "inner")]
    if request.config.getoption("--runslow"):
        command.append("--runslow")
    repo = Path(__file__).resolve().parents[2]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=CHECKS_TIMEOUT_S, cwd=repo)
    output = (completed.stdout + completed.stderr)[-6000:]
    assert report.is_file(), f"the checks did not run (exit {completed.returncode}):\n{output}"
    cases = list(ElementTree.parse(report).getroot().iter("testcase"))
    failed = sorted(str(c.get("name")) for c in cases if c.find("failure") is not None or c.find("error") is not None)
    assert not failed and completed.returncode == 0, f"failed in torchtitan's environment: {failed}\n{output}"
    skipped = {str(c.get("name")): c.find("skipped") for c in cases}
    # Only slow checks may skip (without --runslow); torchtitan itself is imported unconditionally there.
    reasons = {name: str(s.get("message")) for name, s in skipped.items() if s is not None}
    assert all("--runslow" in reason for reason in reasons.values()), reasons
    assert len(cases) > len(reasons), f"no check ran:\n{output}"
