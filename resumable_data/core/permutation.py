"""A keyed permutation of ``[0, length)`` evaluated per position: uniform at every size, O(1) to restore.

``Permutation(length, seed, epoch)(positions)`` answers "which index sits at these positions of the
epoch's shuffled order", whatever ``length`` is. That is what makes a restore O(1) in the position:
the loader computes the indices from the saved position onwards and nothing before it.

Two constructions, by size:

- ``length <= EXACT_MAX`` (2**14): an exact shuffle. Every index gets a 64-bit key, a SplitMix64
  hash of ``(seed, epoch, index)``; the order is the indices sorted by key. The keys of one epoch are
  distinct (the hash is a bijection of the index for a fixed prefix), so every one of the
  ``length!`` orders is reachable and, the hash being random, equally likely: the tests cannot tell
  it from ``torch.randperm`` (all orders for n <= 7, position pairs and cycle structure up to
  n = 64). The table (``length`` hashes and a sort) is built once per ``(length, seed, epoch)`` on
  first use and kept by the object; each position is then a lookup.
- larger lengths: :class:`FeistelPermutation`, a keyed Feistel network with cycle walking,
  evaluated per position without any table (10**9 samples cost nothing to set up).

The threshold: a Feistel network is not uniform on small domains. It reaches only even
permutations of its ``2**b`` values, and with few bits per half its round functions have few
inputs; ``tests/core/test_permutation.py`` shows the bias over all orders of 5 elements. With at
least 15 bits (7 or more per half) the statistical tests see nothing, while the exact shuffle's
table would make a restore sort ever more keys before its first batch.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from .hash import hash_ints, hash_more, hash_more_array
from .state import check_int_arg

__all__ = ["EXACT_MAX", "ORDER_VERSION", "ROUNDS", "FeistelPermutation", "Permutation", "PiecewisePermutation"]

ORDER_VERSION = 2
"""Which orders ``Permutation`` gives. 1: the Feistel network at every length (resumable_data
0.1.0); 2: the exact shuffle up to :data:`EXACT_MAX`, the same Feistel network above it (so orders
of more than ``EXACT_MAX`` elements are those of version 1)."""
EXACT_MAX = 2**14
_EXACT_SALT = 0x6578616374  # "exact": the sort keys' last hash input
_PIECE_SALT = 0x7069656365  # "piece": the seed of each appended piece's own permutation
ROUNDS = 12
# Below 4 bits (2 per part) a round function has too few inputs to mix tiny domains evenly.
_MIN_BITS = 4
SCALAR_TAIL = 16  # stragglers of a cycle walk finished one by one in Python ints (same result)
SCALAR_MAX = 32  # so few positions (a restore's first batch) are done in Python ints from the start
_MASK64 = (1 << 64) - 1


class Permutation:
    """The shuffled order of epoch ``epoch``: a pure function of ``(length, seed, epoch)``.

    Args:
        length: size of the permuted range ``[0, length)``; at least 1.
        seed: any int; the same seed and epoch give the same order on every machine.
        epoch: epoch number (>= 0).

    Example:
        >>> perm = Permutation(10**9, seed=0, epoch=3)
        >>> perm(np.arange(900_000_000, 900_000_004))  # four indices, no 10**9 array
        array([177632482, 443678275, 318942362, 407191865])
    """

    def __init__(self, length: int, seed: int, epoch: int) -> None:
        self.length = check_int_arg("length", length, minimum=1)
        self.seed = seed
        self.epoch = check_int_arg("epoch", epoch, minimum=0)
        self._feistel = FeistelPermutation(length, seed, epoch) if length > EXACT_MAX else None
        self._table: np.ndarray | None = None  # the exact shuffle, built on first use

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Map positions (int array, each in ``[0, length)``) to indices, elementwise."""
        if self._feistel is not None:
            return self._feistel(positions)
        return self._order()[_checked(positions, self.length)]

    def _order(self) -> np.ndarray:
        """The exact shuffle's table, built on first use."""
        if self._table is None:
            keys = hash_more_array(hash_ints(self.seed, self.epoch), np.arange(self.length), _EXACT_SALT)
            self._table = np.argsort(keys).astype(np.int64)
        return self._table

    def __getitem__(self, position: int) -> int:
        """The index at one position."""
        return int(self(np.array([position], dtype=np.int64))[0])

    def inverse(self, indices: np.ndarray) -> np.ndarray:
        """Map indices (int array, each in ``[0, length)``) to the positions they sit at, elementwise.

        ``perm.inverse(perm(p)) == p``: which position of the epoch reads an index, at the cost of one
        position (the Feistel network run backwards; below :data:`EXACT_MAX`, the table's inverse).
        """
        if self._feistel is not None:
            return self._feistel.inverse(indices)
        indices = _checked(indices, self.length)
        inverse = np.empty(self.length, dtype=np.int64)
        inverse[self._order()] = np.arange(self.length, dtype=np.int64)
        return inverse[indices]

    def __len__(self) -> int:
        return self.length


class PiecewisePermutation:
    """The order of an epoch whose data grew: each appended piece shuffled on its own, after the rest.

    ``ends`` are the lengths the order was built over, ascending: piece 0 is ``[0, ends[0])`` in
    the order of ``Permutation(ends[0], seed, epoch)`` — so with one piece this *is* that order, and
    an epoch that never grew reads as before —, and piece ``k`` is the indices ``[ends[k-1],
    ends[k])`` at the positions ``[ends[k-1], ends[k])``, shuffled by a permutation keyed by
    ``(seed, ends[k-1])``. Items appended mid-epoch therefore come after every position of the
    order they were appended to, each exactly once, and the positions before them keep their index.

    Args:
        ends: the piece ends, strictly ascending, the first at least 1.
        seed: any int.
        epoch: epoch number (>= 0).

    Example:
        >>> order = PiecewisePermutation((4, 6), seed=0, epoch=0)
        >>> order(np.arange(6))[:4].tolist() == Permutation(4, 0, 0)(np.arange(4)).tolist()
        True
        >>> sorted(order(np.arange(4, 6)).tolist())
        [4, 5]
    """

    def __init__(self, ends: tuple[int, ...], seed: int, epoch: int) -> None:
        if not ends or ends[0] < 1 or any(b <= a for a, b in itertools.pairwise(ends)):
            raise ValueError(f"ends must be strictly ascending lengths >= 1, but got {ends!r}")
        self.ends = tuple(ends)
        self.seed = seed
        self.epoch = epoch
        self.length = self.ends[-1]
        starts = (0, *self.ends[:-1])
        self._starts = np.asarray(starts, dtype=np.int64)
        self._pieces = [Permutation(self.ends[0], seed, epoch)] + [
            Permutation(end - start, hash_ints(seed, _PIECE_SALT, start), epoch)
            for start, end in zip(starts[1:], self.ends[1:], strict=True)
        ]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Map positions (int array, each in ``[0, ends[-1])``) to indices, elementwise."""
        if len(self._pieces) == 1:
            return self._pieces[0](positions)
        positions = _checked(positions, self.length).astype(np.int64)
        which = np.searchsorted(self._starts, positions, side="right") - 1
        out = np.empty_like(positions)
        for k in np.unique(which).tolist():
            mask = which == k
            start = int(self._starts[k])
            out[mask] = start + self._pieces[k](positions[mask] - start)
        return out

    def inverse(self, indices: np.ndarray) -> np.ndarray:
        """Map indices to their positions, elementwise: a piece's indices sit at that piece's positions."""
        if len(self._pieces) == 1:
            return self._pieces[0].inverse(indices)
        indices = _checked(indices, self.length).astype(np.int64)
        which = np.searchsorted(self._starts, indices, side="right") - 1
        out = np.empty_like(indices)
        for k in np.unique(which).tolist():
            mask = which == k
            start = int(self._starts[k])
            out[mask] = start + self._pieces[k].inverse(indices[mask] - start)
        return out

    def __len__(self) -> int:
        return self.length


def _checked(positions: Any, length: int) -> np.ndarray:
    positions = np.asarray(positions)
    if positions.size and (positions.min() < 0 or positions.max() >= length):
        raise IndexError(f"positions must lie in [0, {length}), got range [{positions.min()}, {positions.max()}]")
    return positions


class FeistelPermutation:
    """A keyed Feistel network with cycle walking: a bijection of ``[0, length)`` per ``(seed, epoch)``.

    What :class:`Permutation` uses above :data:`EXACT_MAX`; any position costs the same, with no
    table. An alternating Feistel network on ``b`` bits (``2**b >= length``, ``b >= 4``) with
    ``rounds`` rounds whose round function is a multiply-shift hash: the top bits of
    ``(part XOR round key) * round multiplier`` (64-bit, wrapping), which depend on every bit of
    the part; keys and odd multipliers are SplitMix64 hashes of ``(seed, epoch, round)``. The ``b``
    bits are split into two parts of ``ceil(b/2)`` and ``floor(b/2)`` bits whose roles swap every
    round, so odd ``b`` needs no padding. A Feistel network is a bijection for any round function,
    and cycle walking (re-applying it until the value falls inside ``[0, length)``) restricts it to
    a bijection of ``[0, length)``: a true permutation for every length by construction (a peer's
    index shuffle loses one index at ``2**16 + 1``; the tests check such sizes).

    Cost: the domain is less than twice ``length``, so cycle walking takes under two network
    evaluations per position on average; each round is eight in-place numpy operations on the
    whole chunk. The last few stragglers of a cycle walk (at most :data:`SCALAR_TAIL`) finish in
    plain Python ints, and a chunk of at most :data:`SCALAR_MAX` positions (a restore's first
    batch) is done in Python ints from the start, without building the numpy constants at all.

    Args:
        length: size of the permuted range; at least 1.
        seed: any int.
        epoch: epoch number (>= 0).
        rounds: Feistel rounds (4 is the Luby-Rackoff minimum and visibly biased on small domains).
    """

    def __init__(self, length: int, seed: int, epoch: int, *, rounds: int = ROUNDS) -> None:
        self.length = check_int_arg("length", length, minimum=1)
        self.seed = seed
        self.epoch = check_int_arg("epoch", epoch, minimum=0)
        check_int_arg("rounds", rounds, minimum=1)
        bits = max(_MIN_BITS, (length - 1).bit_length())
        # Round r splits x into (high, low) with `low_bits` low bits, then maps it to
        # (low, high ^ F(low)): the next round's split is the other way round.
        # Key hash_ints(seed, epoch, r) and multiplier hash_ints(seed, epoch, r, 1) | 1, sharing
        # the (seed, epoch) prefix: a restore builds a Permutation, so this is on its path.
        prefix = hash_ints(seed, epoch)
        self._scalar_rounds: list[tuple[int, ...]] = []
        low_bits, high_bits = bits // 2, bits - bits // 2
        for r in range(rounds):
            key = hash_more(prefix, r)
            self._scalar_rounds.append(
                (key, hash_more(key, 1) | 1, low_bits, (1 << low_bits) - 1, high_bits, 64 - high_bits)
            )
            low_bits, high_bits = high_bits, low_bits
        self._vector_rounds: list[tuple[Any, ...]] | None = None  # built on first vectorized use

    @property
    def _rounds(self) -> list[tuple[Any, ...]]:
        """The round constants as numpy uint64 scalars, for the vectorized network (one array
        conversion rather than a np.uint64() call per constant). Lazy: a restore's first batch is
        small enough for plain ints and never needs them."""
        if self._vector_rounds is None:
            self._vector_rounds = [tuple(row) for row in np.array(self._scalar_rounds, dtype=np.uint64)]
        return self._vector_rounds

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        """One pass of the network over a uint64 array, in place (returns it)."""
        for key, multiplier, low_bits, low_mask, high_bits, drop in self._rounds:
            low = x & low_mask
            f = low ^ key
            f *= multiplier
            f >>= drop  # the top high_bits bits of the product: F(low)
            x >>= low_bits  # the high part
            x ^= f
            low <<= high_bits
            x |= low
        return x

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Map positions (int array, each in ``[0, length)``) to indices, elementwise."""
        positions = _checked(positions, self.length)
        if positions.size <= SCALAR_MAX:
            return np.array([self._walk_scalar(self._network_scalar(p)) for p in positions.tolist()], dtype=np.int64)
        out = self._feistel(positions.astype(np.uint64))
        outside = np.flatnonzero(out >= self.length)
        while outside.size > SCALAR_TAIL:  # cycle walking: only the stragglers are re-encrypted
            walked = self._feistel(out[outside])
            out[outside] = walked
            outside = outside[walked >= self.length]
        for i in outside.tolist():
            out[i] = self._walk_scalar(int(out[i]))
        return out.astype(np.int64)

    def _network_scalar(self, x: int) -> int:
        """One pass of the network over a Python int: the same network as :meth:`_feistel`."""
        for key, multiplier, low_bits, low_mask, high_bits, drop in self._scalar_rounds:
            low = x & low_mask
            x = (x >> low_bits) ^ ((((low ^ key) * multiplier) & _MASK64) >> drop) | (low << high_bits)
        return x

    def _walk_scalar(self, x: int) -> int:
        """The rest of one value's cycle walk in Python ints."""
        while x >= self.length:
            x = self._network_scalar(x)
        return x

    def _inverse_scalar(self, y: int) -> int:
        """One pass of the network backwards: each round undone, last round first."""
        for key, multiplier, low_bits, _, high_bits, drop in reversed(self._scalar_rounds):
            low = y >> high_bits  # the round moved its low part to the top
            high = (y & ((1 << high_bits) - 1)) ^ ((((low ^ key) * multiplier) & _MASK64) >> drop)
            y = (high << low_bits) | low
        return y

    def inverse(self, indices: np.ndarray) -> np.ndarray:
        """Map indices to their positions, elementwise: the network backwards, with cycle walking.

        Cycle walking backwards inverts cycle walking forwards (both follow the same cycles of the
        network, in opposite directions, to the nearest value inside ``[0, length)``), so each index
        costs what a position costs. Python ints: a question is about a few samples, not an epoch.
        """
        out = []
        for y in _checked(indices, self.length).tolist():
            x = self._inverse_scalar(y)
            while x >= self.length:
                x = self._inverse_scalar(x)
            out.append(x)
        return np.array(out, dtype=np.int64)

    def __getitem__(self, position: int) -> int:
        """The index at one position."""
        return int(self(np.array([position], dtype=np.int64))[0])

    def __len__(self) -> int:
        return self.length
