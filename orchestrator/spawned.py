"""What a process the driver spawns does first (its pool's ``initializer``, :func:`start`): it
ends when the driver ends, however that ends, and it collects garbage as the command does.

A driver killed with ``kill -9`` (or by the OOM killer) runs no clean-up, and a spawned worker
that is busy (an estimate takes minutes and hundreds of MB) would not notice for as long as it
works. Here: no torch, no Ray, so a spawned process reaches it within moments of starting (its
pool unpickles the initializer before anything heavy is imported).
"""

from __future__ import annotations

import atexit
import os

from orchestrator.garbage import collect_less, skip_last_collection


def start(parent: int) -> None:
    """First thing in a process ``parent`` spawns: end when it ends, collect garbage less often
    while importing torch, and exit without the last collection, which its pool waits for
    (``orchestrator.garbage``: 0.5 s of a process that imported torch and traced a model)."""
    die_with_parent(parent)
    collect_less()
    atexit.register(skip_last_collection)  # before torch is imported: it runs after torch's exit handlers


def die_with_parent(parent: int) -> None:
    """End when ``parent`` ends (the first thing :func:`start` does).

    On Linux the kernel sends SIGKILL when the parent goes (``PR_SET_PDEATHSIG``; it fires when
    the thread that spawned the process ends, so spawn from a thread that outlives the pool);
    elsewhere a thread watches the parent. A parent already gone before this ran is noticed here.
    """
    import ctypes
    import signal
    import sys
    import threading
    import time

    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
