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
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dist_harness import finish, init_gloo, results, spawn
from integrations_harness import kill_and_resume
from resumable_data import ResumeError
from resumable_data.distributed import DataLoaderState
from resumable_data.integrations.torchtitan import DATALOADER_KEY, TitanLoader, dataloader_config, next_token_batch
from resumable_data.rng import capture_rng_state, rank_seed, restore_rng_state, seed_everything
from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader, mix, write_token_shards

SEED = 7
WINDOW = 9  # 8 input tokens and their 8 next-token labels per record
TOKENS = 432  # token t is t, so every token of the epoch is known: 48 records of WINDOW tokens
BATCH = 2
SAVED_AFTER = 5  # batches per rank before the save: mid-epoch (12 per rank in the epoch at 2 ranks)
PAD = 65535  # pack's padding of a slot's last window (no token is PAD)


def _write_data(folder: Path) -> str:
    """One index of 6 shards for "shards"; for "mix", two sources of half the tokens each."""
    write_token_shards([np.arange(TOKENS // 2)], folder / "mix-a", shard_tokens=36)
    write_token_shards([np.arange(TOKENS // 2, TOKENS)], folder / "mix-b", shard_tokens=36)
    return write_token_shards([np.arange(TOKENS)], folder / "tokens", shard_tokens=8 * WINDOW)


def _titan(folder: str | Path, kind: str = "shards", *, rank: int = 0, world_size: int = 1) -> TitanLoader:
    """A loader over token shards, shuffled through a buffer; or over a mix of two sets of shards of
    6-token records, packed into windows of WINDOW tokens (a window ends inside a record)."""
    if kind == "shards":
        reader = TokenShardReader(WINDOW)
        stream = ShardedIterable.from_index(f"{folder}/tokens", read_shard=reader, seed=SEED).shuffle_buffer(4)
    else:
        sources = [
            ShardedIterable.from_index(f"{folder}/mix-{s}", read_shard=TokenShardReader(6), seed=SEED) for s in "ab"
        ]
        stream = mix(sources, weights=[1, 2], seed=SEED).pack(WINDOW, pad_id=PAD)
    loader = StreamLoader(stream, batch_size=BATCH, rank=rank, world_size=world_size)
    return TitanLoader(loader, seed=SEED, infinite=False)


def _step(batch: tuple[dict[str, torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """What a training step sees: the batch's tokens, and the global RNGs' next draws (dropout, say)."""
    inputs, labels = batch
    assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])  # labels are the inputs shifted by one
    return {
        "tokens": torch.cat([inputs["input"], labels[:, -1:]], dim=1).tolist(),
        "rng": [torch.rand(1).item(), random.random(), float(np.random.rand())],
    }


def _assert_each_token_once(*runs: list[dict[str, Any]]) -> None:
    seen = collections.Counter(t for steps in runs for step in steps for row in step["tokens"] for t in row if t != PAD)
    assert sorted(seen) == list(range(TOKENS)) and set(seen.values()) == {1}, seen


def _save_main(rank: int, world_size: int, tmp: str, kind: str) -> None:
    init_gloo(rank, world_size, f"{tmp}/init-save-{kind}")
    titan = _titan(tmp, kind, rank=rank, world_size=world_size)
    seed_everything(rank_seed(SEED, rank))
    batches = iter(titan)
    before = [_step(next(batches)) for _ in range(SAVED_AFTER)]
    # Beside ours, what a loader keyed by rank would write: the same key, a value per rank.
    dcp.save({DATALOADER_KEY: titan, "per_rank": {"rank": f"rank {rank}"}}, checkpoint_id=f"{tmp}/step-{kind}")
    after = [_step(batch) for batch in batches]  # the uninterrupted run, to the epoch's end
    finish(tmp, f"save-{kind}", rank, {"before": before, "after": after})


def _resume_main(rank: int, world_size: int, tmp: str, kind: str) -> None:
    init_gloo(rank, world_size, f"{tmp}/init-resume{world_size}-{kind}")
    finish(tmp, f"resume{world_size}-{kind}", rank, _resume(tmp, kind, rank, world_size))


def _resume(tmp: str, kind: str, rank: int, world_size: int) -> dict[str, Any]:
    titan = _titan(tmp, kind, rank=rank, world_size=world_size)
    seed_everything(1000 + rank)  # RNGs the load must replace
    app = {DATALOADER_KEY: titan, "per_rank": {"rank": ""}}
    dcp.load(app, checkpoint_id=f"{tmp}/step-{kind}")
    return {"steps": [_step(batch) for batch in titan], "per_rank": app["per_rank"]["rank"]}


@pytest.fixture(scope="module")
def saved() -> Any:
    """A DCP checkpoint of a TitanLoader on 2 gloo ranks, mid-epoch, and both ranks' batches around it."""
    with tempfile.TemporaryDirectory() as tmp:
        _write_data(Path(tmp))
        spawn(_save_main, 2, tmp, "shards", timeout=120)
        yield tmp, results(tmp, "save-shards", 2)


@pytest.fixture(scope="module")
def resumed_on_two(saved: Any) -> list[Any]:
    tmp, _ = saved
    spawn(_resume_main, 2, tmp, "shards", timeout=120)
    return results(tmp, "resume2-shards", 2)


def test_resumed_on_the_same_ranks_every_batch_and_rng_draw_is_the_uninterrupted_runs(
    saved: Any, resumed_on_two: list[Any]
) -> None:
    _, reference = saved
    resumed = resumed_on_two
    for rank in range(2):
        assert reference[rank]["after"], "the save must be mid-epoch"
        assert resumed[rank]["steps"] == reference[rank]["after"], f"rank {rank} resumed differently"


def test_dcp_keeps_one_ranks_value_of_a_key_the_ranks_wrote_different_values_under(resumed_on_two: list[Any]) -> None:
    # Why TitanLoader's keys and values are the same on every rank: DCP writes each key once, silently.
    resumed = resumed_on_two
    assert resumed[0]["per_rank"] == resumed[1]["per_rank"] in ("rank 0", "rank 1")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP without a group
def test_resumed_on_one_rank_the_epoch_is_read_exactly_once_with_rank_zeros_rngs(saved: Any) -> None:
    tmp, reference = saved
    resumed = _resume(tmp, "shards", 0, 1)  # this process, no process group: DCP loads without one
    _assert_each_token_once(*(ranks["before"] for ranks in reference), resumed["steps"])
    assert resumed["steps"][0]["rng"] == reference[0]["after"][0]["rng"]  # rank 0's RNGs, restored


def test_resumed_on_three_ranks_each_record_once_and_the_new_rank_seeded_by_rank_seed(saved: Any) -> None:
    tmp, reference = saved
    spawn(_resume_main, 3, tmp, "shards", timeout=120)
    resumed = results(tmp, "resume3-shards", 3)
    _assert_each_token_once(*(ranks["before"] for ranks in reference), *(r["steps"] for r in resumed))
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
    _write_data(tmp_path)
    spawn(_save_main, 2, tmp, kind, timeout=120)
    reference = results(tmp, f"save-{kind}", 2)
    spawn(_resume_main, world_size, tmp, kind, timeout=120)
    resumed = results(tmp, f"resume{world_size}-{kind}", world_size)
    _assert_each_token_once(*(ranks["before"] for ranks in reference), *(r["steps"] for r in resumed))
    for rank in range(min(2, world_size)):  # a rank the checkpoint had: its RNGs back
        assert resumed[rank]["steps"][0]["rng"] == reference[rank]["after"][0]["rng"]
    if world_size == 2:
        assert [r["steps"] for r in resumed] == [ranks["after"] for ranks in reference]


# -- in process: what the state holds, and refusals that change nothing --------------------------------


@pytest.fixture
def titan(tmp_path: Path) -> TitanLoader:
    _write_data(tmp_path)
    return _titan(tmp_path)


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


# -- torchtitan's own CheckpointManager (only where torchtitan is installed) ---------------------------------

SAVE_EVERY = 5  # torchtitan's checkpoint.interval: step-5 and step-10 within the 12 steps of the epoch


@pytest.fixture(scope="module")
def torchtitan() -> Any:
    return pytest.importorskip(
        "torchtitan", reason="torchtitan is not installed: pip install -e '.[torchtitan]' in an environment of its own"
    )


def _train_main(rank: int, world_size: int, tmp: str, resume_step: int, async_mode: str = "disabled") -> None:
    """torchtitan's pieces on CPU: its optimizer and LR containers, its CheckpointManager saving every
    SAVE_EVERY steps (the loader under "dataloader"), a model with dropout; to the epoch's end."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    init_gloo(rank, world_size, f"{tmp}/init-train-{world_size}-{resume_step}-{async_mode}")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
    adamw = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01})
    optimizers = OptimizersContainer.Config(implementation="for-loop", param_groups=[adamw]).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=20)
    titan = _titan(tmp, rank=rank, world_size=world_size)
    config = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=SAVE_EVERY, keep_latest_k=0, async_mode=async_mode
    )
    checkpointer = CheckpointManager(
        config,
        dataloader=titan,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={},
        sd_adapter=None,
        base_folder=tmp,
    )
    seed_everything(rank_seed(SEED, rank))  # each rank its own dropout
    step = resume_step
    if resume_step:
        assert checkpointer.load(step=resume_step)
    steps = []
    for inputs, labels in titan:
        step += 1
        x = inputs["input"].float() / TOKENS
        loss = ((model(x).squeeze(-1) - labels[:, -1].float() / TOKENS) ** 2).mean()
        optimizers.zero_grad()
        loss.backward()
        for p in model.parameters():  # data parallel: the mean gradient of the ranks
            dist.all_reduce(p.grad)
            p.grad /= world_size
        optimizers.step()
        schedulers.step()
        steps.append({"step": step, **_step((inputs, labels)), "loss": loss.item()})
        checkpointer.save(step)
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    finish(tmp, f"train{world_size}-{resume_step}-{async_mode}", rank, {"steps": steps, "weights": _weights(model)})


def _weights(model: torch.nn.Module) -> list[Any]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


@pytest.fixture(scope="module")
def trained(torchtitan: Any) -> Any:
    """An uninterrupted epoch on 2 ranks under torchtitan's CheckpointManager, saving at steps 5 and 10."""
    with tempfile.TemporaryDirectory() as tmp:
        _write_data(Path(tmp))
        spawn(_train_main, 2, tmp, 0, timeout=180)
        yield tmp, results(tmp, "train2-0-disabled", 2)


def test_torchtitans_checkpoint_manager_resumes_the_loader_bitwise(trained: Any) -> None:
    tmp, reference = trained
    assert Path(tmp, "checkpoint", f"step-{SAVE_EVERY}", ".metadata").is_file()
    spawn(_train_main, 2, tmp, SAVE_EVERY, timeout=180)
    resumed = results(tmp, f"train2-{SAVE_EVERY}-disabled", 2)
    for rank in range(2):
        after = [s for s in reference[rank]["steps"] if s["step"] > SAVE_EVERY]
        assert after and resumed[rank]["steps"] == after, f"rank {rank}: the losses after the restore differ"
        assert resumed[rank]["weights"] == reference[rank]["weights"]


def test_torchtitans_checkpoint_manager_resumes_at_another_data_parallel_degree(trained: Any) -> None:
    tmp, reference = trained
    spawn(_train_main, 1, tmp, SAVE_EVERY, timeout=180)
    resumed = results(tmp, f"train1-{SAVE_EVERY}-disabled", 1)
    before = [s for ranks in reference for s in ranks["steps"] if s["step"] <= SAVE_EVERY]
    _assert_each_token_once(before, resumed[0]["steps"])


def test_a_killed_run_on_torchtitans_components_resumes_bitwise(torchtitan: Any, tmp_path: Path) -> None:
    # tests/user_scripts/torchtitan_train.py under torchrun, 2 ranks: SIGKILLed at step 17 (epoch 1), resumed
    # by CheckpointManager.load() from step-15; every loss after it and the final weights are the
    # uninterrupted run's.
    kill_and_resume("torchtitan_train.py", tmp_path, 17, processes=2, timeout=300)


@pytest.mark.slow
def test_torchtitans_asynchronous_checkpoints_keep_the_position_of_the_save_call(
    torchtitan: Any, tmp_path: Path
) -> None:
    # dcp.async_save takes the state_dict at the call (our collective runs then); the files come later.
    tmp = str(tmp_path)
    _write_data(tmp_path)
    spawn(_train_main, 2, tmp, 0, "async", timeout=180)
    reference = results(tmp, "train2-0-async", 2)
    spawn(_train_main, 2, tmp, SAVE_EVERY, timeout=180)
    resumed = results(tmp, f"train2-{SAVE_EVERY}-disabled", 2)
    for rank in range(2):
        assert resumed[rank]["steps"] == [s for s in reference[rank]["steps"] if s["step"] > SAVE_EVERY]
        assert resumed[rank]["weights"] == reference[rank]["weights"]


def test_torchtitans_own_loader_refuses_another_data_parallel_degree(torchtitan: Any) -> None:
    # What the README says torchtitan does instead: one state per dp rank, and an assertion at another degree.
    from torchtitan.components.dataloader import ParallelAwareDataloader

    saved = ParallelAwareDataloader(list(range(8)), dp_rank=0, dp_world_size=2, batch_size=2).state_dict()
    assert sorted(saved) == ["dp_rank_0", "world_size"]
    with pytest.raises(AssertionError, match="dataloader resharding is not supported yet"):
        ParallelAwareDataloader(list(range(8)), dp_rank=0, dp_world_size=1, batch_size=2).load_state_dict(saved)


def test_torchtitans_trainer_config_builds_a_titan_loader(torchtitan: Any, tmp_path: Path) -> None:
    from torchtitan.components.dataloader import BaseDataLoader

    index = _write_data(tmp_path)

    def make_loader(*, dp_rank: int, dp_world_size: int, seq_len: int, local_batch_size: int, **_: Any) -> Any:
        stream = ShardedIterable.from_index(index, read_shard=TokenShardReader(seq_len + 1), seed=SEED)
        return StreamLoader(stream, batch_size=local_batch_size, rank=dp_rank, world_size=dp_world_size)

    config = dataloader_config(make_loader, seed=SEED)
    assert isinstance(config, BaseDataLoader.Config)
    # The keywords torchtitan's Trainer passes (trainer.py, "build dataloader").
    titan = config.build(
        dp_world_size=2, dp_rank=1, tokenizer=None, seq_len=WINDOW - 1, local_batch_size=BATCH, snapshot_every_n_steps=5
    )
    inputs, labels = next(iter(titan))
    assert isinstance(titan, TitanLoader) and titan.loader.rank == 1 and titan.loader.world_size == 2
    assert inputs["input"].shape == labels.shape == (BATCH, WINDOW - 1)
