"""orchestrator.spawned: a spawned process ends when the process that spawned it is killed, and
collects garbage as the command does.

Real processes: a parent spawns a pool whose worker runs ``spawned.start`` and then sleeps,
as a busy estimate does; ``kill -9`` of the parent must take the worker with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.conftest import alive, command_env

PARENT = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from concurrent.futures import ProcessPoolExecutor
    from orchestrator import spawned

    def busy(_):
        print(os.getpid(), flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        watched = dict(initializer=spawned.start, initargs=(os.getpid(),)) if sys.argv[1] == "watched" else {}
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


STARTED = """
import atexit, gc, os
from orchestrator import spawned
from orchestrator.garbage import YOUNG_THRESHOLD
spawned.start(os.getppid())
print(gc.get_threshold()[0] == YOUNG_THRESHOLD, gc.get_freeze_count() == 0)
atexit._run_exitfuncs()  # what the process's exit runs before its last collection
print(gc.get_freeze_count() > 0)
"""


def test_a_spawned_process_collects_less_and_leaves_its_objects_out_of_its_last_collection(tmp_path):
    """The estimate pool waits for each process's exit, whose last garbage collection walks every
    object importing torch made (0.5 s a process): its exit handlers freeze them first, and its
    imports collect as seldom as the command's (``orchestrator.garbage``)."""
    proc = subprocess.run([sys.executable, "-c", STARTED], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=command_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "True True\nTrue\n"
