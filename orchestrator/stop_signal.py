"""How the driver's stop signals behave: SIGTERM stops a sweep as Ctrl-C does, and a Ctrl-C
during Ray's start waits for the start to end.

SIGTERM is what SLURM (scancel, preemption), Kubernetes and ``kill`` send first, and a grace
period later SIGKILL. Tune handles SIGINT (and SIGUSR1) itself during ``Tuner.fit``: it stops the
trials, saves the experiment state one last time and returns, so the driver prints its table,
marks the MLflow runs and prints the resume command. SIGTERM has no such handler; ``ray.init``
installs one that raises ``SystemExit`` wherever the main thread is, which ends the driver with
Tune's stack dump, no table, and MLflow runs left ``RUNNING``.

So while the sweep runs, SIGTERM is handed to whatever handles SIGINT at that moment: Tune's
graceful stop the first time, the default ``KeyboardInterrupt`` (stop now) the second, exactly as
a second Ctrl-C.

While the driver starts Ray, a Ctrl-C is held until the start ends (``ctrl_c_held``): Python's
default handler raises ``KeyboardInterrupt`` wherever the main thread is, and there that can be
inside logging's fork handler, which then never gives back logging's lock.
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def _deliver_sigint(handler, frame) -> None:
    """What a SIGINT does under ``handler``, as Python would call it."""
    if callable(handler):
        handler(signal.SIGINT, frame)
    elif handler == signal.SIG_DFL:
        raise KeyboardInterrupt
    # SIG_IGN: ignored, as SIGINT would be


def _as_sigint(signum: int, frame) -> None:
    _deliver_sigint(signal.getsignal(signal.SIGINT), frame)


@contextmanager
def sigterm_stops_like_sigint() -> Iterator[None]:
    """Within the block, SIGTERM does what SIGINT does; the handler before it is back after it.
    Only the main thread may set signal handlers (a driver run from another thread keeps its own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _as_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@contextmanager
def ctrl_c_held(on_hold: Callable[[], None] | None = None) -> Iterator[None]:
    """Within the block, the first Ctrl-C (SIGINT) is held and delivered when the block ends; a
    second one is delivered at once, as a second Ctrl-C stops Tune at once. ``on_hold`` is called
    as the first one comes, for what may stop at once: the estimates beside Ray's start start no
    new one while the start ends. It must not wait on a lock, and may be called twice (by
    :func:`_told_at_once` and by the handler).

    For Ray's start: ``ray.init`` starts its processes with a ``preexec_fn``, so each fork runs
    Python's fork handlers in the driver, logging's among them: it takes logging's module lock
    before the fork and gives it back after. A ``KeyboardInterrupt`` raised in that handler is
    ignored ("Exception ignored in: _releaseLock") and the lock stays taken. The next thread to log
    then waits forever, and with it the command: a Ctrl-C while the driver estimated once left it
    hanging (CI, with the estimate's thread waiting on that lock). A start takes seconds; the
    Ctrl-C then stops the command as before."""
    before = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or before == signal.SIG_IGN:
        yield
        return
    held = False

    def hold(signum: int, frame) -> None:
        nonlocal held
        if held:
            _deliver_sigint(before, frame)
            return
        held = True
        if on_hold is not None:
            on_hold()

    signal.signal(signal.SIGINT, hold)
    try:
        with _told_at_once(on_hold):
            yield
    finally:
        signal.signal(signal.SIGINT, before)
    if held:
        _deliver_sigint(before, None)


@contextmanager
def _told_at_once(on_hold: Callable[[], None] | None) -> Iterator[None]:
    """``on_hold`` called from a thread of its own as soon as a SIGINT arrives.

    Python runs a signal's handler in the main thread, between two of its bytecodes; inside a long
    call into C that is not interrupted (``ray.init`` waiting in Ray's C++ for its raylet, on a
    busy machine for seconds), the handler waits for the call to return. The signal's number is
    written at once to the wakeup fd (``signal.set_wakeup_fd``), which this thread reads. (A CI
    run's Ctrl-C came during such a wait, and a second five-second estimate started before the
    handler ran.)"""
    if on_hold is None:
        yield
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    before = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch() -> None:
        while signals := reader.recv(64):  # b"" once the block's end closed the writer
            if signal.SIGINT in signals:
                on_hold()

    watcher = threading.Thread(target=watch, name="ctrl-c-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(before)
        writer.close()
        watcher.join()
        reader.close()
