"""GracefulStop: SIGTERM and Ctrl-C become a flag the loop reads at its next step boundary; a second
Ctrl-C aborts; the previous handlers come back; off the main thread nothing is installed."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from resumable_data.checkpoint import GracefulStop


def test_a_signal_sets_the_reason_and_the_process_goes_on() -> None:
    said: list[str] = []
    previous = signal.getsignal(signal.SIGTERM)
    with GracefulStop(announce=said.append) as stop:
        assert stop.reason is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.reason == "SIGTERM"
    assert said == ["received SIGTERM: finishing this step, then saving (Ctrl-C again aborts without saving)"]
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_second_ctrl_c_aborts_at_once() -> None:
    with GracefulStop(announce=lambda line: None) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.reason == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_off_the_main_thread_no_handler_is_installed() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    seen: list[object] = []

    def enter() -> None:
        with GracefulStop() as stop:
            seen.extend([signal.getsignal(signal.SIGTERM), stop.reason])

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join(timeout=10)
    assert seen == [previous, None]
