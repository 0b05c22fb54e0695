"""torchtitan's data loader slot: a TitanLoader's state under ``"dataloader"`` survives DCP, at the same or
another data-parallel degree, with every rank's RNGs.

Without torchtitan (the default suite): ``torch.distributed.checkpoint`` itself on 2 gloo ranks saves a
TitanLoader over token shards mid-epoch; resumed on 2 ranks every batch and every rank's global-RNG draw
(the dropout a model would draw) is bitwise the uninterrupted run's; resumed on 1 and 3 ranks the rest of
the epoch is read with every record exactly once, and the rank the checkpoint never had is seeded by
``rank_seed``. In process: the refusals, which change nothing.
With torchtitan installed (a virtual environment of its own, see the ``torchtitan`` extra): its
``CheckpointManager`` saves and loads the loader under ``"dataloader"``, and its trainer config builds it.
"""

from __future__ import annotations

import collections
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dist_harness import finish, init_gloo, results, spawn
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader, write_token_shards
from resumable_data.integrations.torchtitan import DATALOADER_KEY, TitanLoader, next_token_batch
from resumable_data.rng import capture_rng_state, rank_seed, restore_rng_state, seed_everything

SEED = 7
WINDOW = 9  # 8 input tokens and their 8 next-token labels per record
RECORDS = 48  # 6 shards of 8 records
BATCH = 2
SAVED_AFTER = 5  # batches per rank before the save: mid-epoch (12 per rank in the epoch at 2 ranks)


def _write_shards(folder: Path) -> str:
    # Token t is t: a record is known by its first token (record i starts at i * WINDOW).
    return write_token_shards([np.arange(RECORDS * WINDOW)], folder, shard_tokens=8 * WINDOW)


def _titan(index: str, *, rank: int = 0, world_size: int = 1) -> TitanLoader:
    stream = ShardedIterable.from_index(index, read_shard=TokenShardReader(WINDOW), seed=SEED).shuffle_buffer(4)
    loader = StreamLoader(stream, batch_size=BATCH, rank=rank, world_size=world_size)
    return TitanLoader(loader, seed=SEED, infinite=False)


def _step(batch: tuple[dict[str, torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """What a training step sees: the batch's records, and the global RNGs' next draws (dropout, say)."""
    inputs, labels = batch
    assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])  # labels are the inputs shifted by one
    return {
        "records": [int(row[0]) // WINDOW for row in inputs["input"]],
        "tokens": inputs["input"].tolist(),
        "rng": [torch.rand(1).item(), random.random(), float(np.random.rand())],
    }


def _save_main(rank: int, world_size: int, tmp: str) -> None:
    init_gloo(rank, world_size, f"{tmp}/init-save")
    titan = _titan(f"{tmp}/tokens", rank=rank, world_size=world_size)
    seed_everything(rank_seed(SEED, rank))
    batches = iter(titan)
    before = [_step(next(batches)) for _ in range(SAVED_AFTER)]
    dcp.save({DATALOADER_KEY: titan}, checkpoint_id=f"{tmp}/step")
    after = [_step(batch) for batch in batches]  # the uninterrupted run, to the epoch's end
    finish(tmp, "save", rank, {"before": before, "after": after})


def _resume_main(rank: int, world_size: int, tmp: str) -> None:
    init_gloo(rank, world_size, f"{tmp}/init-resume{world_size}")
    finish(tmp, f"resume{world_size}", rank, _resume(tmp, rank, world_size))


def _resume(tmp: str, rank: int, world_size: int) -> list[dict[str, Any]]:
    titan = _titan(f"{tmp}/tokens", rank=rank, world_size=world_size)
    seed_everything(1000 + rank)  # RNGs the load must replace
    dcp.load({DATALOADER_KEY: titan}, checkpoint_id=f"{tmp}/step")
    return [_step(batch) for batch in titan]


@pytest.fixture(scope="module")
def saved() -> Any:
    """A DCP checkpoint of a TitanLoader on 2 gloo ranks, mid-epoch, and both ranks' batches around it."""
    with tempfile.TemporaryDirectory() as tmp:
        _write_shards(Path(tmp, "tokens"))
        spawn(_save_main, 2, tmp, timeout=120)
        yield tmp, results(tmp, "save", 2)


def test_resumed_on_the_same_ranks_every_batch_and_rng_draw_is_the_uninterrupted_runs(saved: Any) -> None:
    tmp, reference = saved
    spawn(_resume_main, 2, tmp, timeout=120)
    resumed = results(tmp, "resume2", 2)
    for rank in range(2):
        assert reference[rank]["after"], "the save must be mid-epoch"
        assert resumed[rank] == reference[rank]["after"], f"rank {rank} resumed differently"


def _assert_each_record_once(reference: list[Any], resumed: list[list[dict[str, Any]]]) -> None:
    seen = collections.Counter(
        record
        for steps in [*(ranks["before"] for ranks in reference), *resumed]
        for step in steps
        for record in step["records"]
    )
    assert sorted(seen) == list(range(RECORDS)) and set(seen.values()) == {1}, seen


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP without a group
def test_resumed_on_one_rank_the_epoch_is_read_exactly_once_with_rank_zeros_rngs(saved: Any) -> None:
    tmp, reference = saved
    resumed = _resume(tmp, 0, 1)  # this process, no process group: DCP loads without one
    _assert_each_record_once(reference, [resumed])
    assert resumed[0]["rng"] == reference[0]["after"][0]["rng"]  # rank 0's RNGs, restored


def test_resumed_on_three_ranks_each_record_once_and_the_new_rank_seeded_by_rank_seed(saved: Any) -> None:
    tmp, reference = saved
    spawn(_resume_main, 3, tmp, timeout=120)
    resumed = results(tmp, "resume3", 3)
    _assert_each_record_once(reference, resumed)
    for rank in range(2):  # the ranks the checkpoint had get their own RNGs back
        assert resumed[rank][0]["rng"] == reference[rank]["after"][0]["rng"]
    before = capture_rng_state()
    try:
        seed_everything(rank_seed(SEED, 2, SAVED_AFTER))  # 5 batches handed out per rank at the save
        expected = [torch.rand(1).item(), random.random(), float(np.random.rand())]
    finally:
        restore_rng_state(before)
    assert resumed[2][0]["rng"] == expected


# -- in process: what the state holds, and refusals that change nothing --------------------------------


@pytest.fixture
def titan(tmp_path: Path) -> TitanLoader:
    return _titan(_write_shards(tmp_path / "tokens"))


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
        (lambda s: {**s, "batches": -1}, "'batches' must be a non-negative int"),
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
    with pytest.raises(ResumeError, match="state_dict/load_state_dict"):
        TitanLoader([1, 2], seed=0)  # type: ignore[arg-type]
    with pytest.raises(ResumeError, match="seed should be an int"):
        TitanLoader(titan.loader, seed="7")  # type: ignore[arg-type]
