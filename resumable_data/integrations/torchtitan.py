"""torchtitan over a StreamLoader: a data loader whose checkpoint resumes exactly, at any data-parallel degree.

torchtitan's :class:`CheckpointManager` saves the trainer's data loader under the key ``"dataloader"``
of its DCP checkpoint (``torch.distributed.checkpoint``). Its own loader stores one state per
data-parallel rank, ``{"dp_rank_<r>": ..., "world_size": W}``, and refuses to load at another degree
("dataloader resharding is not supported yet"); no RNG state is saved (its ``TODO(checkpoint-rng)``).
:class:`TitanLoader` takes its place::

    loader = TitanLoader(StreamLoader(stream, batch_size=8, group=dp_group), seed=SEED)
    checkpointer = CheckpointManager(config, dataloader=loader, ...)  # saved under "dataloader"

or, in a trainer config, ``dataloader=dataloader_config(make_loader, seed=SEED)`` (see
:func:`dataloader_config`).

What is saved. DCP writes a value under each key once: ranks that put different values under the
same key get one rank's back, silently, and not always rank 0's (on 2 gloo ranks, torch 2.13, a
string came back as rank 0's and a bytes value as rank 1's: the save plan gives each such item to
one rank); keys that exist on some ranks only (``dp_rank_2``) are fine until a load at another
degree asks for a key the checkpoint lacks ("Missing key in checkpoint state_dict"); and nested
lists are saved element by element, so a list's length is part of the keys. So every key
and value here is the same on every rank and at every degree (``state_dict()`` is a collective):

- ``"data"``: the loader's global state (:class:`~resumable_data.distributed.DataLoaderState`: every
  rank's slots merged into one JSON string), which any number of ranks loads, each taking its part
  (the elastic rules of :class:`~resumable_data.StreamLoader`);
- ``"rng_per_rank"``: every rank's :func:`~resumable_data.capture_rng_state`, in global rank order,
  as one ``torch.save``'d bytes value (one value, so its key does not depend on the number of
  ranks), read back with ``torch.load(weights_only=True)``;
- ``"batches"``: the batches handed out since the run started (the most of any rank), from which a
  rank the checkpoint never had is seeded (``seed_everything(rank_seed(seed, rank, batches))``).

What stays identical. Resumed at the same degree, every rank's next batch and its global RNGs
(dropout) are the uninterrupted run's. At another degree, the rest of the epoch is read exactly
once over the new ranks.

Trust: DCP unpickles non-tensor values when it loads (``weights_only=False``): load only
checkpoints you wrote.
This module imports torchtitan only inside :func:`dataloader_config`.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..core.dist import distributed_defaults
from ..core.state import VERSION, brief, check_version, is_int, keys_of, require_int, require_mapping
from ..distributed import DataLoaderState, fail_together
from ..errors import ResumeError, Stateful
from ..rng.capture import capture_rng_state, restore_rng_state
from ..rng.ranks import restore_rank_rng_state

__all__ = ["DATALOADER_KEY", "TitanLoader", "dataloader_config", "next_token_batch"]

DATALOADER_KEY = "dataloader"
"""The key torchtitan's checkpointer saves the data loader under (``checkpointer/base.py: DATALOADER``)."""
# The version of TitanLoader's state, and its keys (declared once).
STATE_VERSION = 1
_DATA = "data"  # DataLoaderState's {"version", "state_json"}: the loader's global state
_RNG_PER_RANK = "rng_per_rank"  # torch.save([capture_rng_state() of each global rank])
_BATCHES = "batches"  # batches handed out since the run began (the most of any rank)
_WHAT = "TitanLoader"

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


def next_token_batch(batch: Any) -> Batch:
    """torchtitan's ``(input_dict, labels)`` from a ``(batch, block_size + 1)`` tensor of token windows.

    The inputs are each window's first ``block_size`` tokens, the labels its last ``block_size``
    (the next token of each input), as torchtitan's own text datasets yield them.

    Raises:
        TypeError: ``batch`` is not a 2-D tensor of at least 2 tokens per row; pass ``to_batch=`` for
            another batch layout (``pack(boundaries=True)``'s dicts, say).

    Examples:
        >>> inputs, labels = next_token_batch(torch.arange(6).reshape(2, 3))
        >>> inputs["input"].tolist(), labels.tolist()
        ([[0, 1], [3, 4]], [[1, 2], [4, 5]])
    """
    if not (isinstance(batch, torch.Tensor) and batch.dim() == 2 and batch.shape[1] >= 2):
        raise TypeError(
            f"next_token_batch takes a (batch, block_size + 1) tensor of tokens, but got {brief(batch)}; "
            "give TitanLoader a to_batch= that turns your batches into ({'input': inputs}, labels)"
        )
    return {"input": batch[:, :-1]}, batch[:, 1:]


class TitanLoader:
    """A torchtitan data loader over a :class:`~resumable_data.StreamLoader` whose DCP state is
    the same on every rank, so it loads at any data-parallel degree, with every rank's RNGs.

    It has what torchtitan's trainer and checkpointer use of a ``BaseDataLoader``: ``__iter__``
    yielding ``(input_dict, labels)``, and ``state_dict``/``load_state_dict`` (DCP's ``Stateful``).
    Both are collectives when a process group is initialized (DCP calls them on every rank). It is
    not a subclass of ``BaseDataLoader``, which would import torchtitan with this module; torchtitan
    0.3's trainer and ``CheckpointManager`` only iterate it and call those two methods.

    Args:
        loader: the rank's loader, sharded over the data-parallel ranks (a
            :class:`~resumable_data.StreamLoader` built with the data-parallel ``group``; a
            :class:`~resumable_data.ResumableDataLoader` works too).
        seed: the run's seed: a rank the checkpoint has no RNG state of (a resume on more ranks)
            is seeded from it, the rank and the batches handed out (:func:`~resumable_data.rank_seed`).
        group: the data-parallel process group the loader's state is gathered over (the default
            group when None). The RNG states are gathered over the default group (every rank has
            its own dropout, tensor-parallel peers included).
        to_batch: turns one of the loader's batches into torchtitan's ``(input_dict, labels)``
            (:func:`next_token_batch` when None).
        infinite: start the next epoch when one ends, as torchtitan's own datasets do (the trainer
            stops at ``training.steps``); when False, iteration ends with the current epoch.

    Raises:
        ResumeError: ``loader`` keeps no state or cannot be iterated, or ``seed`` is not an int.

    Example::

        stream = ShardedIterable.from_index("tokens/", read_shard=TokenShardReader(2049), seed=0)
        loader = TitanLoader(StreamLoader(stream, batch_size=8, group=dp_group), seed=0, group=dp_group)
        checkpointer = CheckpointManager(config, dataloader=loader, ...)
        checkpointer.load()  # any data-parallel degree: the rest of the epoch, each record once
        for inputs, labels in loader:
            ...
            checkpointer.save(step)
    """

    def __init__(
        self,
        loader: Stateful,
        *,
        seed: int,
        group: dist.ProcessGroup | None = None,
        to_batch: Callable[[Any], Batch] | None = None,
        infinite: bool = True,
    ) -> None:
        if not (isinstance(loader, Stateful) and isinstance(loader, Iterable)):
            raise ResumeError(
                f"TitanLoader takes an iterable loader with state_dict/load_state_dict (a StreamLoader), "
                f"got {type(loader).__name__}"
            )
        if not is_int(seed):
            raise ResumeError(f"seed should be an int (the run's seed), but got seed={brief(seed)}")
        self.loader = loader
        self.seed = seed
        self.group = group
        self.to_batch = next_token_batch if to_batch is None else to_batch
        self.infinite = infinite
        self._data = DataLoaderState(loader, group=group)
        self.batches = 0  # handed out since the run began, restored ones included

    def __iter__(self) -> Iterator[Batch]:
        while True:
            handed_out = False
            for batch in self.loader:
                self.batches += 1
                handed_out = True
                yield self.to_batch(batch)
            if not (self.infinite and handed_out):  # an epoch with no batches would repeat forever
                return

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "data", "rng_per_rank", "batches"}``, the same on every rank; a collective.

        Examples:
            >>> from resumable_data import ResumableDataLoader
            >>> titan = TitanLoader(ResumableDataLoader(torch.arange(8).reshape(4, 2), batch_size=2, seed=0), seed=0)
            >>> state = titan.state_dict()  # without a process group: this process's state and RNGs
            >>> sorted(state), sorted(state["data"]), type(state["rng_per_rank"]).__name__
            (['batches', 'data', 'rng_per_rank', 'version'], ['state_json', 'version'], 'bytes')
        """
        data = self._data.state_dict()
        mine = (capture_rng_state(), self.batches)
        gathered = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()  # type: ignore[list-item]
            dist.all_gather_object(gathered, mine)
        buffer = io.BytesIO()
        torch.save([rng for rng, _ in gathered], buffer)
        return {
            VERSION: STATE_VERSION,
            _DATA: data,
            _RNG_PER_RANK: buffer.getvalue(),
            _BATCHES: max(batches for _, batches in gathered),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the loader's part for this rank and this rank's RNGs (a collective: call it on every rank).

        A rank the checkpoint has no RNG state of is seeded with
        ``seed_everything(rank_seed(seed, rank, batches))``. On failure no rank's loader or RNGs are
        changed (a rank that loaded while another failed puts its own back), and every rank raises.

        Raises:
            ResumeError: the state is malformed, another version, or the loader refuses it.
        """
        rank, _ = distributed_defaults(None)
        rng_before, loader_before, batches_before = capture_rng_state(), self.loader.state_dict(), self.batches
        loaded = False

        def attempt() -> None:
            nonlocal loaded
            state = _parse(state_dict)
            rng_per_rank = _rng_states(state[_RNG_PER_RANK])
            restore_rank_rng_state(rng_per_rank, rank, seed=self.seed, step=state[_BATCHES])
            try:
                self._data.load_state_dict(state[_DATA])
            except BaseException:
                restore_rng_state(rng_before)  # the loader refused: this rank's RNGs are as they were
                raise
            self.batches, loaded = state[_BATCHES], True

        try:
            fail_together(f"loading the {_WHAT} state", attempt)
        except ResumeError:
            if loaded:  # another rank failed: this one goes back to where it was, as that one is
                restore_rng_state(rng_before)
                self.loader.load_state_dict(loader_before)
                self.batches = batches_before
            raise


def _parse(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """Our state, checked (the loader's part and the RNG states check their own contents)."""
    state = require_mapping(state_dict, _WHAT)
    if VERSION not in state and any(isinstance(key, str) and key.startswith("dp_rank_") for key in state):
        raise ResumeError(
            f"this is the state of torchtitan's own loader (keys {keys_of(state)}: one per data-parallel rank), "
            f"not a {_WHAT}'s: its position cannot be carried over; start the data from a checkpoint a "
            f"{_WHAT} saved, or exclude the dataloader from loading (checkpoint.exclude_from_loading)"
        )
    check_version(state, STATE_VERSION, _WHAT)
    for key in (_DATA, _RNG_PER_RANK):
        if key not in state:
            raise ResumeError(f"{_WHAT} state is missing the key {key!r}; got keys {keys_of(state)}")
    require_int(state, _BATCHES, _WHAT, minimum=0)
    if not isinstance(state[_RNG_PER_RANK], bytes):
        raise ResumeError(f"{_WHAT} field {_RNG_PER_RANK!r} must be bytes, but got {brief(state[_RNG_PER_RANK])}")
    return state


def _rng_states(saved: bytes) -> Any:
    """The per-rank RNG list, read with ``weights_only=True`` (tensors and plain containers only)."""
    try:
        return torch.load(io.BytesIO(saved), weights_only=True)
    except Exception as e:  # any unpickling failure: the field is not what state_dict() wrote
        raise ResumeError(f"{_WHAT} field {_RNG_PER_RANK!r} cannot be read back: {type(e).__name__}: {e}") from e


def dataloader_config(make_loader: Callable[..., Stateful], *, seed: int, **options: Any) -> Any:
    """A torchtitan ``BaseDataLoader.Config`` whose ``build()`` returns a :class:`TitanLoader`.

    torchtitan's trainer builds its loader with ``config.dataloader.build(dp_world_size=...,
    dp_rank=..., tokenizer=..., seq_len=..., local_batch_size=..., ...)``; this config's ``build``
    passes those keywords to ``make_loader`` and wraps what it returns. Imports torchtitan.

    Args:
        make_loader: ``make_loader(dp_rank=..., dp_world_size=..., seq_len=..., local_batch_size=...,
            **others)`` returns the rank's :class:`~resumable_data.StreamLoader` (built with
            ``rank=dp_rank, world_size=dp_world_size``); it should accept ``**kwargs`` for the ones it
            does not use.
        seed: the run's seed (see :class:`TitanLoader`).
        **options: :class:`TitanLoader`'s other keywords (``to_batch``, ``infinite``; ``group``
            for a job whose data-parallel group is not the default group).

    Returns:
        A ``torchtitan.components.dataloader.BaseDataLoader.Config`` to put in ``Trainer.Config``.

    Example::

        def make_loader(*, dp_rank, dp_world_size, seq_len, local_batch_size, **_):
            stream = ShardedIterable.from_index("tokens/", read_shard=TokenShardReader(seq_len + 1), seed=0)
            return StreamLoader(stream, batch_size=local_batch_size, rank=dp_rank, world_size=dp_world_size)


        config = Trainer.Config(..., dataloader=dataloader_config(make_loader, seed=0))
    """
    from dataclasses import dataclass

    from torchtitan.components.dataloader import BaseDataLoader

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        """A TitanLoader's torchtitan config: ``build`` calls ``make_loader`` with the trainer's keywords."""

        def build(self, **kwargs: Any) -> TitanLoader:
            return TitanLoader(make_loader(**kwargs), seed=seed, **options)

    return Config(dataset="resumable_data")
