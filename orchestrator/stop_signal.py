"""SIGTERM stops a sweep as Ctrl-C does.

SIGTERM is what SLURM (scancel, preemption), Kubernetes and ``kill`` send first, and a grace
period later SIGKILL. Tune handles SIGINT (and SIGUSR1) itself during ``Tuner.fit``: it stops the
trials, saves the experiment state one last time and returns, so the driver prints its table,
marks the MLflow runs and prints the resume command. SIGTERM has no such handler; ``ray.init``
installs one that raises ``SystemExit`` wherever the main thread is, which ends the driver with
Tune's stack dump, no table, and MLflow runs left ``RUNNING``.

So while the sweep runs, SIGTERM is handed to whatever handles SIGINT at that moment: Tune's
graceful stop the first time, the default ``KeyboardInterrupt`` (stop now) the second, exactly as
a second Ctrl-C.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def _as_sigint(signum: int, frame) -> None:
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    elif handler == signal.SIG_DFL:
        raise KeyboardInterrupt
    # SIG_IGN: ignored, as SIGINT would be


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
