"""The comparator every resume check relies on (``resumable_data.testing``).

Specifications: two bitwise-equal values, however nested, compare equal; any single change (a bit
of one tensor or array element, a number, a string, a type, a key, a length) is found, and the
message names the path to it. What a checkpoint's round trip may change without changing the state
(layout, key order, a list for a tuple) is not a difference. A comparator that misses a change would let every resume test pass.
"""

from __future__ import annotations

import copy
import struct
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from resumable_data.rng import SampleKey
from resumable_data.testing import assert_same, first_difference

TORCH_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]
NUMPY_DTYPES = [np.float32, np.float64, np.int32, np.uint16]
Step = Any  # a dict key, a list index, or ".field" for a dataclass


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(0, 3), max_size=3)))


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Tensors with arbitrary bit patterns: every NaN payload, both zeros, subnormals."""
    dtype, shape = draw(st.sampled_from(TORCH_DTYPES)), draw(shapes())
    numel, size = int(np.prod(shape)), torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        raw = bytes(draw(st.lists(st.integers(0, 1), min_size=numel, max_size=numel)))
    else:
        raw = draw(st.binary(min_size=numel * size, max_size=numel * size))
    if not numel:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy()).view(dtype).reshape(shape)


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dtype, shape = np.dtype(draw(st.sampled_from(NUMPY_DTYPES))), draw(shapes())
    numel = int(np.prod(shape))
    raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


SPECIAL_FLOATS = [0.0, -0.0, float("nan"), struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0], -float("inf")]
LEAF_KINDS = {
    "none": st.none(),
    "bool": st.booleans(),
    "int": st.integers(-(2**70), 2**70),
    "float": st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(SPECIAL_FLOATS),
    "str": st.text(max_size=4),
    "SampleKey": st.builds(SampleKey, index=st.integers(0, 99), epoch=st.integers(0, 9), seed=st.integers(0, 9)),
    "tensor": tensors(),
    "array": arrays(),
}
LEAVES = st.one_of(*LEAF_KINDS.values())
TREES = st.recursive(
    LEAVES,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=3) | st.integers(0, 9), children, max_size=4)
    ),
    max_leaves=12,
)


def path_of(steps: list[Step]) -> str:
    """The path as the comparator spells it: ``[key!r]`` for mappings, ``[i]`` for sequences."""
    return "".join(s if isinstance(s, str) and s.startswith(".") else f"[{s!r}]" for s in steps)


def places(tree: Any, steps: list[Step] | None = None) -> Iterator[tuple[list[Step], Any]]:
    """Every value in the tree (containers included) with the steps that lead to it."""
    steps = steps or []
    yield steps, tree
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from places(value, [*steps, key])
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from places(value, [*steps, i])
    elif isinstance(tree, SampleKey):
        for name in ("index", "epoch", "seed"):
            yield [*steps, "." + name], getattr(tree, name)


def replaced(tree: Any, steps: list[Step], new: Any) -> Any:
    """A copy of ``tree`` with the value at ``steps`` replaced by ``new``."""
    if not steps:
        return new
    head, rest = steps[0], steps[1:]
    if isinstance(tree, SampleKey):
        fields = {"index": tree.index, "epoch": tree.epoch, "seed": tree.seed}
        fields[head[1:]] = replaced(fields[head[1:]], rest, new)
        return SampleKey(**fields)
    if isinstance(tree, dict):
        return {k: replaced(v, rest, new) if k == head else v for k, v in tree.items()}
    items = [replaced(v, rest, new) if i == head else v for i, v in enumerate(tree)]
    return type(tree)(items)


def flip_bit(buffer: np.ndarray, bit: int) -> None:
    buffer.reshape(-1).view(np.uint8)[bit // 8] ^= 1 << (bit % 8)


@st.composite
def changed(draw: st.DrawFn, value: Any) -> tuple[Any, str]:
    """A value that differs from ``value`` in one way, and what the message must then contain."""
    if isinstance(value, torch.Tensor) and value.numel() and value.dtype != torch.bool:
        element = draw(st.integers(0, value.numel() - 1))
        raw = value.reshape(-1).view(torch.uint8).numpy().copy()
        flip_bit(raw, element * value.element_size() * 8 + draw(st.integers(0, value.element_size() * 8 - 1)))
        index = tuple(int(i) for i in np.unravel_index(element, tuple(value.shape))) if value.dim() else ()
        return torch.from_numpy(raw).view(value.dtype).reshape(value.shape), f"first at index {index}"
    if isinstance(value, torch.Tensor):
        other = draw(st.sampled_from([t for t in TORCH_DTYPES if t != value.dtype]))
        return value.to(other), "vs"
    if isinstance(value, np.ndarray) and value.size:
        new = value.copy()
        element = draw(st.integers(0, value.size - 1))
        flip_bit(new, element * value.itemsize * 8 + draw(st.integers(0, value.itemsize * 8 - 1)))
        return new, "first at index"
    if isinstance(value, np.ndarray):
        return value.reshape(*value.shape, 1), "vs"
    if isinstance(value, float):
        bits = struct.unpack("<Q", struct.pack("<d", value))[0] ^ (1 << draw(st.integers(0, 63)))
        return struct.unpack("<d", struct.pack("<Q", bits))[0], "vs"
    if isinstance(value, bool):
        return draw(st.sampled_from([not value, int(value)])), "vs"
    if isinstance(value, int):
        return draw(st.sampled_from([value + 1, float(value), str(value)])), "vs"
    if isinstance(value, str):
        return draw(st.sampled_from([value + "!", value.encode(), None])), "vs"
    if isinstance(value, SampleKey):
        return (value.index, value.epoch, value.seed), "SampleKey vs tuple"
    if isinstance(value, dict):
        if value and draw(st.booleans()):
            key = draw(st.sampled_from(list(value)))
            return {k: v for k, v in value.items() if k != key}, "keys differ"
        return {**value, "a key not drawn": 0}, "keys differ"
    if isinstance(value, (list, tuple)):
        longer = not value or draw(st.booleans())
        return (type(value)([*value, 0]) if longer else value[:-1]), "lengths"
    return 0, "vs"  # None


@st.composite
def with_leaf(draw: st.DrawFn, kind: str) -> tuple[Any, list[Step]]:
    """A tree holding a leaf of the given kind somewhere, and the steps to that leaf.

    Random trees alone rarely hold, say, a NaN float or a multi-byte tensor at the changed place;
    planting one guarantees every kind of leaf its share of examples.
    """
    tree, leaf = draw(TREES, label="tree"), draw(LEAF_KINDS[kind], label="leaf")
    containers = [(steps, value) for steps, value in places(tree) if isinstance(value, (list, tuple, dict))]
    if not containers:
        return [tree, leaf], [1]
    steps, container = draw(st.sampled_from(containers), label="container")
    if isinstance(container, dict):
        return replaced(tree, steps, {**container, "planted": leaf}), [*steps, "planted"]
    items = list(container)
    at = draw(st.integers(0, len(items)), label="at")
    items.insert(at, leaf)
    return replaced(tree, steps, type(container)(items)), [*steps, at]


def assert_change_found(tree: Any, steps: list[Step], new: Any, detail: str) -> None:
    changed_tree = replaced(tree, steps, new)
    diff = first_difference(tree, changed_tree, "tree")
    assert diff is not None and diff.startswith(f"tree{path_of(steps)}: "), (steps, diff)
    assert detail in diff, (detail, diff)
    with pytest.raises(AssertionError) as raised:
        assert_same(tree, changed_tree, "tree")
    assert str(raised.value) == diff
    # Both directions: a change is a change whichever side holds the reference.
    assert first_difference(changed_tree, tree) is not None


@pytest.mark.parametrize("kind", LEAF_KINDS)
@given(data=st.data())
def test_a_tree_equals_its_copy(kind: str, data: st.DataObject) -> None:
    tree, _ = data.draw(with_leaf(kind))
    assert first_difference(tree, copy.deepcopy(tree)) is None
    assert_same(tree, copy.deepcopy(tree), "tree")


@pytest.mark.parametrize("kind", LEAF_KINDS)
@given(data=st.data())
def test_any_change_to_a_leaf_is_found_and_its_path_named(kind: str, data: st.DataObject) -> None:
    tree, steps = data.draw(with_leaf(kind))
    leaf = next(value for at, value in places(tree) if at == steps)
    new, detail = data.draw(changed(leaf), label="change")
    assert_change_found(tree, steps, new, detail)


@given(data=st.data())
def test_any_change_anywhere_in_a_tree_is_found_and_its_path_named(data: st.DataObject) -> None:
    # Containers included: a key added or dropped, a sequence longer or shorter.
    tree = data.draw(TREES, label="tree")
    steps, value = data.draw(st.sampled_from(list(places(tree))), label="place")
    new, detail = data.draw(changed(value), label="change")
    assert_change_found(tree, steps, new, detail)


def test_bits_not_values_decide() -> None:
    nan = float("nan")
    other_nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]
    assert first_difference(nan, nan) is None
    assert first_difference(torch.tensor([1.0, nan]), torch.tensor([1.0, nan])) is None
    assert first_difference(nan, other_nan) == "value: nan (bits 7ff8000000000000) vs nan (bits 7ff8000000000001)"
    assert first_difference(0.0, -0.0) == "value: 0.0 vs -0.0"
    assert first_difference(torch.zeros(3), -torch.zeros(3)) is not None
    assert first_difference(np.zeros(2), -np.zeros(2)) is not None
    assert first_difference(1, 1.0) == "value: int vs float (1 vs 1.0)"
    assert first_difference(torch.ones(2), torch.ones(2, dtype=torch.float64)) == (
        "value: torch.float32[2] vs torch.float64[2]"
    )


def test_layout_flags_and_container_types_are_not_state() -> None:
    # What a checkpoint's round trip may change without changing the state: memory layout, autograd
    # flags, key order, OrderedDict for dict, a list for a tuple (JSON; torch's distributed
    # optimizer state gives Adam's betas back as a list).
    square = torch.arange(6.0).reshape(2, 3)
    assert first_difference(square.t(), square.t().contiguous()) is None
    assert first_difference(square.requires_grad_(), square.detach()) is None
    assert first_difference(OrderedDict(a=1, b=2), {"b": 2, "a": 1}) is None
    assert first_difference({"betas": (0.9, 0.95)}, {"betas": [0.9, 0.95]}) is None
    assert first_difference((0.9, 0.95), [0.9, 0.96], "betas") == "betas[1]: 0.95 vs 0.96"


def test_strict_containers_also_compares_container_types_and_key_order_at_any_depth() -> None:
    # For what must come back unchanged (a torch.save round trip, a refused load): the container
    # differences a round trip may make are then differences, named by their path, and nothing else
    # changes (equal trees still compare equal, leaves are still compared bit for bit).
    state = {"model": OrderedDict(w=torch.ones(2), b=torch.zeros(1)), "betas": (0.9, 0.95), "steps": [1, 2]}
    assert first_difference(state, copy.deepcopy(state), strict_containers=True) is None
    reordered = {**state, "model": OrderedDict(b=torch.zeros(1), w=torch.ones(2))}
    plain = {**state, "model": dict(state["model"])}
    listed = {**state, "betas": [0.9, 0.95]}
    assert first_difference(reordered, state) is None
    assert first_difference(state, reordered, "state", strict_containers=True) == (
        "state['model']: key order differs: ['w', 'b'] vs ['b', 'w']"
    )
    assert first_difference(state, plain, "state", strict_containers=True) == "state['model']: OrderedDict vs dict"
    assert first_difference(state, listed, "state", strict_containers=True) == "state['betas']: tuple vs list"
    flipped = copy.deepcopy(state)
    flipped["model"]["w"][1] = -1.0
    assert first_difference(state, flipped, "state", strict_containers=True) == (
        "state['model']['w']: 1 of 2 elements differ, first at index (1,): 1.0 vs -1.0"
    )
    with pytest.raises(AssertionError, match=r"^state\['betas'\]: tuple vs list$"):
        assert_same(state, listed, "state", strict_containers=True)


def test_a_tensor_difference_names_the_element() -> None:
    expected = torch.arange(12).reshape(3, 4)
    actual = expected.clone()
    actual[2, 1] = -1
    assert first_difference([{"x": expected}], [{"x": actual}], "batches") == (
        "batches[0]['x']: 1 of 12 elements differ, first at index (2, 1): 9 vs -1"
    )
