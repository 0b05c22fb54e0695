"""Pack: concatenate variable-length token records into windows of ``block_size`` tokens.

LLM pretraining reads documents of any length and trains on fixed windows. ``pack(block_size)``
appends each record's tokens (with an optional ``eos`` after each) to a running sequence and cuts
it into consecutive windows; a record longer than a window spans several, and a window usually
ends inside a record whose rest starts the next window.

State: a position, never tokens. Between two windows the only tokens read but not handed out are
the rest of the record the last window ended in, so the state is that record's key (``carry``,
``[epoch, shard, offset]``) and how many of its tokens were handed out (``carry_offsets``), with
the source's state under ``"source"``::

    >>> from resumable_data.streams import ShardedIterable
    >>> documents = {"a": [[1, 2, 3], [4, 5]], "b": [[6, 7, 8, 9]]}
    >>> def read(shard, start):
    ...     return iter(documents[shard][start:])
    >>> windows = ShardedIterable(["a", "b"], read_shard=read, shuffle=False).pack(5, eos=0)
    >>> next(iter(windows)).tolist()  # [1, 2, 3], its eos, and 1 token of record 1 of shard "a"
    [1, 2, 3, 0, 4]
    >>> {key: value for key, value in windows.state_dict().items() if key != "source"}
    {'version': 2, 'epoch': 0, 'block_size': 5, 'eos': 0, 'pad_id': None, 'boundaries': False,
     'carry': [[0, 0, 1]], 'carry_offsets': [1]}

A restore re-reads the carried record by key (:meth:`~Stream.fetch_many`, through the stages
before ``pack``: a ``map`` tokenizer runs again on it) and goes on from its offset: one record,
never a replay of the epoch. ``carry`` is a list because a layout change (another number of
workers or ranks) deals the old slots' carried records to the new slots, each new slot handing
out the rest of its carried records before reading its source: every token of the epoch is still
handed out exactly once.

Boundaries. With ``boundaries=True`` a window is ``{"input_ids": tokens, "position_ids": p}``,
where ``p`` counts from 0 at the window's start and again at each document's first token (the
convention of packed-sequence attention: ``position_ids == 0`` marks where a document starts, and
:func:`cu_seqlens` turns a batch of them into the cumulative lengths a variable-length attention
kernel takes).

The end of an epoch. The last window of an epoch (of each worker/rank slot) is usually short: it is
dropped, or padded to ``block_size`` with ``pad_id`` when one is given (padding is a document of
its own for ``position_ids``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core.state import VERSION, brief, check_int_arg, is_int, require_bool
from ..errors import ResumeError
from .base import (
    EPOCH,
    MAX_COUNT,
    SOURCE,
    STREAM_STATE_VERSION,
    Key,
    Stream,
    check_same,
    record_key,
    require_key,
)
from .wrapper import Wrapper

__all__ = ["Pack", "cu_seqlens", "token_array"]

_WHAT = "pack"
BLOCK_SIZE = "block_size"
EOS = "eos"
PAD_ID = "pad_id"
BOUNDARIES = "boundaries"
CARRY = "carry"  # keys of the records read whose tokens are not all handed out, in order
CARRY_OFFSETS = "carry_offsets"  # per carried record: how many of its tokens are handed out
INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"


@dataclass
class _Carried:
    """A record whose tokens from ``offset`` on are still to be handed out (``tokens`` is None
    after a restore, until the record is re-read)."""

    key: Key
    offset: int
    tokens: np.ndarray | None  # without the eos


class Pack(Wrapper):
    """Windows of ``block_size`` tokens from consecutive token records; see the module docstring.

    Args:
        source: a stream of token records (1-D int tensors, numpy arrays or lists of ints) whose
            records can be re-read by key (a :class:`ShardedIterable`, possibly behind ``map``,
            ``filter``, ``shuffle_buffer``, ``shuffle_window`` or ``mix``).
        block_size: tokens per window.
        eos: a token appended after each record (a document separator), or None.
        boundaries: yield ``{"input_ids", "position_ids"}`` dicts instead of token tensors.
        pad_id: pad each slot's last, short window of an epoch with this token (None: drop it).

    Windows are int64 tensors. Each has a key, ``(*first record's key, offset)``, so a
    ``map(seed=...)`` after ``pack`` draws per-window randomness; windows cannot be re-read by key,
    so ``shuffle_buffer`` goes before ``pack``, not after.

    Example:
        >>> from resumable_data import ShardedIterable
        >>> documents = {"a": [[1, 2, 3], [4, 5]], "b": [[6, 7, 8, 9]]}
        >>> def read(shard, start):
        ...     return iter(documents[shard][start:])
        >>> def pipeline():
        ...     return ShardedIterable(["a", "b"], read_shard=read, shuffle=False).pack(5, eos=0)
        >>> stream = pipeline()
        >>> next(iter(stream)).tolist()  # document [1, 2, 3], its eos, then [4, 5] starts
        [1, 2, 3, 0, 4]
        >>> state = stream.state_dict()
        >>> state["carry"], state["carry_offsets"]  # record 1 of shard a: 1 of its 3 tokens handed out
        ([[0, 0, 1]], [1])
        >>> resumed = pipeline()
        >>> resumed.load_state_dict(state)
        >>> [w.tolist() for w in resumed]  # re-reads that one record; the short last window is dropped
        [[5, 0, 6, 7, 8]]
    """

    POSITION_KEYS = frozenset({EPOCH, CARRY, CARRY_OFFSETS})

    def __init__(
        self,
        source: Stream,
        block_size: int,
        *,
        eos: int | None = None,
        boundaries: bool = False,
        pad_id: int | None = None,
    ) -> None:
        super().__init__(source)
        if not source.keyed:
            raise TypeError("pack concatenates token records; apply it before batch()")
        if not source.fetchable:
            raise TypeError(
                "pack needs a source that can re-read a record from its key (ShardedIterable, map, filter, "
                f"shuffle_buffer, shuffle_window, mix), so that its state holds a key rather than tokens; got "
                f"{type(source).__name__}"
            )
        self.fetchable = False
        source.expect_rereads()  # a restore re-reads the carried record by key
        self.block_size = check_int_arg("block_size", block_size, minimum=1)
        self.eos = None if eos is None else check_int_arg("eos", eos, minimum=0)
        self.pad_id = None if pad_id is None else check_int_arg("pad_id", pad_id, minimum=0)
        self.boundaries = bool(boundaries)
        self._carry: list[_Carried] = []
        self._arange = np.arange(self.block_size, dtype=np.int64)  # position ids are slices of it

    # -- iteration -----------------------------------------------------------------------------
    def iter_keyed(self) -> Iterator[tuple[Key | None, Any]]:
        records = self.source.iter_keyed()
        while True:
            self._reread()
            window = self._fill(records)
            if window is None:
                return
            key, tokens, positions = window
            yield key, tokens if positions is None else {INPUT_IDS: tokens, POSITION_IDS: positions}

    def _fill(self, records: Iterator[tuple[Key | None, Any]]) -> tuple[Key, torch.Tensor, torch.Tensor | None] | None:
        """The next window: its key, its tokens and (with ``boundaries``) its position ids; None at
        the epoch's end, or for its short last window unless ``pad_id`` pads it.

        Tokens are copied into one preallocated array (numpy: a small copy there costs a fraction
        of a ``torch.cat``), and a record's ``eos`` is written after its tokens rather than appended
        to each record. A record read here that fits in the rest of the window is copied at once,
        without passing through the carried records (most records: a window holds many).
        """
        size, eos, carry = self.block_size, self.eos, self._carry
        window = np.empty(size, dtype=np.int64)
        positions = np.empty(size, dtype=np.int64) if self.boundaries else None
        filled, first = 0, None
        while filled < size:
            if not carry:
                item = next(records, None)
                if item is None:
                    break
                key = record_key(item[0], _WHAT)
                read = self._tokens(item[1], key)
                n = len(read)
                length = n + (eos is not None)
                if length > size - filled:  # the window ends inside it: carried into the next one
                    carry.append(_Carried(key, 0, read))
                elif length:
                    if first is None:
                        first = (*key, 0)
                    window[filled : filled + n] = read
                    if eos is not None:
                        window[filled + n] = eos
                    if positions is not None:
                        positions[filled : filled + length] = self._arange[:length]
                    filled += length
                continue
            head = carry[0]
            tokens = head.tokens
            assert tokens is not None  # re-read by _reread
            length = len(tokens) + (eos is not None)
            take = min(size - filled, length - head.offset)
            if take:
                if first is None:
                    first = (*head.key, head.offset)
                real = min(head.offset + take, len(tokens)) - head.offset
                window[filled : filled + real] = tokens[head.offset : head.offset + real]
                if eos is not None and real < take:  # the piece ends with the record's eos
                    window[filled + real] = eos
                if positions is not None:
                    positions[filled : filled + take] = self._arange[:take]
                filled += take
            head.offset += take
            if head.offset == length:
                carry.pop(0)
        if first is None:
            return None  # nothing left
        if filled < size:  # the epoch's short last window: dropped, or padded
            if self.pad_id is None:
                return None
            window[filled:] = self.pad_id
            if positions is not None:
                positions[filled:] = self._arange[: size - filled]
        return first, torch.from_numpy(window), None if positions is None else torch.from_numpy(positions)

    def _tokens(self, record: Any, key: Key) -> np.ndarray:
        if type(record) is np.ndarray and record.dtype == np.int64 and record.ndim == 1:
            return record  # what token_array returns for it, without naming the record for an error
        return token_array(record, f"pack: record {list(key)}")

    def _reread(self) -> None:
        """Re-read the carried records of a restored state (one grouped read), before anything moves."""
        unread = [carried for carried in self._carry if carried.tokens is None]
        if not unread:
            return
        records = self.source.fetch_many([carried.key for carried in unread])
        tokens = [self._tokens(record, carried.key) for carried, record in zip(unread, records, strict=True)]
        for carried, t in zip(unread, tokens, strict=True):
            length = len(t) + (self.eos is not None)
            if carried.offset >= length:
                raise ResumeError(
                    f"{_WHAT}: the checkpoint handed out {carried.offset} tokens of record {list(carried.key)}, "
                    f"which now has {length}; the data changed since the checkpoint"
                )
        for carried, t in zip(unread, tokens, strict=True):
            carried.tokens = t

    # -- state ---------------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        return {BLOCK_SIZE: self.block_size, EOS: self.eos, PAD_ID: self.pad_id, BOUNDARIES: self.boundaries}

    def _own_state(self) -> dict[str, Any]:
        return {
            **self._config(),
            CARRY: [list(carried.key) for carried in self._carry],
            CARRY_OFFSETS: [carried.offset for carried in self._carry],
        }

    def _own_state_fresh(self) -> dict[str, Any]:
        return {**self._config(), CARRY: [], CARRY_OFFSETS: []}

    def state_dict(self) -> dict[str, Any]:
        return self._with_carried(super().state_dict())

    def state_update(self) -> dict[str, Any]:
        return self._with_carried(super().state_update())

    def _with_carried(self, state: dict[str, Any]) -> dict[str, Any]:
        # A restore re-reads the carried records by key: the source keeps their shards' identities
        # (with_held), also of a shard it has finished, so a shard changed under them is refused.
        if self._carry:
            shards = {tuple(carried.key[:-1]) for carried in self._carry}
            state[SOURCE] = self.source.with_held(state[SOURCE], shards)
        return state

    def _reset_own(self) -> None:
        self._carry = []

    def _check_own(self, state: Mapping[str, Any]) -> Callable[[], None]:
        remedy = "build pack with the checkpoint's arguments"
        for field, current in self._config().items():
            if field == BOUNDARIES:
                require_bool(state, field, _WHAT)
            check_same(_WHAT, field, state.get(field), current, remedy)
        carried = carried_keys(state, CARRY, _WHAT)
        offsets = state.get(CARRY_OFFSETS)
        if (
            not isinstance(offsets, list)
            or len(offsets) != len(carried)
            or not all(is_int(o) and 0 <= o <= MAX_COUNT for o in offsets)
        ):
            raise ResumeError(
                f"{_WHAT} state field {CARRY_OFFSETS!r} must be {len(carried)} ints >= 0 (one per carried record), "
                f"but got {brief(offsets)}"
            )
        check_key = self.source.key_checker(state[SOURCE])
        for key in carried:
            check_key(key)

        def apply() -> None:
            self._carry = [_Carried(key, offset, None) for key, offset in zip(carried, offsets, strict=True)]

        return apply

    fetch = Stream.fetch
    fetch_many = Stream.fetch_many

    def key_checker(self, state: Mapping[str, Any] | None) -> Callable[[Key], None]:
        # Windows are not records of the source: their keys are checked by nobody downstream.
        return Stream.key_checker(self, state)

    def rebalance(
        self, states: Sequence[Mapping[str, Any]], num_slots: int, pending: list[Key]
    ) -> list[dict[str, Any]]:
        # A carried record was partly handed out, so it cannot go back to the sources as a pending
        # record: the new slots hand out the rest of the old slots' carried records themselves.
        sources = self.source.rebalance([s[SOURCE] for s in states], num_slots, pending)
        carried = [(list(key), offset) for s in states for key, offset in zip(s[CARRY], s[CARRY_OFFSETS], strict=True)]
        return [
            {
                VERSION: STREAM_STATE_VERSION,
                EPOCH: states[0][EPOCH],
                **self._config(),
                CARRY: [key for key, _ in carried[slot::num_slots]],
                CARRY_OFFSETS: [offset for _, offset in carried[slot::num_slots]],
                SOURCE: source,
            }
            for slot, source in enumerate(sources)
        ]


def carried_keys(state: Mapping[str, Any], field: str, what: str) -> list[Key]:
    """Read a list of distinct record keys (records a stage read and holds by key) from ``state``."""
    raw = state.get(field)
    if not isinstance(raw, list):
        raise ResumeError(f"{what} state field {field!r} must be a list of record keys, but got {brief(raw)}")
    keys = [require_key(key, f"{what} state field {field!r}") for key in raw]
    if len(set(keys)) != len(keys):
        raise ResumeError(f"{what} state holds a record twice in {field!r}: {brief(raw)}")
    return keys


def token_array(record: Any, what: str) -> np.ndarray:
    """A token record (1-D int tensor, numpy array or list of ints) as a 1-D int64 array."""
    if isinstance(record, torch.Tensor):
        if record.dtype.is_floating_point or record.dtype.is_complex or record.dtype == torch.bool:
            raise TypeError(f"{what}: a token record must hold ints, but got {record.dtype}")
        record = record.detach().cpu().numpy()
    array = np.asarray(record)
    if array.size == 0:
        array = array.astype(np.int64)
    if array.dtype.kind not in "iu" or array.ndim != 1:
        raise TypeError(
            f"{what}: a token record must be a 1-D int tensor, array or list, but got "
            f"{array.dtype} of shape {array.shape}"
        )
    return array.astype(np.int64, copy=False)


def cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """The cumulative sequence lengths of a batch of packed windows, from their ``position_ids``.

    Each window and each document in it starts a sequence (where ``position_ids`` is 0), over the
    batch flattened: what a variable-length attention kernel (``flash_attn_varlen_func``) takes as
    ``cu_seqlens``, as int32.

    Example:
        >>> cu_seqlens(torch.tensor([[0, 1, 2, 0], [0, 0, 1, 2]])).tolist()
        [0, 3, 4, 5, 8]
    """
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    return torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
