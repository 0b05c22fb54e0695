"""The train state: what the loop carries from one optimizer step to the next, as a ``Stateful``.

As torchtitan's ``TrainState``, it is saved under ``"train_state"`` beside the model, optimizer,
scheduler, data loader and RNG states. Everything else the loop needs derives from the configuration
or lives in one of those (the epoch and the position in it are the loader's, the learning rate the
scheduler's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from resumable_data import ResumeError

from .parallel import ElasticPlan, elastic_plan

# Keys of the state dict, declared once. Trainer 0.1.0 wrote version 1 without the batch layout;
# that is refused by name.
TRAIN_STATE_VERSION = 1
VERSION, STEP, TOKENS_SEEN, BEST_VAL_LOSS = "version", "step", "tokens_seen", "best_val_loss"
WORLD_SIZE, BATCH_SIZE, GRAD_ACCUM = "world_size", "batch_size", "grad_accum"
_KEYS = (STEP, TOKENS_SEEN, BEST_VAL_LOSS, WORLD_SIZE, BATCH_SIZE, GRAD_ACCUM)
# The smallest valid value of each integer: counters start at 0, the batch layout at 1.
_MINIMUM = {STEP: 0, TOKENS_SEEN: 0, WORLD_SIZE: 1, BATCH_SIZE: 1, GRAD_ACCUM: 1}


@dataclass
class TrainState:
    """Optimizer steps taken, tokens trained on, the best validation loss, and the batch layout.

    The layout (ranks, sequences per micro-batch, micro-batches per step) is the one the steps so
    far were taken with: after :meth:`load_state_dict` the checkpoint's, until :meth:`relayout`.
    """

    world_size: int
    batch_size: int
    grad_accum: int
    step: int = 0
    tokens_seen: int = 0
    best_val_loss: float = math.inf  # among evaluations that have a checkpoint: not step 0's

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers under fixed keys (``torch.load(weights_only=True)`` safe; JSON safe but ``inf``)."""
        return {VERSION: TRAIN_STATE_VERSION, **{key: getattr(self, key) for key in _KEYS}}

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
        missing = [key for key in _KEYS if key not in state_dict]
        if missing:
            raise ResumeError(
                f"train_state lacks {missing}; it was written by trainer 0.1.0 (no batch layout) or not by "
                "this trainer: resume it with the trainer that wrote it, or start a new --run-dir"
            )
        for key, minimum in _MINIMUM.items():
            value = state_dict[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ResumeError(
                    f"train_state[{key!r}] should be an integer >= {minimum}, but the checkpoint has {value!r}"
                )
        best = state_dict[BEST_VAL_LOSS]
        if isinstance(best, bool) or not isinstance(best, (int, float)) or math.isnan(best):
            raise ResumeError(
                f"train_state[{BEST_VAL_LOSS!r}] should be a number or inf, but the checkpoint has {best!r}"
            )
        for key in _MINIMUM:
            setattr(self, key, state_dict[key])
        self.best_val_loss = float(best)

    def relayout(self, policy: str, world_size: int, batch_size: int, grad_accum: int) -> ElasticPlan:
        """Take this job's batch layout, as ``--elastic`` ``policy`` plans it from the saved one.

        Raises:
            ResumeError: the policy refuses the change (see :func:`trainer.parallel.elastic_plan`).
        """
        saved = {"saved_world": self.world_size, "saved_batch": self.batch_size, "saved_accum": self.grad_accum}
        plan = elastic_plan(policy=policy, **saved, world=world_size, batch=batch_size, accum=grad_accum)
        self.world_size, self.batch_size, self.grad_accum = world_size, batch_size, plan.grad_accum
        return plan
