"""Read audit files back, line up the steps of two runs, and name the first difference and its cause.

A run's records become *units*: what one step consumed on one rank. When a process logs its steps
(``audit.log``), the batches it read since its previous logged step belong to the next one; a process
that logs nothing is lined up by its loaders' own positions: each loader's first batch in a launch
is found in the reference run's batches of that loader, and the batches after it follow one by one.
The interrupted series' launches are read in order; a step read again after a relaunch must equal
the reference each time.

The cause of the first difference is read off the first resumed step of the launch that differs
(its first logged step), as one would by hand: the loss of a step is computed before the optimizer
acts, from the restored weights and RNGs, so an equal first resumed loss (with the same batch)
rules the weights and the RNGs out and leaves the optimizer's state; a learning rate that differs
at the first resumed step is the schedule's (or, when it is the reference's rate of the step before,
a checkpoint written before that step's optimizer step); a step that equals, batches, loss and lr,
what the reference ran under another number is the step counter's; and of the ranks at one step,
the one that read other batches than the reference while the others did not is named.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

from .records import BATCH, LOG

__all__ = ["Batch", "Finding", "Launch", "Unit", "compare", "read_launch"]

# The likely causes a failure names (tests match on these texts).
LOADER_NOT_RESTORED = (
    "the model was restored but the loader state was not: the resumed run read samples the "
    "reference read before the kill (load the loader's state_dict from the checkpoint)"
)
OTHER_POSITION = "the loader resumed at a different position than the uninterrupted run (a stale or other checkpoint?)"
EPOCH_RESTARTED = (
    "the epoch went back: the epoch loop restarted at 0 after the resume (set_epoch misuse; loop "
    "`for epoch in range(loader.epoch, num_epochs)` or `for epoch in loader.epochs(num_epochs)`)"
)
RNG_NOT_RESTORED = (
    "RNG state not restored (dropout/augmentation): save capture_rng_state() with the checkpoint "
    "and restore_rng_state() it on resume"
)
RNG_OR_WEIGHTS = (
    "the RNG state (dropout) or the model's weights were not restored: the first resumed step read the "
    "reference's batch with its learning rate, yet its loss differs (save capture_rng_state() and the "
    "model's state_dict with the checkpoint, and restore both on resume)"
)
OPTIMIZER_NOT_RESTORED = (
    "the optimizer's state was not restored (AdamW's moments, its learning rate): the first resumed step's "
    "loss equals the reference's bitwise, which rules out the model's weights and the RNG, and the losses "
    "differ once the optimizer has acted (save and load optimizer.state_dict())"
)
OPTIMIZER_OR_SCHEDULER = (
    "the optimizer's state or the learning-rate schedule was not restored: the first resumed step's loss "
    "equals the reference's bitwise, which rules out the model's weights and the RNG, and the losses differ "
    "once the optimizer has acted; both hold the learning rate, so log it (audit.log(step, loss=loss, "
    "lr=scheduler.get_last_lr()[0])) to tell them apart (save and load both state_dicts)"
)
STEP_COUNTER_NOT_RESTORED = (
    "the step counter was not restored: the resumed run trains what the reference trained, under other step "
    "numbers (save the step number with the checkpoint and count on from it)"
)
PLAIN_LOADER = (
    "the data after the resume differs: the script reads no batch through resumable_data's loaders "
    "(a plain DataLoader; skipping batches over a RandomSampler does not give back the same order), "
    "so only the logged values were compared"
)
SCHEDULER_NOT_RESTORED = "the learning-rate schedule was not restored (save and load the scheduler's state_dict)"
NOT_DETERMINISTIC = (
    "the run is not deterministic: the interrupted series differs before its first kill (seed the "
    "model and loaders; see torch.use_deterministic_algorithms)"
)


def saved_before_optimizer_step(step: int) -> str:
    """The cause named when the first resumed step runs with what the reference had at ``step``."""
    return (
        f"the checkpoint was written before the optimizer step of step {step}: it counts step {step} as done "
        "but holds the model, optimizer and schedule from before that step's update (write it after "
        "optimizer.step() and scheduler.step())"
    )


def rank_loader_not_restored(rank: int, right: list[int]) -> str:
    """The cause named when one rank read other batches than the reference while others did not."""
    ranks = ", ".join(map(str, right))
    return (
        f"rank {rank}'s loader state was not restored: it read other batches than the reference at this step "
        f"while rank{'s' if len(right) > 1 else ''} {ranks} read the reference's (load the loader's state on "
        "every rank, not on rank 0 alone)"
    )


MISSING = "the interrupted series never ran this step (it stopped early, or skipped it on resume)"
EXTRA = "the interrupted series ran a step the uninterrupted run did not (the run went on past its end)"


@dataclass(frozen=True)
class Batch:
    """One batch a loader handed out: where it was in the epoch, its sample indices, its bytes."""

    loader: int | None
    rank: int
    epoch: int
    position: Any  # a map-style loader's global sample position; a stream's [slot, batches it yielded]
    indices: tuple[int, ...] | None
    digest: str

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.loader, self.rank, self.epoch, json.dumps(self.position))

    def describe(self) -> str:
        indices = "" if self.indices is None else f", samples {_short(list(self.indices))}"
        return f"loader {self.loader} epoch {self.epoch} position {self.position}{indices}, bytes {self.digest[:12]}"


@dataclass
class Unit:
    """What one step consumed on one rank, and the values the script logged for it."""

    batches: list[Batch] = field(default_factory=list)
    values: dict[str, Any] | None = None


# (step or batch number, rank, loader (-1 for a logged step), "step" or "batch")
UnitKey = tuple[int, int, int, str]


@dataclass
class Launch:
    """One process tree's records: logged steps as units, and the batches of processes that log nothing."""

    units: dict[UnitKey, Unit] = field(default_factory=dict)
    streams: dict[tuple[int, int], list[Batch]] = field(default_factory=dict)  # (rank, loader) -> batches

    @property
    def has_batches(self) -> bool:
        return bool(self.streams) or any(u.batches for u in self.units.values())


@dataclass(frozen=True)
class Finding:
    """The first step that differs: where, what differed, and the likely cause."""

    where: str
    what: list[str]
    cause: str

    def lines(self) -> list[str]:
        return [f"FAIL at {self.where}", *(f"  {line}" for line in self.what), f"likely cause: {self.cause}"]


def read_records(folder: Path) -> Iterable[list[dict[str, Any]]]:
    """Each audit file's complete lines in ``folder`` (a line cut by a kill is left out)."""
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        records = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # the process was killed in the middle of this line
        yield records


def _batch(record: dict[str, Any]) -> Batch:
    indices = record.get("indices")
    return Batch(
        record.get("loader"),
        int(record["rank"]),
        int(record["epoch"]),
        record["position"],
        None if indices is None else tuple(indices),
        str(record["digest"]),
    )


def read_launch(folder: Path) -> Launch:
    """A launch's units from the audit files in ``folder`` (one file per process)."""
    launch = Launch()
    for records in read_records(folder):
        if any(r.get("kind") == LOG for r in records):
            pending: list[Batch] = []
            for record in records:
                if record.get("kind") == BATCH:
                    pending.append(_batch(record))
                elif record.get("kind") == LOG:
                    key = (int(record["step"]), int(record["rank"]), -1, "step")
                    launch.units[key] = Unit(pending, record.get("values", {}))
                    pending = []
            # Batches after the last logged step belong to a step the kill cut short: not compared.
        else:
            for record in records:
                if record.get("kind") == BATCH:
                    batch = _batch(record)
                    launch.streams.setdefault((batch.rank, batch.loader or 0), []).append(batch)
    return launch


def reference_units(reference: Launch) -> dict[UnitKey, Unit]:
    """The reference's units: its logged steps, and each batch of a loader whose process logs nothing."""
    units = dict(reference.units)
    for (rank, loader), batches in reference.streams.items():
        for number, batch in enumerate(batches, start=1):
            units[(number, rank, loader, "batch")] = Unit([batch])
    return units


def aligned_units(launch: Launch, reference: Launch) -> tuple[dict[UnitKey, Unit], list[Finding]]:
    """A launch's units, its batch streams lined up on the reference's (by their first batch)."""
    units, findings = dict(launch.units), []
    for (rank, loader), batches in launch.streams.items():
        known = reference.streams.get((rank, loader))
        if known is None:
            continue  # a loader only a resume makes (a peek at the next batch): nothing to compare with
        starts = {b.key: i for i, b in enumerate(known)}
        first = starts.get(batches[0].key)
        if first is None:
            where = f"rank {rank} loader {loader}, the launch's first batch"
            findings.append(
                Finding(where, [f"read: {batches[0].describe()}", "which the reference never read"], OTHER_POSITION)
            )
            continue
        for number, batch in enumerate(batches, start=first + 1):
            units[(number, rank, loader, "batch")] = Unit([batch])
    return units, findings


def describe_key(key: UnitKey) -> str:
    number, rank, loader, kind = key
    return f"step {number} (rank {rank})" if kind == "step" else f"batch {number} of loader {loader} (rank {rank})"


def compare(
    reference: Launch, launches: list[Launch], *, first_kill_launch: int = 1, complete: bool = True
) -> Finding | None:
    """The first step (in the reference's order) where a launch of the series differs, or None.

    Args:
        reference: the uninterrupted run.
        launches: the interrupted series' launches, in order.
        first_kill_launch: launches before this one ran before any kill (a difference there is not
            a resume's fault).
        complete: the series ran to its end; False (a launch that failed) compares only the steps
            the series ran: a step it never reached is no finding.
    """
    expected = reference_units(reference)
    got: dict[UnitKey, list[tuple[int, Unit]]] = {}
    launch_units: list[dict[UnitKey, Unit]] = []
    for number, launch in enumerate(launches):
        units, findings = aligned_units(launch, reference)
        if findings:
            return findings[0]
        launch_units.append(units)
        for key, unit in units.items():
            got.setdefault(key, []).append((number, unit))
    for key in sorted(expected):
        attempts = got.get(key)
        if not attempts:
            if not complete:
                continue
            stale = _written_before(key, expected, launch_units, reference.has_batches)
            return stale or Finding(
                describe_key(key), ["the reference ran it; the interrupted series has no record of it"], MISSING
            )
        for number, unit in attempts:
            if unit != expected[key]:
                early = number < first_kill_launch
                context = _Context(expected, launch_units[number], reference.has_batches, early)
                return _diagnose(key, expected[key], unit, number, context)
    extra = sorted(set(got) - set(expected))
    if extra and complete:
        return Finding(describe_key(extra[0]), ["the reference has no such step"], EXTRA)
    return None


def _written_before(
    key: UnitKey, expected: dict[UnitKey, Unit], launch_units: list[dict[UnitKey, Unit]], has_batches: bool
) -> Finding | None:
    """A step no launch logged, because the checkpoint that counts it as done was written before its
    optimizer step (and the kill landed before its log): the launch that resumed right after it
    shows that on its first step. None when no launch does."""
    step, rank, loader, kind = key
    after = (step + 1, rank, loader, kind)
    for number, units in enumerate(launch_units):
        if kind != "step" or after not in units or after not in expected or units[after] == expected[after]:
            continue
        context = _Context(expected, units, has_batches, early=False)
        if context.resumed(rank) != step + 1:
            continue
        finding = _diagnose(after, expected[after], units[after], number, context)
        if finding.cause == saved_before_optimizer_step(step):
            missing = f"step {step} has no record: the checkpoint counting it as done was written before its log"
            return Finding(finding.where, [missing, *finding.what], finding.cause)
    return None


@dataclass(frozen=True)
class _Context:
    """What a diagnosis reads besides the two units: the reference's units and the differing launch's."""

    expected: dict[UnitKey, Unit]
    launch: dict[UnitKey, Unit]
    has_batches: bool
    early: bool

    def first_step(self, rank: int) -> int | None:
        """The differing launch's first logged step on ``rank`` (its first resumed step), if it logs."""
        return min((k[0] for k in self.launch if k[1] == rank and k[3] == "step"), default=None)

    def resumed(self, rank: int) -> int | None:
        """The first resumed step on ``rank``, or None when the launch started from the beginning."""
        first = self.first_step(rank)
        start = min((k[0] for k in self.expected if k[1] == rank and k[3] == "step"), default=None)
        return first if first is not None and start is not None and first > start else None


def _diagnose(key: UnitKey, want: Unit, have: Unit, launch: int, context: _Context) -> Finding:
    where = f"{describe_key(key)}, launch {launch + 1} of the interrupted series"
    step, rank, _, kind = key
    if not context.early and kind == "step" and (have.batches or have.values):
        # The whole step (batches, loss, lr) is one the reference ran under another number.
        same = [k for k, unit in sorted(context.expected.items()) if k != key and k[1:] == key[1:] and unit == have]
        if same:
            other = same[0][0]
            what = [f"the reference ran exactly this as step {other}: the same batches, {_names(have)}"]
            if other == step - 1 and step == context.resumed(rank):
                what.append(f"the resumed run repeats step {other}, the step its checkpoint counts as done")
                return Finding(where, what, saved_before_optimizer_step(other))
            return Finding(where, what, STEP_COUNTER_NOT_RESTORED)
    for want_batch, have_batch in zip_longest(want.batches, have.batches):
        if want_batch == have_batch:
            continue
        what = [
            f"reference read:   {want_batch.describe() if want_batch else 'no batch'}",
            f"interrupted read: {have_batch.describe() if have_batch else 'no batch'}",
        ]
        if context.early:
            return Finding(where, what, NOT_DETERMINISTIC)
        if want_batch is None or have_batch is None:
            return Finding(where, what, OTHER_POSITION)
        if have_batch.key == want_batch.key and have_batch.indices == want_batch.indices:
            return Finding(where, [*what, "same samples, different bytes (augmentation)"], RNG_NOT_RESTORED)
        right = _ranks_reading_right(key, context)
        earlier = _read_elsewhere(have_batch, key, context.expected, before=True)
        if earlier is not None:
            what.append(f"the reference read these samples at {describe_key(earlier)}, before this step")
        if right:
            return Finding(where, what, rank_loader_not_restored(rank, right))
        if have_batch.epoch < want_batch.epoch:
            return Finding(where, what, EPOCH_RESTARTED)
        if earlier is not None:
            return Finding(where, what, LOADER_NOT_RESTORED)
        later = _read_elsewhere(have_batch, key, context.expected, before=False)
        if later is not None and kind == "step":
            what.append(f"the reference read these samples at {describe_key(later)}, after this step")
            return Finding(where, what, STEP_COUNTER_NOT_RESTORED)
        return Finding(where, what, OTHER_POSITION)
    names = sorted(set(want.values or {}) | set(have.values or {}))
    differ = [n for n in names if (want.values or {}).get(n) != (have.values or {}).get(n)]
    what = [f"{n}: reference {_value(want.values, n)}, interrupted {_value(have.values, n)}" for n in differ]
    if want.batches:
        what.insert(
            0,
            f"same batches ({len(want.batches)}: {want.batches[0].describe()}{', ...' if len(want.batches) > 1 else ''})",
        )
    if context.early:
        return Finding(where, what, NOT_DETERMINISTIC)
    if not context.has_batches:
        what.insert(0, "no batch records: the script reads through none of resumable_data's loaders")
        return Finding(where, what, PLAIN_LOADER)
    return Finding(where, what, _values_cause(key, have, differ, what, context))


def _values_cause(key: UnitKey, have: Unit, differ: list[str], what: list[str], context: _Context) -> str:
    """The cause of logged values that differ over the reference's batches (``what`` gains the evidence)."""
    step, rank, _, _ = key
    first = context.resumed(rank)
    logs_lr = "lr" in (context.expected[key].values or {})
    if first is not None and step == first:
        if "lr" in differ:
            lr = (have.values or {}).get("lr")
            at = [
                k[0]
                for k, unit in sorted(context.expected.items())
                if k[1:] == key[1:] and (unit.values or {}).get("lr") == lr
            ]
            # The loss decides: it is computed before the step's update, so with the schedule alone
            # wrong it is the reference's; with the lr of the step before and another loss, the
            # model and optimizer are those before that step's update too.
            if "loss" in differ and step - 1 in at:
                what.append(f"the lr is the reference's of step {step - 1}, the step before the first resumed one")
                return saved_before_optimizer_step(step - 1)
            if at:
                what.append(f"the lr is the reference's of step {at[0]}")
            return SCHEDULER_NOT_RESTORED
        return RNG_OR_WEIGHTS
    if first is not None and step > first:
        steps = f"steps {first} to {step - 1} equal" if step - 1 > first else f"step {first} equals"
        names = _names(context.expected.get((first, rank, key[2], key[3])))
        what.append(f"the first resumed {steps} the reference bitwise (batches, {names})")
        if "lr" in differ or not logs_lr:
            return OPTIMIZER_OR_SCHEDULER
        return OPTIMIZER_NOT_RESTORED
    if differ == ["lr"]:
        return SCHEDULER_NOT_RESTORED
    return RNG_OR_WEIGHTS


def _names(unit: Unit | None) -> str:
    """The logged values' names, for a line of evidence ("loss and lr")."""
    names = sorted(unit.values or {}) if unit is not None else []
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names) or "no logged values"


def _ranks_reading_right(key: UnitKey, context: _Context) -> list[int]:
    """The other ranks whose batches at this step of the differing launch are the reference's."""
    step, rank, loader, kind = key
    return sorted(
        k[1]
        for k, unit in context.launch.items()
        if k[0] == step
        and k[2:] == (loader, kind)
        and k[1] != rank
        and k in context.expected
        and unit.batches == context.expected[k].batches
    )


def _read_elsewhere(batch: Batch, key: UnitKey, expected: dict[UnitKey, Unit], *, before: bool) -> UnitKey | None:
    """The reference step of this rank, before (or after) ``key``, that read ``batch``'s samples (same
    position, or same bytes)."""
    others = sorted(k for k in expected if k[1] == key[1] and (k < key if before else k > key))
    for other in others:
        if any(b.key == batch.key or b.digest == batch.digest for b in expected[other].batches):
            return other
    return None


def _value(values: dict[str, Any] | None, name: str) -> str:
    value = (values or {}).get(name)
    if isinstance(value, dict) and "hex" in value:
        return f"{float.fromhex(value['hex'])!r} ({value['hex']})"
    return "not logged" if value is None else repr(value)


def _short(values: list[int], shown: int = 8) -> str:
    return str(values) if len(values) <= shown else f"[{', '.join(map(str, values[:shown]))}, ... ({len(values)})]"
