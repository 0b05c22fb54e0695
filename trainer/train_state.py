"""The train state: what the loop carries from one optimizer step to the next, as a ``Stateful``.

Like torchtitan's ``TrainState``: the checkpoint saves it under ``"train_state"`` next to the model,
optimizer, scheduler, data loader and RNG states, and a resume loads it back. Everything else the
loop needs is derived from the configuration or lives in one of those objects (the epoch and the
position in it are the data loader's; the learning rate is the scheduler's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from resumable_data import ResumeError

__all__ = ["TRAIN_STATE_VERSION", "TrainState"]

# Keys of the state dict, declared once. Version 1 is the layout since the trainer learned
# torchrun; trainer 0.1.0 wrote version 1 without the batch layout, and that is refused below.
TRAIN_STATE_VERSION = 1
VERSION = "version"
STEP = "step"
TOKENS_SEEN = "tokens_seen"
BEST_VAL_LOSS = "best_val_loss"
WORLD_SIZE = "world_size"
BATCH_SIZE = "batch_size"
GRAD_ACCUM = "grad_accum"
# Counters that start at 0, and the batch layout (at least 1 each).
_COUNTERS = (STEP, TOKENS_SEEN)
_LAYOUT = (WORLD_SIZE, BATCH_SIZE, GRAD_ACCUM)


@dataclass
class TrainState:
    """Optimizer steps taken, tokens trained on, the best validation loss, and the batch layout.

    The layout (ranks, sequences per micro-batch, micro-batches per step) is the one the steps so
    far were taken with. After :meth:`load_state_dict` it is the checkpoint's, which an elastic
    resume compares with its own (:func:`trainer.parallel.elastic_plan`) before it replaces it.

    Example:
        >>> state = TrainState(world_size=1, batch_size=4, grad_accum=1)
        >>> state.step, state.tokens_seen = 6, 384
        >>> resumed = TrainState(world_size=2, batch_size=4, grad_accum=1)
        >>> resumed.load_state_dict(state.state_dict())
        >>> resumed.step, resumed.tokens_seen, resumed.world_size
        (6, 384, 1)
    """

    world_size: int
    batch_size: int
    grad_accum: int
    step: int = 0
    tokens_seen: int = 0
    # Among evaluations that have a checkpoint: the step-0 baseline does not count.
    best_val_loss: float = math.inf

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers under fixed keys (``torch.load(weights_only=True)`` and JSON safe but ``inf``)."""
        return {
            VERSION: TRAIN_STATE_VERSION,
            STEP: self.step,
            TOKENS_SEEN: self.tokens_seen,
            BEST_VAL_LOSS: self.best_val_loss,
            WORLD_SIZE: self.world_size,
            BATCH_SIZE: self.batch_size,
            GRAD_ACCUM: self.grad_accum,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take the checkpoint's counters and layout; on any error nothing changes.

        Raises:
            ResumeError: another version, a missing key, or a value of the wrong type or range,
                naming the key, the value and what was expected.
        """
        if not isinstance(state_dict, Mapping):
            raise ResumeError(f"train_state should be a dict, but the checkpoint has a {type(state_dict).__name__}")
        version = state_dict.get(VERSION)
        if type(version) is not int or version != TRAIN_STATE_VERSION:
            raise ResumeError(
                f"train_state version {version!r} in the checkpoint, but this trainer reads version "
                f"{TRAIN_STATE_VERSION}; resume it with the trainer that wrote it"
            )
        missing = [key for key in (*_COUNTERS, BEST_VAL_LOSS, *_LAYOUT) if key not in state_dict]
        if missing:
            raise ResumeError(
                f"train_state lacks {missing}; it was written by trainer 0.1.0 (no batch layout) or not by "
                "this trainer: resume it with the trainer that wrote it, or start a new --run-dir"
            )
        for key in (*_COUNTERS, *_LAYOUT):
            value, minimum = state_dict[key], 0 if key in _COUNTERS else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ResumeError(
                    f"train_state[{key!r}] should be an integer >= {minimum}, but the checkpoint has {value!r}"
                )
        best = state_dict[BEST_VAL_LOSS]
        if isinstance(best, bool) or not isinstance(best, (int, float)) or math.isnan(best):
            raise ResumeError(
                f"train_state[{BEST_VAL_LOSS!r}] should be a number or inf, but the checkpoint has {best!r}"
            )
        self.step, self.tokens_seen, self.best_val_loss = state_dict[STEP], state_dict[TOKENS_SEEN], float(best)
        self.world_size, self.batch_size, self.grad_accum = (state_dict[key] for key in _LAYOUT)
