"""SIGTERM during a sweep does what SIGINT does at that moment, and a Ctrl-C during Ray's start is
held until the start ends (orchestrator/stop_signal.py).

The sweep's own behaviour (table, resume command, MLflow runs marked, exit 1) is tested through
the installed command in tests/test_cli.py; here, the handing over itself, in this process.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from orchestrator.stop_signal import ctrl_c_held, sigterm_stops_like_sigint


def test_sigterm_runs_the_sigint_handler_of_the_moment(default_sigint):
    """As Tune's: it stops the sweep gracefully and puts back the handler it replaced, so a second
    SIGTERM, like a second Ctrl-C, interrupts at once."""
    seen = []

    def tunes(signum, frame):
        seen.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, tunes)
    with sigterm_stops_like_sigint():
        signal.raise_signal(signal.SIGTERM)
        assert seen == [signal.SIGINT]
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)


def test_an_ignored_sigint_ignores_sigterm_too(default_sigint):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with sigterm_stops_like_sigint():
        signal.raise_signal(signal.SIGTERM)


def test_the_sigterm_handler_before_is_back_after(default_sigint):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), sigterm_stops_like_sigint():
        assert signal.getsignal(signal.SIGTERM) is not before
        signal.raise_signal(signal.SIGTERM)  # the default SIGINT handler: KeyboardInterrupt
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_ctrl_c_during_the_block_is_delivered_when_it_ends(default_sigint):
    """What ``ray.init`` runs in the block ends first: a ``KeyboardInterrupt`` raised inside it can
    land in logging's fork handler, which then leaves logging's lock taken for good."""
    ran_on = []
    with pytest.raises(KeyboardInterrupt), ctrl_c_held():
        signal.raise_signal(signal.SIGINT)
        ran_on.append("after the Ctrl-C")
    assert ran_on == ["after the Ctrl-C"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_what_may_stop_at_once_is_told_as_the_held_ctrl_c_comes(default_sigint):
    """The estimates beside Ray's start stop starting new ones at the Ctrl-C, not once the start
    has ended (a start slowed by a busy machine outlasted an estimate, and the next one began)."""
    told = threading.Event()
    with pytest.raises(KeyboardInterrupt), ctrl_c_held(on_hold=told.set):
        assert not told.is_set()
        signal.raise_signal(signal.SIGINT)
        assert told.wait(10)


def test_what_may_stop_at_once_is_told_while_the_main_thread_is_in_a_call_that_runs_no_handler(default_sigint):
    """A Ctrl-C that comes while the main thread waits inside a call (``ray.init`` in Ray's C++)
    is told at once all the same, not when the call returns. Here the main thread blocks SIGINT, so
    another thread takes it and the main thread's wait is not interrupted: its handler runs only
    once the wait is over, and the wait ends only if ``on_hold`` was called without it."""
    told = threading.Event()
    wakeup_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup_fd)
    with pytest.raises(KeyboardInterrupt), ctrl_c_held(on_hold=told.set):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            os.kill(os.getpid(), signal.SIGINT)
            assert told.wait(30)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.set_wakeup_fd(wakeup_fd) == wakeup_fd  # the wakeup fd given back


def test_a_second_ctrl_c_stops_at_once(default_sigint):
    ran_on = []
    with pytest.raises(KeyboardInterrupt), ctrl_c_held():
        signal.raise_signal(signal.SIGINT)
        ran_on.append("after the first")
        signal.raise_signal(signal.SIGINT)
        ran_on.append("after the second")
    assert ran_on == ["after the first"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_a_ctrl_c_the_block_ends_as_it_would(default_sigint):
    with ctrl_c_held():
        pass
    with pytest.raises(ValueError), ctrl_c_held():  # the block's own error, not a held interrupt
        raise ValueError("Ray did not start")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored(default_sigint):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with ctrl_c_held():
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        signal.raise_signal(signal.SIGINT)


def test_another_handler_gets_the_held_ctrl_c_once(default_sigint):
    seen = []
    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    with ctrl_c_held():
        signal.raise_signal(signal.SIGINT)
        assert seen == []
    assert seen == [signal.SIGINT]


def test_off_the_main_thread_nothing_is_held(default_sigint):
    """Only the main thread may set a handler; a driver run from another thread keeps its own."""
    seen = []

    def in_a_thread():
        with ctrl_c_held():
            seen.append(signal.getsignal(signal.SIGINT))

    worker = threading.Thread(target=in_a_thread)
    worker.start()
    worker.join()
    assert seen == [signal.default_int_handler]
