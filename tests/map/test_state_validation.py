"""Impossible states are refused before anything changes (issue 10, the state-dict half).

Each case below is a state that a real run cannot produce. Loading it must raise a ResumeError
naming the field, and leave the object exactly as it was: a load that half-applies, or that
accepts the state and then yields wrong records, breaks the one promise of the library.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from resumable_data import ResumableSampler, ResumeError, capture_rng_state, restore_rng_state
from resumable_data.streams import IterableSource, ShardedIterable, Stream, StreamLoader, mix
from streams_harness import MemoryShards


# -- restore_rng_state -------------------------------------------------------------------------
def rng_states_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two capture_rng_state() results are the same state."""
    return (
        a["python"] == b["python"]
        and all(
            torch.equal(a["numpy"][k], b["numpy"][k]) if k == "keys" else a["numpy"][k] == b["numpy"][k]
            for k in a["numpy"]
        )
        and torch.equal(a["torch"], b["torch"])
        and len(a["cuda"]) == len(b["cuda"])
        and all(torch.equal(x, y) for x, y in zip(a["cuda"], b["cuda"], strict=True))
    )


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(state: dict[str, Any]) -> None:
        for key in path[:-1]:
            state = state[key]
        state[path[-1]] = value

    return mutate


def _set_word(index: int, value: int) -> Callable[[dict[str, Any]], None]:
    def mutate(state: dict[str, Any]) -> None:
        state["python"]["internal"][index] = value

    return mutate


RNG_CASES = {
    # torch's own checks ran only after python and numpy were already overwritten.
    "torch state of the wrong size": (lambda s: s.update(torch=s["torch"][:100].clone()), "'torch'"),
    "torch state all zeros": (lambda s: s.update(torch=torch.zeros_like(s["torch"])), "'torch'"),
    "torch state of another dtype": (lambda s: s.update(torch=s["torch"].to(torch.int32)), "'torch'"),
    # OverflowError / TypeError escaped.
    "python word of 2**70": (_set_word(3, 2**70), "python.internal"),
    "numpy pos infinite": (_set(("numpy", "pos"), float("inf")), "numpy.pos"),
    "cuda not a list": (_set(("cuda",), 5), "'cuda'"),
    "python internal None": (_set(("python", "internal"), None), "python.internal"),
    "numpy keys None": (_set(("numpy", "keys"), None), "numpy.keys"),
    # Accepted although impossible (python truncates words silently; numpy reads past its array).
    "gauss_next a string": (_set(("python", "gauss_next"), "abc"), "python.gauss_next"),
    "python word of 2**40": (_set_word(3, 2**40), "python.internal"),
    "python index past the state": (_set_word(624, 625), "python.internal"),
    "numpy pos past the key array": (_set(("numpy", "pos"), 10_000), "numpy.pos"),
    "numpy has_gauss 7": (_set(("numpy", "has_gauss"), 7), "numpy.has_gauss"),
    "numpy cached gaussian nan": (_set(("numpy", "cached_gaussian"), float("nan")), "numpy.cached_gaussian"),
    "numpy keys all zeros": (_set(("numpy", "keys"), torch.zeros(624, dtype=torch.int32)), "numpy.keys"),
    "cuda entry not a tensor": (_set(("cuda",), ["x"]), "'cuda'"),
}


@pytest.mark.parametrize("case", sorted(RNG_CASES))
def test_a_bad_rng_state_raises_resume_error_and_changes_no_rng(case: str) -> None:
    mutate, field = RNG_CASES[case]
    random.seed(11), np.random.seed(12), torch.manual_seed(13)
    bad = capture_rng_state()
    mutate(bad)
    random.seed(21), np.random.seed(22), torch.manual_seed(23)  # a different current state
    before = capture_rng_state()
    with pytest.raises(ResumeError, match=field):
        restore_rng_state(bad, strict=False)
    assert rng_states_equal(capture_rng_state(), before)


def test_a_bad_rng_error_message_stays_short_for_huge_and_deep_values() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    for value in (deep, 10**5000, "x" * 10**6):
        state = capture_rng_state()
        state["python"]["gauss_next"] = value
        with pytest.raises(ResumeError) as info:
            restore_rng_state(state)
        assert len(str(info.value)) < 400


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cuda_state",
    [torch.zeros(7, dtype=torch.uint8), torch.zeros(16, dtype=torch.int64)],
    ids=["wrong size", "wrong dtype"],
)
def test_a_bad_cuda_state_is_refused_before_any_rng_changes(cuda_state: torch.Tensor) -> None:
    torch.cuda.manual_seed_all(7)
    bad = capture_rng_state()
    bad["cuda"] = [cuda_state, *bad["cuda"][1:]]
    random.seed(21), np.random.seed(22), torch.manual_seed(23), torch.cuda.manual_seed_all(24)
    before = capture_rng_state()
    with pytest.raises(ResumeError, match="'cuda'"):
        restore_rng_state(bad)
    assert rng_states_equal(capture_rng_state(), before)


def test_cuda_states_round_trip_where_there_are_devices() -> None:
    state = capture_rng_state()  # [] on a machine without CUDA
    expected = [s.clone() for s in state["cuda"]]
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(99)
    restore_rng_state(state)
    assert all(torch.equal(a, b) for a, b in zip(capture_rng_state()["cuda"], expected, strict=True))


# -- shuffle_buffer and ShardedIterable ----------------------------------------------------------
SHARDS = MemoryShards([6, 6, 6])


def sharded() -> ShardedIterable:
    return ShardedIterable(SHARDS.names, read_shard=SHARDS, seed=0)


def shuffled() -> Stream:
    return sharded().shuffle_buffer(4, seed=1)


def midway(make: Callable[[], Stream], n: int = 7) -> Stream:
    stream = make()
    list(itertools.islice(iter(stream), n))
    return stream


def _reading(state: dict[str, Any]) -> tuple[int, int]:
    """(index, cursor) of the shard the source is reading."""
    index, _, cursor = state["source"]["remaining"][0]
    return index, cursor


def _finished_shard(state: dict[str, Any]) -> int:
    unfinished = {entry[0] for entry in state["source"]["remaining"]}
    return next(i for i in range(len(SHARDS.names)) if i not in unfinished)


def _with_key(key_of: Callable[[dict[str, Any]], list[Any]]) -> Callable[[dict[str, Any]], None]:
    def mutate(state: dict[str, Any]) -> None:
        state["buffer"][0] = key_of(state)

    return mutate


SHUFFLE_CASES = {
    "key of 2 ints": (_with_key(lambda s: [s["epoch"], 0]), "record key"),
    "key of 5 ints": (_with_key(lambda s: [s["epoch"], 0, 1, 2, 3]), "record key"),
    "shard out of range": (_with_key(lambda s: [s["epoch"], 3, 0]), "there are 3 shards"),
    "negative offset": (_with_key(lambda s: [s["epoch"], _finished_shard(s), -1]), r"offset -1 outside \[0, 2\*\*63\)"),
    "another epoch's key": (_with_key(lambda s: [s["epoch"] + 1, _finished_shard(s), 0]), "from epoch"),
    "a record not read yet": (_with_key(lambda s: [s["epoch"], _reading(s)[0], _reading(s)[1]]), "not read yet"),
    "the same record twice": (lambda s: s["buffer"].__setitem__(1, list(s["buffer"][0])), "twice"),
    "source in another epoch": (lambda s: s["source"].update(epoch=s["epoch"] + 1), "epoch"),
}


@pytest.mark.parametrize("case", sorted(SHUFFLE_CASES))
def test_shuffle_buffer_refuses_impossible_keys_and_is_unchanged(case: str) -> None:
    mutate, message = SHUFFLE_CASES[case]
    bad = midway(shuffled).state_dict()
    assert len(bad["buffer"]) == 4 and _finished_shard(bad) is not None
    mutate(bad)
    stream = midway(shuffled, 3)
    before = stream.state_dict()
    with pytest.raises(ResumeError, match=message):
        stream.load_state_dict(bad)
    assert stream.state_dict() == before
    assert list(stream) == list(midway(shuffled, 3))


def test_mix_refuses_a_key_of_a_source_it_does_not_have() -> None:
    def make() -> Stream:
        return mix([sharded(), sharded()], seed=2).shuffle_buffer(3, seed=0)

    bad = midway(make, 4).state_dict()
    bad["buffer"][0] = [bad["epoch"], 2, 0, 0]
    stream = make()
    before = stream.state_dict()
    with pytest.raises(ResumeError, match="source < 2"):
        stream.load_state_dict(bad)
    assert stream.state_dict() == before


def test_repeat_refuses_a_key_from_a_round_it_has_not_reached() -> None:
    def make() -> Stream:
        return sharded().repeat(3).shuffle_buffer(3, seed=0)

    bad = midway(make, 4).state_dict()
    bad["buffer"][0] = [bad["source"]["round"] + 1, 0, 0]
    with pytest.raises(ResumeError, match=r"source epochs 0..0"):
        make().load_state_dict(bad)


PENDING_CASES = {
    # numpy-style negative indexing would hand out a record from the end of the shard.
    "negative offset": ([[0, -1]], r"offset -1 outside \[0, 2\*\*63\)"),
    "shard out of range": ([[3, 0]], "there are 3 shards"),
    "the same record twice": ([[1, 0], [1, 0]], "twice"),
}


@pytest.mark.parametrize("case", sorted(PENDING_CASES))
def test_sharded_iterable_refuses_impossible_pending_records(case: str) -> None:
    pending, message = PENDING_CASES[case]
    bad = {**sharded().state_dict(), "pending": pending, "remaining": []}
    stream = sharded()
    before = stream.state_dict()
    with pytest.raises(ResumeError, match=message):
        stream.load_state_dict(bad)
    assert stream.state_dict() == before


def test_a_pending_record_lies_before_its_shards_cursor() -> None:
    state = midway(sharded, 2).state_dict()
    index, _, cursor = state["remaining"][0]
    with pytest.raises(ResumeError, match="not read yet"):
        sharded().load_state_dict({**state, "pending": [[index, cursor]]})
    sharded().load_state_dict({**state, "pending": [[index, cursor - 1]]})  # read, then buffered: fine


COUNTERS = {
    "epoch": (lambda: sharded(), ("epoch",)),
    "cursor": (lambda: sharded(), ("remaining", 0, 2)),
    "shuffle_buffer draws": (lambda: shuffled(), ("draws",)),
    "take taken": (lambda: sharded().take(5), ("taken",)),
    "repeat round": (lambda: sharded().repeat(), ("round",)),
    "mix draws": (lambda: mix([sharded(), sharded()]), ("draws",)),
    "IterableSource consumed": (lambda: IterableSource(range(5)), ("consumed",)),
}


@pytest.mark.parametrize("case", sorted(COUNTERS))
def test_every_stream_counter_is_an_int64(case: str) -> None:
    # 10**5000 was accepted (or crashed str() in the error): state_dict() then failed json.dumps.
    make, path = COUNTERS[case]
    bad = midway(make, 2).state_dict()
    _set(path, 10**5000)(bad)
    stream = make()
    before = stream.state_dict()
    with pytest.raises(ResumeError, match="2\\*\\*63"):
        stream.load_state_dict(bad)
    assert stream.state_dict() == before


# -- StreamLoader ---------------------------------------------------------------------------------
def loader(**kwargs: Any) -> StreamLoader:
    return StreamLoader(shuffled(), batch_size=2, **kwargs)


def midway_loader(n: int = 2, **kwargs: Any) -> StreamLoader:
    made = loader(**kwargs)
    list(itertools.islice(iter(made), n))
    return made


LOADER_CASES = {
    # set(range(2**62)) ran the machine out of memory.
    "2**62 workers": (lambda s: s.update(num_workers=2**62), "lacks slots"),
    "2**62 ranks": (lambda s: s.update(world_size=2**62), "lacks slots"),
    # str.isdigit("²") is True, then int("²") raised a bare ValueError.
    "slot named ²": (lambda s: s.update(slots={"²": s["slots"]["0"]}), "slot '²'"),
    "slot named 01": (lambda s: s.update(slots={"01": s["slots"]["0"]}), "slot '01'"),
    "slot name of 5000 digits": (lambda s: s.update(slots={"9" * 5000: s["slots"]["0"]}), "is not a slot number"),
    "epoch contradicting the slots": (lambda s: s.update(epoch=s["epoch"] + 1), "slot 0 is in epoch 0"),
    "next_worker True": (lambda s: s.update(next_worker={"0": True}), "next_worker"),
}


@pytest.mark.parametrize("case", sorted(LOADER_CASES))
def test_stream_loader_refuses_impossible_states_and_is_unchanged(case: str) -> None:
    mutate, message = LOADER_CASES[case]
    bad = midway_loader().state_dict()
    mutate(bad)
    target = midway_loader(1)
    before = target.state_dict()
    with pytest.raises(ResumeError, match=message):
        target.load_state_dict(bad)
    assert target.state_dict() == before


def test_stream_loader_keeps_its_own_copy_of_a_loaded_state() -> None:
    state = midway_loader().state_dict()
    target = loader()
    target.load_state_dict(state)
    expected = target.state_dict()
    state["slots"]["0"]["source"]["buffer"].clear()  # the caller reuses its dict
    state["slots"]["0"]["extra"] = "ignored"
    assert target.state_dict() == expected


def test_merge_states_refuses_what_is_not_a_list_of_states() -> None:
    with pytest.raises(ResumeError, match="non-empty list"):
        StreamLoader.merge_states(5)
    state = midway_loader().state_dict()
    with pytest.raises(ResumeError, match="'epoch' must be an int"):
        StreamLoader.merge_states([state, {**state, "epoch": None}])


# -- found by tests/test_fuzz_states.py in the sampler ----------------------------------------------------
def _sampler_state(**changes: Any) -> dict[str, Any]:
    return {**ResumableSampler(20, seed=1, world_size=2, rank=1).state_dict(), **changes}


def test_sampler_refuses_an_epoch_no_run_reaches() -> None:
    sampler = ResumableSampler(20, seed=1, world_size=2, rank=1)
    before = sampler.state_dict()
    with pytest.raises(ResumeError, match=r"'epoch' must be at most 2\*\*63 - 1, but got <int of 16610 bits>"):
        sampler.load_state_dict(_sampler_state(epoch=10**5000))
    assert sampler.state_dict() == before


def test_sampler_mismatch_message_survives_a_huge_int() -> None:
    with pytest.raises(ResumeError):
        ResumableSampler(20, seed=1, world_size=2, rank=1).load_state_dict(_sampler_state(dataset_length=10**5000))


def test_a_state_the_sampler_accepted_loads_into_its_twin() -> None:
    # A world of 2**32 + 2 ranks is unreal but consistent (a position inside the epoch), so the
    # sampler accepts it; what it then saves must load into a sampler built the same way.
    sampler = ResumableSampler(20, seed=1, world_size=2, rank=1)
    sampler.load_state_dict(_sampler_state(position=2**32 + 10, world_size=2**32 + 2))
    saved = json.loads(json.dumps(sampler.state_dict()))
    twin = ResumableSampler(20, seed=1, world_size=2, rank=1)
    twin.load_state_dict(saved)
    assert twin.state_dict() == saved


def test_stream_loader_refuses_a_slot_state_saved_for_another_slot() -> None:
    # repeat() keeps the source's slot for its next round, which would then read rank 1's shards.
    def make(rank: int) -> StreamLoader:
        return StreamLoader(sharded().repeat(2), batch_size=2, rank=rank, world_size=2)

    made = make(0)
    list(itertools.islice(iter(made), 1))
    state = made.state_dict()
    state["slots"]["0"]["source"]["source"]["slot"] = 1  # batch -> repeat -> ShardedIterable
    target = make(0)
    before = target.state_dict()
    with pytest.raises(ResumeError, match="slot 0 holds a pipeline state saved for slot 1 of 2"):
        target.load_state_dict(state)
    assert target.state_dict() == before
