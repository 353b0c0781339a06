"""orchestrator.parent_watch: a spawned process ends when the process that spawned it is killed.

Real processes: a parent spawns a pool whose worker runs ``die_with_parent`` and then sleeps,
as a busy estimate does; ``kill -9`` of the parent must take the worker with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.conftest import alive

PARENT = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from concurrent.futures import ProcessPoolExecutor
    from orchestrator.parent_watch import die_with_parent

    def busy(_):
        print(os.getpid(), flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        watched = dict(initializer=die_with_parent, initargs=(os.getpid(),)) if sys.argv[1] == "watched" else {}
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), **watched)
        pool.submit(busy, 0)
        time.sleep(600)
""")


def spawned_worker(tmp_path, mode: str) -> tuple[subprocess.Popen, int]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return parent, int(parent.stdout.readline())


def killed_parent_leaves(tmp_path, mode: str) -> bool:
    """Whether the worker is still alive 10 s after its parent was killed (killed here if so)."""
    parent, worker = spawned_worker(tmp_path, mode)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(worker):
        os.kill(worker, signal.SIGKILL)
        return True
    return False


def test_a_worker_dies_with_its_killed_parent(tmp_path):
    assert not killed_parent_leaves(tmp_path, "watched")
    assert killed_parent_leaves(tmp_path, "unwatched")  # what the watch is for: busy, it would live on
