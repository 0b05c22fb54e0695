"""Bad input gets a ResumeError naming the field, both values and the remedy; a failed load
changes nothing."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, WeightedRandomSampler

from harness import take
from resumable_data import ResumableDataLoader, ResumableSampler, ResumeError, wrap


def _loader(**kwargs) -> ResumableDataLoader:
    return ResumableDataLoader(torch.arange(20), batch_size=3, seed=1, **kwargs)


def test_resume_error_is_a_value_error() -> None:
    assert issubclass(ResumeError, ValueError)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dataset_length", 21, "dataset length changed: checkpoint has 21, ResumableDataLoader has 20"),
        ("seed", 9, "seed changed: checkpoint has 9, ResumableDataLoader has 1"),
        ("shuffle", False, "shuffle changed: checkpoint has False, ResumableDataLoader has True"),
        ("version", 99, "version 99"),
        ("position", -1, "'position' must be >= 0"),
        ("position", 40, "past the end of an epoch"),
        ("epoch", "3", "'epoch' must be an int"),
        ("batch_size", 0, "'batch_size' must be >= 1"),
    ],
)
def test_mismatching_state_is_refused_and_leaves_the_loader_unchanged(field: str, value, message: str) -> None:
    loader = _loader()
    take(loader, 2)
    before = loader.state_dict()
    bad = {**before, field: value}
    with pytest.raises(ResumeError, match=message):
        loader.load_state_dict(bad)
    assert loader.state_dict() == before
    # And it goes on exactly as an untouched loader would.
    twin = _loader()
    take(twin, 2)
    assert [b.tolist() for b in take(loader, 8)] == [b.tolist() for b in take(twin, 8)]


def test_mismatch_message_names_the_remedy() -> None:
    with pytest.raises(ResumeError, match="strict=False"):
        _loader().load_state_dict({**_loader().state_dict(), "seed": 2})


def test_missing_key_and_non_dict_state_are_refused() -> None:
    state = _loader().state_dict()
    del state["position"]
    with pytest.raises(ResumeError, match="missing the key 'position'"):
        _loader().load_state_dict(state)
    with pytest.raises(ResumeError, match="must be a dict"):
        _loader().load_state_dict([1, 2])


def test_strict_false_keeps_the_position_in_a_changed_dataset() -> None:
    old = _loader()
    take(old, 2)
    grown = ResumableDataLoader(torch.arange(30), batch_size=3, seed=1)
    grown.load_state_dict(old.state_dict(), strict=False)
    assert grown.position == 6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(batch_size=0), "batch_size should be an integer >= 1, but got batch_size=0"),
        (dict(rank=2, world_size=2), r"rank should be in \[0, world_size\)"),
        (dict(world_size=0), "world_size should be an integer >= 1"),
        (dict(rank=-1, world_size=2), "rank should be an integer >= 0"),
        (dict(seed=1.5), "seed should be an int"),
        (dict(in_order=False), "in_order=False"),
        (dict(generator=torch.Generator()), "decides 'generator' itself"),
        (dict(sampler=RandomSampler(range(20))), "sampler must be a ResumableSampler"),
    ],
)
def test_constructor_arguments_are_validated(kwargs: dict, message: str) -> None:
    kwargs = {"batch_size": 3, **kwargs}
    with pytest.raises(ResumeError, match=message):
        ResumableDataLoader(torch.arange(20), **kwargs)


def test_iterable_dataset_is_pointed_to_streams() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(ResumeError, match="IterableDataset"):
        ResumableDataLoader(Stream())


def test_empty_dataset_is_refused() -> None:
    with pytest.raises(ResumeError, match="dataset length should be an integer >= 1"):
        ResumableSampler(0)


def test_set_epoch_rejects_negative() -> None:
    with pytest.raises(ResumeError, match="epoch should be an integer >= 0"):
        ResumableSampler(5).set_epoch(-1)


class TestWrap:
    dataset = torch.arange(40)

    def test_keeps_the_loader_settings(self) -> None:
        collate = lambda items: torch.stack(items) * 10
        loader = wrap(
            DataLoader(
                self.dataset,
                batch_size=6,
                shuffle=True,
                drop_last=True,
                collate_fn=collate,
                num_workers=2,
                prefetch_factor=3,
                persistent_workers=True,
            ),
            seed=7,
        )
        assert isinstance(loader, ResumableDataLoader)
        assert (loader.batch_size, loader.drop_last, loader.num_workers, loader.prefetch_factor) == (6, True, 2, 3)
        assert loader.persistent_workers and loader.collate_fn.collate_fn is collate  # inside the seeding wrapper
        batches = take(loader, 6)
        assert all(len(b) == 6 and int(b.sum()) % 10 == 0 for b in batches)
        assert loader.state_dict()["seed"] == 7

    def test_sequential_and_random_samplers_decide_shuffle(self) -> None:
        sequential = wrap(DataLoader(self.dataset, batch_size=5))
        assert next(iter(sequential)).tolist() == [0, 1, 2, 3, 4]
        shuffled = wrap(DataLoader(self.dataset, batch_size=5, shuffle=True))
        assert shuffled.state_dict()["shuffle"] is True

    def test_distributed_sampler_settings_are_kept(self) -> None:
        sampler = DistributedSampler(self.dataset, num_replicas=3, rank=2, shuffle=True, seed=5, drop_last=True)
        loader = wrap(DataLoader(self.dataset, batch_size=4, sampler=sampler))
        state = loader.state_dict()
        assert (state["world_size"], state["seed"], state["shuffle"], state["drop_last"]) == (3, 5, True, True)
        assert loader.sampler.rank == 2 and len(loader.sampler) == 13

    @pytest.mark.parametrize(
        ("loader", "message"),
        [
            (DataLoader(dataset, batch_size=2, sampler=RandomSampler(dataset, replacement=True)), "replacement=True"),
            (DataLoader(dataset, batch_size=2, sampler=WeightedRandomSampler([1.0] * 40, 40)), "custom sampler"),
            (DataLoader(dataset, batch_sampler=[[0, 1], [2, 3]]), "custom"),
            (DataLoader(dataset, batch_size=None), "batch_size="),
        ],
    )
    def test_unresumable_loaders_get_a_clear_error(self, loader: DataLoader, message: str) -> None:
        with pytest.raises(ResumeError, match=message):
            wrap(loader)

    def test_wrapped_loader_resumes_exactly(self) -> None:
        from harness import assert_resumes_identically

        make = lambda: wrap(DataLoader(self.dataset, batch_size=3, shuffle=True), seed=3)
        assert_resumes_identically(make, [4, 14, 15], 40)
