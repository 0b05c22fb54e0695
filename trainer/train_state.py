"""The train state: what the loop carries from one optimizer step to the next, as a ``Stateful``, and
the batch layout a resume on another number of ranks takes (:func:`elastic_plan`).

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

ELASTIC_POLICIES = ("per-rank-batch", "global-batch", "refuse")
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
            ResumeError: the policy refuses the change (see :func:`elastic_plan`).
        """
        saved = {"saved_world": self.world_size, "saved_batch": self.batch_size, "saved_accum": self.grad_accum}
        plan = elastic_plan(policy=policy, **saved, world=world_size, batch=batch_size, accum=grad_accum)
        self.world_size, self.batch_size, self.grad_accum = world_size, batch_size, plan.grad_accum
        return plan


@dataclass(frozen=True)
class ElasticPlan:
    """Per-rank batch and gradient accumulation after a resume, and what changed (old, new)."""

    batch_size: int
    grad_accum: int
    changes: dict[str, list[int]]

    def describe(self) -> str:
        return ", ".join(f"{name} {old} -> {new}" for name, (old, new) in self.changes.items()) or "nothing changed"


def elastic_plan(
    *, policy: str, saved_world: int, saved_batch: int, saved_accum: int, world: int, batch: int, accum: int
) -> ElasticPlan:
    """The batch layout for a resume on ``world`` ranks of a checkpoint written on ``saved_world``.

    Policies: ``per-rank-batch`` keeps ``--batch-size`` and ``--grad-accum`` (the global batch
    scales with the ranks); ``global-batch`` keeps ``world * batch * grad_accum`` by changing the
    gradient accumulation, and refuses when it does not divide; ``refuse`` refuses any change.

    Raises:
        ResumeError: an unknown policy, a refused change, or a global batch the new ranks cannot split.
    """
    if policy not in ELASTIC_POLICIES:
        raise ResumeError(f"--elastic should be one of {ELASTIC_POLICIES}, but got {policy!r}")
    changes: dict[str, list[int]] = {}
    if world != saved_world:
        if policy == "refuse":
            raise ResumeError(
                f"world size changed: the checkpoint was written by {saved_world} ranks, this job has {world} "
                f"(--elastic refuse); start it with torchrun --nproc_per_node {saved_world}, or allow the change with "
                "--elastic per-rank-batch or --elastic global-batch"
            )
        changes["world_size"] = [saved_world, world]
        total = saved_world * saved_batch * saved_accum
        if policy == "global-batch" and total % (world * batch):
            raise ResumeError(
                f"--elastic global-batch: the checkpoint's global batch of {total} sequences ({saved_world} ranks x "
                f"--batch-size {saved_batch} x --grad-accum {saved_accum}) cannot be split over {world} ranks of "
                f"--batch-size {batch}; pick a --batch-size or a number of ranks that divides it, or resume with "
                f"--elastic per-rank-batch (the global batch then becomes {world * batch * accum})"
            )
        if policy == "global-batch":
            accum = total // (world * batch)
    for name, old, new in (("batch_size", saved_batch, batch), ("grad_accum", saved_accum, accum)):
        if old != new:
            changes[name] = [old, new]
    if changes:
        changes["global_batch"] = [saved_world * saved_batch * saved_accum, world * batch * accum]
    return ElasticPlan(batch, accum, changes)
