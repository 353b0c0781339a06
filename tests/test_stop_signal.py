"""SIGTERM during a sweep does what SIGINT does at that moment (orchestrator/stop_signal.py).

The sweep's own behaviour (table, resume command, MLflow runs marked, exit 1) is tested through
the installed command in tests/test_cli.py; here, the handing over itself, in this process.
"""

from __future__ import annotations

import signal

import pytest

from orchestrator.stop_signal import sigterm_stops_like_sigint


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
