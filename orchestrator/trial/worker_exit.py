"""A trial's Ray worker that is told to exit exits, without a stack dump on the sweep's console.

Ray's workers answer SIGTERM (what the raylet sends when Tune ends a trial's actor, as on a
graceful stop) by raising ``SystemExit`` from the signal handler. Python runs a handler wherever
the main thread is at that moment; when that is inside a finaliser (a weakref callback during
garbage collection) the exception cannot leave it: Python prints ``Exception ignored in ...``
with a traceback, Ray forwards it to the driver, where it lands between the live view's lines,
and the worker carries on. The hook below turns that case into what Ray meant: no traceback,
and the exit asked for again from outside the finaliser.
"""

from __future__ import annotations

import signal
import sys
import threading


def exit_requests_survive_finalisers() -> None:
    """Install the hook in this process, once (a reused worker runs many trials); every other
    unraisable exception goes to the hook that was there before."""
    if getattr(sys.unraisablehook, "exits_again", False):
        return
    previous = sys.unraisablehook

    def exit_again(unraisable) -> None:
        if isinstance(unraisable.exc_value, SystemExit):
            # A moment later, from another thread, so the main thread takes it once it is out of
            # the finaliser (tripped from here, it would be handled here, inside it, again).
            again = threading.Timer(0.05, signal.pthread_kill, args=(threading.main_thread().ident, signal.SIGTERM))
            again.daemon = True
            again.start()
            return
        previous(unraisable)

    exit_again.exits_again = True
    sys.unraisablehook = exit_again
