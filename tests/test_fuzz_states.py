"""Fuzzing every ``load_state_dict`` (and ``restore_rng_state``) with hostile states.

The specification, for every resumable object: take a valid state, damage it (drop or add keys,
drop, duplicate or append list items, swap in wrong types, huge, negative, infinite, None, tensor,
deeply nested values), then load it. Exactly one of two things may happen:

* it loads, and then the object is usable and consistent: its own ``state_dict()`` loads into a
  fresh twin, both yield the same items (or both stop with the same ResumeError, e.g. a cursor
  beyond the end of a shard), and a stream yields no record twice within the epoch; or
* it raises :class:`ResumeError`, and the object's ``state_dict()`` is exactly what it was
  (for ``restore_rng_state``: every global RNG is unchanged).

Any other exception (TypeError, IndexError, RecursionError, MemoryError, ...) is a bug.

Mutations are drawn as readable steps (a path and an operation name), never as the damaged values
themselves, so a failing example prints short. The sampler and the loaders are driven through their
public API only.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resumable_data import (
    ResumableDataLoader,
    ResumableSampler,
    ResumeError,
    capture_rng_state,
    restore_rng_state,
)
from resumable_data.streams import (
    IterableSource,
    ShardedIterable,
    Stream,
    StreamLoader,
    TextLineReader,
    TokenShardReader,
    mix,
)
from resumable_data.testing import assert_same
from streams_harness import MemoryShards, write_token_shards

# The default suite stays fast (CI has 2 cores); RESUMABLE_FUZZ_SCALE=50 (with --hypothesis-profile=dev
# for fresh random examples) searches much deeper.
_SCALE = float(os.environ.get("RESUMABLE_FUZZ_SCALE", "1"))


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=max(1, int(examples * _SCALE)),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- the damage ------------------------------------------------------------------------------------
def _deep(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


NASTY: dict[str, Callable[[], Any]] = {
    "None": lambda: None,
    "True": lambda: True,
    "-1": lambda: -1,
    "0": lambda: 0,
    "2**31": lambda: 2**31,
    "2**63": lambda: 2**63,
    "2**200": lambda: 2**200,
    "-2**200": lambda: -(2**200),
    "10**5000": lambda: 10**5000,
    "inf": lambda: float("inf"),
    "nan": lambda: float("nan"),
    "0.5": lambda: 0.5,
    "'abc'": lambda: "abc",
    "'1'": lambda: "1",
    "'²'": lambda: "²",
    "[]": lambda: [],
    "{}": lambda: {},
    "[1, 2]": lambda: [1, 2],
    "[0, 1, 2, 3, 4]": lambda: [0, 1, 2, 3, 4],
    "[[0, 0, 0]]": lambda: [[0, 0, 0]],
    "{'0': {}}": lambda: {"0": {}},
    "{1: 2, 'a': 3}": lambda: {1: 2, "a": 3},
    "deep list": lambda: _deep(50_000),
    "deep dict": lambda: {"0": {"0": _deep(50_000)}},
    "uint8 tensor[16]": lambda: torch.zeros(16, dtype=torch.uint8),
    "int32 tensor[624]": lambda: torch.arange(624, dtype=torch.int32),
    "sparse int32 tensor[624]": lambda: torch.arange(624, dtype=torch.int32).to_sparse(),
    "meta uint8 tensor[5056]": lambda: torch.empty(5056, dtype=torch.uint8, device="meta"),
    "float tensor[2, 2]": lambda: torch.ones(2, 2),
    "int tensor[2]": lambda: torch.tensor([1, 2]),
    "int tensor scalar": lambda: torch.tensor(3),
    "numpy int64": lambda: np.int64(3),
    "bytes": lambda: b"\x00\x01",
    "tuple": lambda: (0, 1, 2),
}
NUDGES = [-1, 1, -2, 7, 2**32, -(2**40), 2**64]


def _children(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return sorted(node, key=repr)
    if isinstance(node, list):
        return list(range(len(node)))
    return []


def damage(data: st.DataObject, state: Any, *, max_steps: int = 3) -> Any:
    """``state`` (a deep copy of it) after 1..max_steps drawn mutations."""
    root = [copy.deepcopy(state)]  # a holder, so the root itself can be replaced
    for _ in range(data.draw(st.integers(1, max_steps), label="steps")):
        parent: Any = root
        key: Any = 0
        node = root[0]
        # Descend mostly: the interesting fields (keys, cursors, slots) sit a few levels down.
        while _children(node) and data.draw(st.integers(0, 9), label="descend") < 8:
            parent, key = node, data.draw(st.sampled_from(_children(node)), label="into")
            node = parent[key]
        ops = ["replace"]
        if isinstance(node, dict):
            ops += ["drop key", "add key"]
        if isinstance(node, list):
            ops += ["drop item", "duplicate item", "append", "as tuple"]
        if isinstance(node, int) and not isinstance(node, bool):
            ops += ["nudge", "nudge", "negate"]
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "replace":
            parent[key] = NASTY[data.draw(st.sampled_from(sorted(NASTY)), label="value")]()
        elif op == "drop key" and node:
            del node[data.draw(st.sampled_from(_children(node)), label="drop")]
        elif op == "add key":
            node[data.draw(st.sampled_from(["extra", "0", "1", "epoch", 7]), label="new key")] = NASTY[
                data.draw(st.sampled_from(sorted(NASTY)), label="value")
            ]()
        elif op == "drop item" and node:
            del node[data.draw(st.sampled_from(_children(node)), label="drop")]
        elif op == "duplicate item" and node:
            node.append(copy.copy(node[data.draw(st.sampled_from(_children(node)), label="copy")]))
        elif op == "append":
            node.append(NASTY[data.draw(st.sampled_from(sorted(NASTY)), label="value")]())
        elif op == "as tuple":
            parent[key] = tuple(node)
        elif op == "nudge":
            parent[key] = node + data.draw(st.sampled_from(NUDGES), label="by")
        elif op == "negate":
            parent[key] = -node - 1
    return root[0]


# -- loading states and reading items ---------------------------------------------------------
def load_or_refuse(obj: Any, bad: Any, **kwargs: Any) -> bool:
    """Load ``bad`` into ``obj``: True if it loaded; False if refused with ``obj`` unchanged."""
    before = copy.deepcopy(obj.state_dict())
    try:
        obj.load_state_dict(bad, **kwargs)
    except ResumeError:
        assert_same(before, obj.state_dict(), "a refused load changed the object: state", strict_containers=True)
        return False
    return True


def drain(iterable: Any, limit: int) -> tuple[list[Any], str | None]:
    """Up to ``limit`` items, and the ResumeError that stopped it (if any)."""
    items: list[Any] = []
    try:
        for item in itertools.islice(iter(iterable), limit):
            items.append(item)
    except ResumeError as exc:
        return items, str(exc)
    return items, None


def flat_ids(items: list[Any], window: bool = False) -> list[int]:
    """Record ids: an int, the int of an (id, noise) pair, a text line, the values of a batch
    tensor; with ``window`` each item (or batch row) is a token window named by its first token."""
    out: list[int] = []
    for item in items:
        if isinstance(item, (tuple, list)):
            item = item[0]
        if isinstance(item, torch.Tensor):
            out += (item[..., 0].reshape(-1) if window else item.reshape(-1)).tolist()
        else:
            out.append(int(item))
    return out


# -- stream pipelines --------------------------------------------------------------------------
MEMORY = MemoryShards([5, 6, 4])
OTHER = MemoryShards([3, 5])
OTHER.records = {name: [r + 500 for r in records] for name, records in OTHER.records.items()}


def noisy(x: int, g: torch.Generator) -> tuple[int, torch.Tensor]:
    return x, torch.rand(2, generator=g)


def memory(seed: int = 0) -> ShardedIterable:
    return ShardedIterable(MEMORY.names, read_shard=MEMORY, seed=seed)


def other() -> ShardedIterable:
    return ShardedIterable(OTHER.names, read_shard=OTHER, seed=1)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    root = tmp_path_factory.mktemp("fuzz")
    text = []
    for s, n in enumerate([4, 7, 3]):
        path = root / f"lines_{s}.txt"
        path.write_text("".join(f"{s * 1000 + i}\n" for i in range(n)))
        text.append(path)
    return {"tokens": write_token_shards(root, [20, 33, 12]), "text": text}


# name -> (make(files), unique records within an epoch)
PIPELINES: dict[str, tuple[Callable[[dict[str, list[Path]]], Stream], bool]] = {
    "sharded (callable reader)": (lambda f: memory(), True),
    "sharded (TokenShardReader)": (
        lambda f: ShardedIterable(f["tokens"], read_shard=TokenShardReader(4, stride=3)),
        True,
    ),
    "sharded (TextLineReader)": (lambda f: ShardedIterable(f["text"], read_shard=TextLineReader()), True),
    "map": (lambda f: memory().map(noisy, seed=5), True),
    "filter": (lambda f: memory().filter(lambda x: x % 3 != 0), True),
    "batch": (lambda f: memory().batch(4), True),
    "shuffle_buffer": (lambda f: memory().shuffle_buffer(4, seed=1), True),
    "shuffle_buffer (text)": (
        lambda f: ShardedIterable(f["text"], read_shard=TextLineReader()).shuffle_buffer(3),
        True,
    ),
    "take": (lambda f: memory().take(9), True),
    "repeat": (lambda f: memory().repeat(2), False),
    "repeat + shuffle_buffer": (lambda f: memory().repeat(3).shuffle_buffer(4, seed=2), False),
    "mix + shuffle_buffer": (
        lambda f: mix([memory(), other()], weights=[2, 1], seed=3).shuffle_buffer(3).map(noisy, seed=1),
        True,
    ),
    "nested shuffle_buffers": (lambda f: memory().shuffle_buffer(3, seed=1).shuffle_buffer(2, seed=2), True),
    "IterableSource": (lambda f: IterableSource(list(range(12))), True),
    "pack": (lambda f: memory().map(lambda x: [x] * (x % 4)).shuffle_buffer(3, seed=1).pack(3, eos=0), False),
    "batch_by_tokens": (
        lambda f: memory().map(lambda x: [x] * (x % 4)).shuffle_buffer(3, seed=1).batch_by_tokens(5),
        False,
    ),
    "batch_by_tokens (bucket)": (
        lambda f: memory().map(lambda x: [x] * (x % 4)).shuffle_buffer(3, seed=1).batch_by_tokens(5, bucket=4),
        False,
    ),
    "composed": (
        lambda f: memory().filter(lambda x: x % 5 != 0).shuffle_buffer(4, seed=2).map(noisy, seed=1).batch(3),
        True,
    ),
}


def midway(stream: Stream, n: int) -> Stream:
    list(itertools.islice(iter(stream), n))
    return stream


@pytest.mark.filterwarnings("ignore::resumable_data.streams.ReplayWarning")
@pytest.mark.parametrize("name", sorted(PIPELINES))
@fuzz(40)
@given(data=st.data())
def test_stream_loads_a_damaged_state_consistently_or_refuses_it_unchanged(
    files, name: str, data: st.DataObject
) -> None:
    make, unique = PIPELINES[name]
    valid = midway(make(files), 7).state_dict()
    stream = midway(make(files), 2)
    if not load_or_refuse(stream, damage(data, valid)):
        return
    twin = make(files)
    twin.load_state_dict(json.loads(json.dumps(stream.state_dict())))  # its own state is plain and loads
    items, stopped = drain(stream, 100)
    twin_items, twin_stopped = drain(twin, 100)
    assert_same(items, twin_items)
    assert stopped == twin_stopped
    if unique:
        ids = flat_ids(items, window="Token" in name)
        assert len(ids) == len(set(ids)), f"a record came twice after loading: {ids}"


# -- StreamLoader -----------------------------------------------------------------------------------
def stream_loader(**kwargs: Any) -> StreamLoader:
    pipeline = mix([memory(), other()], seed=3).shuffle_buffer(3, seed=1)
    return StreamLoader(pipeline, batch_size=2, **kwargs)


def after_batches(loader: StreamLoader, n: int) -> StreamLoader:
    list(itertools.islice(iter(loader), n))
    return loader


def _loader_states() -> dict[str, Any]:
    ranks = [after_batches(stream_loader(rank=r, world_size=2), 2).state_dict() for r in range(2)]
    return {
        "own state": after_batches(stream_loader(), 3).state_dict(),
        "merged 2-rank state (redistributed)": StreamLoader.merge_states(ranks),
    }


LOADER_STATES = _loader_states()


@pytest.mark.parametrize("which", sorted(LOADER_STATES))
@fuzz(30)
@given(data=st.data())
def test_stream_loader_loads_a_damaged_state_consistently_or_refuses_it_unchanged(
    which: str, data: st.DataObject
) -> None:
    loader = after_batches(stream_loader(), 1)
    if not load_or_refuse(loader, damage(data, LOADER_STATES[which])):
        return
    twin = stream_loader()
    twin.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    batches, stopped = drain(loader, 4)
    twin_batches, twin_stopped = drain(twin, 4)
    assert_same(batches, twin_batches)
    assert stopped == twin_stopped


@fuzz(30)
@given(data=st.data())
def test_merge_states_merges_damaged_states_or_refuses_them(data: st.DataObject) -> None:
    ranks = [after_batches(stream_loader(rank=r, world_size=2), 2).state_dict() for r in range(2)]
    damaged = damage(data, ranks)
    try:
        merged = StreamLoader.merge_states(damaged)
    except ResumeError:
        return
    load_or_refuse(stream_loader(), merged)


# -- sampler and map-style loader (public API only) ------------------------------------------------
def sampler() -> ResumableSampler:
    return ResumableSampler(20, seed=1, world_size=2, rank=1)


def map_loader() -> ResumableDataLoader:
    return ResumableDataLoader(torch.arange(20), batch_size=3, seed=1)


MAP_STYLE: dict[str, Callable[[], Any]] = {"ResumableSampler": sampler, "ResumableDataLoader": map_loader}


@pytest.mark.parametrize("name", sorted(MAP_STYLE))
@pytest.mark.parametrize("strict", [True, False])
@fuzz(40)
@given(data=st.data())
def test_map_style_loads_a_damaged_state_consistently_or_refuses_it_unchanged(
    name: str, strict: bool, data: st.DataObject
) -> None:
    make = MAP_STYLE[name]
    valid = make()
    midway(valid, 5)
    obj = make()
    midway(obj, 1)
    if not load_or_refuse(obj, damage(data, valid.state_dict()), strict=strict):
        return
    twin = make()
    twin.load_state_dict(json.loads(json.dumps(obj.state_dict())), strict=strict)
    items, stopped = drain(obj, 30)
    twin_items, twin_stopped = drain(twin, 30)
    assert_same(items, twin_items)
    assert stopped == twin_stopped
    ids = flat_ids(items)
    assert all(0 <= i < 20 for i in ids)


# -- restore_rng_state ----------------------------------------------------------------------------
@fuzz(80)
@given(data=st.data(), strict=st.booleans())
def test_restore_rng_state_restores_a_damaged_state_exactly_or_changes_nothing(
    data: st.DataObject, strict: bool
) -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.randn()  # cached gaussians in both
    valid = capture_rng_state()
    random.seed(4), np.random.seed(5), torch.manual_seed(6)
    before = capture_rng_state()
    bad = damage(data, valid)
    try:
        restore_rng_state(bad, strict=strict)
    except ResumeError:
        assert_same(before, capture_rng_state(), "a refused restore changed an RNG: state", strict_containers=True)
        return
    # Accepted: the RNGs now hold exactly the given state, and they work.
    now = capture_rng_state()
    assert now["python"]["internal"] == list(bad["python"]["internal"])
    assert now["python"]["gauss_next"] == bad["python"]["gauss_next"]
    assert torch.equal(now["numpy"]["keys"], bad["numpy"]["keys"]) and now["numpy"]["pos"] == bad["numpy"]["pos"]
    assert torch.equal(now["torch"], bad["torch"])
    random.random(), np.random.rand(), torch.rand(1)
