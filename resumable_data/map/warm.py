"""Warm start: the main process serves the first batches of a pass while the workers start.

Starting worker processes takes a while (forking workers that hold torch, then their first batch;
benchmarks/results/bench_resume.md has the figures), and a DataLoader pays it at every restore and, without
persistent workers, at every epoch start.

With warm start the first batch of a pass is fetched by the main process, without waiting for any
worker. The worker iterator is created on the next request, in the main thread — never in a
background thread: forking while another thread holds a lock (torch's generator mutex, say) leaves
the child deadlocked. Its pass begins at the batch the main process has reached; a background
thread only *consumes* it, so the main process can keep serving batches itself until the workers
deliver, and then hands over. Worker batches the main process already served are dropped, so
nothing is repeated, skipped or reordered; and since every batch's randomness comes from its ticket
(see ``map.fetch``), a batch is bitwise the same whichever process fetched it.

The trade-off: the main process does data work for the first few batches, and the workers may
fetch a batch or two that the main process already served.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["WarmPass", "WarmStart"]

_END = object()
_POLL_S = 0.05  # how often a blocked producer checks whether it should stop
_EXIT_JOIN_S = 5.0  # how long interpreter exit waits for each consumer thread


class WarmPass:
    """What the consumer thread and the iterator share. The thread never holds the iterator (nor
    the loader), so dropping the iterator after a ``break`` stops the thread and releases the
    workers; the loader keeps this handle to close a pass before it starts the next one."""

    def __init__(self) -> None:
        self.served = 0  # batches handed out so far: the next one to hand out
        self.base = 0  # the batch the workers' pass started at
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=4)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        _track(self)

    def first_batch(self) -> int:
        self.base = self.served
        return self.base

    def put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce(self, workers: Iterator[Any]) -> None:
        """Move the workers' batches, numbered, into the queue (runs in the background thread)."""
        try:
            for offset, batch in enumerate(workers):
                if not self.put((self.base + offset, batch)):
                    return
            self.put(_END)
        except BaseException as error:  # handed to the consumer, which re-raises it
            self.put(error)
        finally:
            del workers  # shuts the worker processes down (or parks persistent ones)

    def close(self, timeout: float | None = None) -> None:
        """Stop the consumer thread and wait for it (it releases the workers)."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout)


# Passes whose thread may still run. At interpreter exit they are stopped and joined *before*
# finalization: a daemon thread still inside torch's C++ code when Python tears threads down
# aborts the process ("terminate called without an active exception").
_LIVE: weakref.WeakSet[WarmPass] = weakref.WeakSet()


_EXIT_HOOK = threading.Lock()
_exit_hook_registered = False  # registered with the first pass, never at import


def _track(warm_pass: WarmPass) -> None:
    global _exit_hook_registered
    with _EXIT_HOOK:
        if not _exit_hook_registered:
            atexit.register(_close_live_passes)
            _exit_hook_registered = True
    _LIVE.add(warm_pass)


def _close_live_passes() -> None:
    for warm_pass in list(_LIVE):
        warm_pass.close(timeout=_EXIT_JOIN_S)


class WarmStart(Iterator[Any]):
    """Batches of one pass: from ``fetch`` in the main process until the workers deliver.

    Args:
        start_workers: creates the DataLoader's worker iterator; it is given a callable that, when
            first asked (as the workers draw their first indices), returns the batch to start at.
        fetch: fetches and collates batch ``i`` of the pass in the main process.
        n_batches: batches in the pass.
        pin_device: the accelerator the DataLoader's pin thread pins batches for, so main-process
            batches are pinned too; None when ``pin_memory`` is off.
    """

    def __init__(
        self,
        start_workers: Callable[[Callable[[], int]], Iterator[Any]],
        fetch: Callable[[int], Any],
        n_batches: int,
        pin_device: str | None,
    ) -> None:
        self._start_workers: Callable[[Callable[[], int]], Iterator[Any]] | None = start_workers
        self._fetch = fetch
        self._n_batches = n_batches
        self._pin_device = pin_device
        self._handed_over = False
        self.handle = WarmPass()

    def __del__(self) -> None:
        self.handle.stop.set()

    def __iter__(self) -> WarmStart:
        return self

    def __next__(self) -> Any:
        shared = self.handle
        if shared.served >= self._n_batches:
            shared.stop.set()
            raise StopIteration
        if shared.served > 0 and self._start_workers is not None:
            # The first batch is out: now start the workers, in this (the main) thread.
            workers = self._start_workers(shared.first_batch)
            self._start_workers = None
            shared.thread = threading.Thread(
                target=shared.produce, args=(workers,), name="resumable_data warm start", daemon=True
            )
            del workers  # the thread holds the only reference, so it can release the workers
            shared.thread.start()
        batch = _END if shared.thread is None else self._from_workers(block=self._handed_over)
        if batch is _END:
            batch = self._fetch(shared.served)
            if self._pin_device is not None:
                batch = pin(batch)
        shared.served += 1
        return batch

    def _from_workers(self, *, block: bool) -> Any:
        """The workers' copy of the next batch, or ``_END`` while the main process must serve it."""
        while True:
            try:
                item = self.handle.queue.get(block=block)
            except queue.Empty:
                return _END
            if item is _END:  # the workers' pass is over: the main process serves what is left
                self._handed_over = False
                return _END
            if isinstance(item, BaseException):
                raise item
            self._handed_over = True
            index, batch = item
            if index == self.handle.served:
                return batch
            block = True  # a batch the main process already served: drop it, take the next


def pin(batch: Any) -> Any:
    """``batch`` with its tensors in pinned memory, as DataLoader's pin thread leaves a batch.

    Through public APIs (``Tensor.pin_memory``, or a batch type's own ``pin_memory()``), over the
    containers ``default_collate`` builds: mappings, named tuples, tuples and lists.
    """
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if hasattr(batch, "pin_memory") and not isinstance(batch, type):
        return batch.pin_memory()
    if isinstance(batch, Mapping):
        pinned = {key: pin(value) for key, value in batch.items()}
        try:
            return type(batch)(pinned)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from a dict
            return pinned
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(pin(item) for item in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(pin(item) for item in batch)
    return batch
