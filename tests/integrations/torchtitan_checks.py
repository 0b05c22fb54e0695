"""torchtitan's own pieces with a TitanLoader: run only inside torchtitan's environment, by
tests/integrations/test_torchtitan.py (``torchtitan_checks_pass_in_their_own_environment``), which makes
that environment and runs this module in a pytest of its own there. Not a ``test_*`` file, so the dev
environment's suite never collects it; it imports torchtitan unconditionally, so a run without torchtitan
fails rather than skips.

On CPU, gloo: torchtitan's ``CheckpointManager`` saves the loader under ``"dataloader"`` every SAVE_EVERY
steps and resumes it bitwise (losses and weights), at another data-parallel degree each token once, and
with asynchronous saves at the position of the save call; a SIGKILLed run resumes bitwise; torchtitan's
own loader refuses another degree (what the README says it does); its trainer config builds a TitanLoader.
The 2-rank runs are marked slow: a default run checks the environment and the cheap checks only.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader, ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from dist_harness import finish, init_gloo, results, spawn
from integrations_harness import kill_and_resume
from resumable_data.integrations.torchtitan import TitanLoader, dataloader_config
from resumable_data.rng import rank_seed, seed_everything
from resumable_data.streams import ShardedIterable, StreamLoader, TokenShardReader
from titan_harness import BATCH, SEED, TOKENS, WINDOW, assert_each_token_once, seen_by_step, titan_loader, write_data

SAVE_EVERY = 5  # torchtitan's checkpoint.interval: step-5 and step-10 within the 12 steps of the epoch


def _train_main(rank: int, world_size: int, tmp: str, resume_step: int, async_mode: str = "disabled") -> None:
    """torchtitan's pieces on CPU: its optimizer and LR containers, its CheckpointManager saving every
    SAVE_EVERY steps (the loader under "dataloader"), a model with dropout; to the epoch's end."""
    init_gloo(rank, world_size, f"{tmp}/init-train-{world_size}-{resume_step}-{async_mode}")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
    adamw = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01})
    optimizers = OptimizersContainer.Config(implementation="for-loop", param_groups=[adamw]).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=20)
    titan = titan_loader(tmp, rank=rank, world_size=world_size)
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
        steps.append({"step": step, **seen_by_step((inputs, labels)), "loss": loss.item()})
        checkpointer.save(step)
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    finish(tmp, f"train{world_size}-{resume_step}-{async_mode}", rank, {"steps": steps, "weights": _weights(model)})


def _weights(model: torch.nn.Module) -> list[Any]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


@pytest.fixture(scope="module")
def trained() -> Any:
    """An uninterrupted epoch on 2 ranks under torchtitan's CheckpointManager, saving at steps 5 and 10."""
    with tempfile.TemporaryDirectory() as tmp:
        write_data(Path(tmp))
        spawn(_train_main, 2, tmp, 0, timeout=180)
        yield tmp, results(tmp, "train2-0-disabled", 2)


# The 2-rank runs below take 25-35 s each here (the module's default run, without them, about 10 s).
@pytest.mark.slow
def test_torchtitans_checkpoint_manager_resumes_the_loader_bitwise(trained: Any) -> None:
    tmp, reference = trained
    assert Path(tmp, "checkpoint", f"step-{SAVE_EVERY}", ".metadata").is_file()
    spawn(_train_main, 2, tmp, SAVE_EVERY, timeout=180)
    resumed = results(tmp, f"train2-{SAVE_EVERY}-disabled", 2)
    for rank in range(2):
        after = [s for s in reference[rank]["steps"] if s["step"] > SAVE_EVERY]
        assert after and resumed[rank]["steps"] == after, f"rank {rank}: the losses after the restore differ"
        assert resumed[rank]["weights"] == reference[rank]["weights"]


@pytest.mark.slow
def test_torchtitans_checkpoint_manager_resumes_at_another_data_parallel_degree(trained: Any) -> None:
    tmp, reference = trained
    spawn(_train_main, 1, tmp, SAVE_EVERY, timeout=180)
    resumed = results(tmp, f"train1-{SAVE_EVERY}-disabled", 1)
    before = [s for ranks in reference for s in ranks["steps"] if s["step"] <= SAVE_EVERY]
    assert_each_token_once(before, resumed[0]["steps"])


@pytest.mark.slow
def test_a_killed_run_on_torchtitans_components_resumes_bitwise(tmp_path: Path) -> None:
    # tests/user_scripts/torchtitan_train.py under torchrun, 2 ranks: SIGKILLed at step 17 (epoch 1), resumed
    # by CheckpointManager.load() from step-15; every loss after it and the final weights are the
    # uninterrupted run's.
    kill_and_resume("torchtitan_train.py", tmp_path, 17, processes=2, timeout=300)


@pytest.mark.slow
def test_torchtitans_asynchronous_checkpoints_keep_the_position_of_the_save_call(tmp_path: Path) -> None:
    # dcp.async_save takes the state_dict at the call (our collective runs then); the files come later.
    tmp = str(tmp_path)
    write_data(tmp_path)
    spawn(_train_main, 2, tmp, 0, "async", timeout=180)
    reference = results(tmp, "train2-0-async", 2)
    spawn(_train_main, 2, tmp, SAVE_EVERY, timeout=180)
    resumed = results(tmp, f"train2-{SAVE_EVERY}-disabled", 2)
    for rank in range(2):
        assert resumed[rank]["steps"] == [s for s in reference[rank]["steps"] if s["step"] > SAVE_EVERY]
        assert resumed[rank]["weights"] == reference[rank]["weights"]


def test_torchtitans_own_loader_refuses_another_data_parallel_degree() -> None:
    # What the README says torchtitan does instead: one state per dp rank, and an assertion at another degree.
    saved = ParallelAwareDataloader(list(range(8)), dp_rank=0, dp_world_size=2, batch_size=2).state_dict()
    assert sorted(saved) == ["dp_rank_0", "world_size"]
    with pytest.raises(AssertionError, match="dataloader resharding is not supported yet"):
        ParallelAwareDataloader(list(range(8)), dp_rank=0, dp_world_size=1, batch_size=2).load_state_dict(saved)


def test_torchtitans_trainer_config_builds_a_titan_loader(tmp_path: Path) -> None:
    index = write_data(tmp_path)

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
