"""Warm start: batches served by the main process while workers start are bitwise the batches the
workers would have served, and the position stays exact wherever the hand-over falls."""

from __future__ import annotations

import gc
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from harness import GlobalRandomAugment, resume_from, run_with_snapshots
from resumable_data import ResumableDataLoader
from resumable_data.testing import assert_same


class SlowStart(GlobalRandomAugment):
    """Global-RNG augmentation whose workers take a while to start (as real ones do: imports,
    file handles), so the main process serves several batches before the hand-over."""

    @staticmethod
    def worker_init(_: int) -> None:
        time.sleep(0.3)


def _maker(num_workers: int, *, warm: bool, persistent: bool = False, pin: bool = False) -> Callable[[], Any]:
    def make() -> ResumableDataLoader:
        return ResumableDataLoader(
            SlowStart(29),
            batch_size=3,
            seed=5,
            num_workers=num_workers,
            warm_start=warm,
            persistent_workers=persistent,
            pin_memory=pin,
            worker_init_fn=SlowStart.worker_init,
        )

    return make


def _fetched_in_main_process(make: Callable[[], Any]) -> Callable[[], Any]:
    """The same loader, counting the batches its main process fetched."""

    def counting() -> Any:
        loader = make()
        original = loader._fetch_here

        def fetch(segment: Any, batch: int) -> Any:
            counting.served += 1
            return original(segment, batch)

        loader._fetch_here = fetch
        return loader

    counting.served = 0  # type: ignore[attr-defined]
    return counting


# One worker and an odd count; two workers are the next three tests' (3.5 s a count on CI's 2 cores).
@pytest.mark.parametrize("num_workers", [1, 3])
def test_warm_start_streams_equal_cold_ones_at_epoch_start_and_after_restores(num_workers: int) -> None:
    # 10 batches an epoch. Cuts: mid-epoch (a restore) and after the epoch's loop (an epoch-end state).
    cuts = {("in", 4), ("after", 0)}
    reference, states = run_with_snapshots(_maker(num_workers, warm=False), 3, cuts)
    warm = _fetched_in_main_process(_maker(num_workers, warm=True))
    uninterrupted, warm_states = run_with_snapshots(warm, 3, cuts)
    assert_same(reference, uninterrupted, "warm-started run")
    assert warm.served > 0  # the main process really served some (workers sleep 0.3 s first)
    for cut, offset in ((("in", 4)), 4), (("after", 0), 10):
        assert warm_states[cut] == states[cut]
        assert_same(reference[offset:], resume_from(warm, states[cut], len(reference) - offset), "resumed batches")


def test_warm_start_with_persistent_workers_and_pin_memory() -> None:
    reference, _ = run_with_snapshots(_maker(2, warm=False), 3, set())
    for persistent, pin in ((True, False), (False, True), (True, True)):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "'pin_memory' argument is set as true but no accelerator")
            got, _ = run_with_snapshots(_maker(2, warm=True, persistent=persistent, pin=pin), 3, set())
        assert_same(reference, got, "warm-started run")


def test_a_state_taken_while_the_main_process_serves_resumes_exactly() -> None:
    reference, _ = run_with_snapshots(_maker(2, warm=False), 2, set())
    warm = _fetched_in_main_process(_maker(2, warm=True))
    loader = warm()
    iterator = iter(loader)
    first = next(iterator)
    assert warm.served == 1  # the first batch came from the main process
    state = loader.state_dict()
    assert_same(reference[:1], [first], "first batch")
    assert_same(reference[1:], resume_from(_maker(2, warm=True), state, len(reference) - 1), "resumed batches")


def test_break_then_iterate_again_continues_exactly() -> None:
    reference, _ = run_with_snapshots(_maker(2, warm=False), 2, set())
    loader = _maker(2, warm=True)()
    got = []
    for batch in loader:
        got.append(batch)
        if len(got) == 2:
            break
    for _ in range(2):
        got.extend(loader)
    assert_same(reference, got[: len(reference)], "batches after a break")
    assert len(got) == len(reference)


def test_an_abandoned_pass_stops_its_thread_and_none_outlives_the_interpreter() -> None:
    # A daemon thread still inside torch at interpreter exit aborts the process; an abandoned
    # iterator must stop its consumer thread, and exit joins any that remain.
    def warm_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "resumable_data warm start"}

    before = warm_threads()  # earlier tests' passes may still be shutting their workers down
    loader = _maker(2, warm=True)()
    iterator = iter(loader)
    next(iterator), next(iterator)  # the second request starts the workers and the thread
    threads = list(warm_threads() - before)
    assert len(threads) == 1
    del iterator
    gc.collect()
    threads[0].join(timeout=30)
    assert not threads[0].is_alive()
