"""StreamLoader(batches_per_message=k): workers send k batches to a message, nothing else changes.

The specification: with any k the loader hands out the same batches in the same order, with the
same state after each, as with k = 1; a state saved with one k resumes bitwise under another; and
the main process's reordering (``slots.interleaved``) gives the order a DataLoader gives single
batches, for every mix of slot lengths. Every loader with workers has a 60 s DataLoader timeout. Why it exists: each message from a worker costs a fixed
amount, more than a small batch's work (benchmarks/bench_remote.py, section 1, measures it).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_resumes_identically, checkpoint_roundtrip
from resumable_data import ResumeError
from resumable_data.streams import ShardedIterable, Stream, StreamLoader, TokenShardReader, mix
from resumable_data.streams.slots import interleaved
from streams_harness import MemoryShards, write_token_shards

WINDOW = 5


def dataloader_order(lengths: list[int], order: list[int], k: int) -> list[list[tuple[int, int]]]:
    """The messages a DataLoader hands out, in order: per round, each worker still running (in
    ``order``) sends its next ``k`` batches; a worker with none left is skipped for good."""
    messages, sent = [], dict.fromkeys(order, 0)
    alive = [slot for slot in order if lengths[slot]]
    while alive:
        for slot in list(alive):
            group = [(slot, b) for b in range(sent[slot], min(sent[slot] + k, lengths[slot]))]
            sent[slot] += len(group)
            messages.append(group)
            if sent[slot] == lengths[slot]:
                alive.remove(slot)
    return messages


def one_at_a_time(lengths: list[int], order: list[int]) -> list[tuple[int, int]]:
    """What a DataLoader hands out with one batch to a message: round-robin, exhausted skipped."""
    return [(slot, b) for b in range(max(lengths, default=0)) for slot in order if b < lengths[slot]]


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    k=st.integers(1, 5),
    first=st.integers(0, 3),
)
def test_interleaving_messages_gives_the_order_of_single_batches(lengths: list[int], k: int, first: int) -> None:
    order = [(first + w) % len(lengths) for w in range(len(lengths))]
    messages = [
        [(slot, b, {}, f"batch {slot}.{b}") for slot, b in group] for group in dataloader_order(lengths, order, k)
    ]
    got = [(slot, b) for slot, b, _, _ in interleaved(messages, order)]
    assert got == one_at_a_time(lengths, order)


# -- the loader ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def token_paths(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    # Uneven shards, one shorter than a window: slots end at different batches.
    return write_token_shards(tmp_path_factory.mktemp("tokens"), [41, 90, 3, 66, 27, 58])


def augmented(paths: list[Path]) -> Stream:
    """Token shards -> shuffle window -> a random augmentation drawn from torch's global RNG."""
    source = ShardedIterable(paths, read_shard=TokenShardReader(WINDOW), seed=3)
    return source.shuffle_window(20, seed=4).map(lambda t: t + torch.randint(0, 100, t.shape))


def mixed(_: list[Path]) -> Stream:
    """Two in-memory sources through shuffle buffers, mixed, packed."""
    a, b = MemoryShards([9, 4, 13, 6]), MemoryShards([7, 11, 2])
    left = ShardedIterable(a.names, read_shard=a, seed=1).shuffle_buffer(5, seed=2)
    right = ShardedIterable(b.names, read_shard=b, seed=3).shuffle_buffer(3, seed=4)
    return mix([left, right], seed=5).map(lambda x: [x, x + 1]).pack(3, eos=0)


PIPELINES = {"augmented token windows": augmented, "mixed and packed": mixed}


def batches_and_states(loader: StreamLoader, epochs: int) -> list[tuple[Any, dict[str, Any]]]:
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out += [(batch, loader.state_dict()) for batch in loader]
    return out


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
@pytest.mark.parametrize(("num_workers", "k"), [(2, 3), (3, 2), (2, 64)])
def test_any_batches_per_message_gives_the_same_batches_and_states(
    token_paths: list[Path], pipeline: str, num_workers: int, k: int
) -> None:
    def run(per_message: int) -> list[tuple[Any, dict[str, Any]]]:
        stream = PIPELINES[pipeline](token_paths)
        loader = StreamLoader(
            stream, batch_size=4, num_workers=num_workers, batches_per_message=per_message, timeout=60
        )
        return batches_and_states(loader, epochs=2)

    reference, grouped = run(1), run(k)
    assert len(grouped) == len(reference) > 2 * num_workers * 2  # slots of several messages each
    for (batch, state), (ref_batch, ref_state) in zip(grouped, reference, strict=True):
        torch.testing.assert_close(batch, ref_batch, rtol=0, atol=0)
        assert state == ref_state


def test_a_grouped_loader_resumes_identically_and_into_another_k(token_paths: list[Path]) -> None:
    def make(per_message: int = 4) -> StreamLoader:
        return StreamLoader(
            augmented(token_paths), batch_size=3, num_workers=2, batches_per_message=per_message, timeout=60
        )

    n = len(list(make()))
    # inside a message, at its edge, twice at one point, the epoch's last batch, into the next epoch
    assert_resumes_identically(make, [1, 4, 4, 9, n, n + 5], total=n + 9)
    assert_resumes_identically(make, [6, 11], total=n + 3, make_resumed=lambda: make(1))


def test_a_restore_inside_a_message_does_not_count_the_batches_held_back(token_paths: list[Path]) -> None:
    loader = StreamLoader(augmented(token_paths), batch_size=3, num_workers=2, batches_per_message=8, timeout=60)
    taken = list(itertools.islice(iter(loader), 5))  # the workers have sent more than 5 by now
    assert sum(loader.state_dict()["batches"].values()) == len(taken)
    restored = StreamLoader(augmented(token_paths), batch_size=3, num_workers=2, timeout=60)
    restored.load_state_dict(checkpoint_roundtrip(loader.state_dict()))
    reference = list(
        itertools.islice(iter(StreamLoader(augmented(token_paths), batch_size=3, num_workers=2, timeout=60)), 8)
    )
    torch.testing.assert_close(list(itertools.islice(iter(restored), 3)), reference[5:], rtol=0, atol=0)


@pytest.mark.parametrize("value", [0, -1, 2.0, True, "8"])
def test_batches_per_message_must_be_a_positive_int(value: Any) -> None:
    shards = MemoryShards([3])
    with pytest.raises(ResumeError, match="batches_per_message should be an integer >= 1"):
        StreamLoader(ShardedIterable(shards.names, read_shard=shards), batches_per_message=value)
