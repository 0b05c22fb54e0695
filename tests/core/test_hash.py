"""DrawHashes: the chunked hashes a shuffle buffer and a mix draw from are hash_ints' own numbers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_data.core.hash import DRAW_CHUNK, DrawHashes, hash_ints

INT64_MAX = 2**63 - 1


@settings(max_examples=25)
@given(
    seed=st.integers(-(2**63), INT64_MAX),
    epoch=st.integers(0, INT64_MAX),
    draws=st.lists(st.integers(0, INT64_MAX - 2 * DRAW_CHUNK), min_size=1, max_size=8),
)
def test_each_draw_hash_is_hash_ints_of_seed_epoch_and_draw(seed: int, epoch: int, draws: list[int]) -> None:
    hashes = DrawHashes(seed)
    for draw in draws:  # jumps back and forth: every chunk boundary and cache miss
        assert hashes.at(epoch, draw) == hash_ints(seed, epoch, draw)
        assert hashes.at(epoch + 1, draw) == hash_ints(seed, epoch + 1, draw)
        stop = draw + DRAW_CHUNK + 3  # past the cached chunk
        assert hashes.between(epoch, draw, stop) == [hash_ints(seed, epoch, d) for d in range(draw, stop)]
        assert hashes.between(epoch, draw + 1, draw + 1) == []
