"""The embedded Ray's processes live in a process group of their own, which ends with the driver.

SLURM and Kubernetes stop a job with SIGTERM to its whole process group. Ray starts its GCS and
raylet in the driver's group, so that signal would end them at the moment it asks the driver to
stop: the driver could then not stop its trials, save the sweep or print its table, and would
exit 1 once it noticed the GCS was gone (~60 s). So a local ``ray.init`` starts them in another
group (``ray_internals.ray_processes_in_group``), where only the driver's own stop reaches them.

Out of the driver's group, a ``kill -9`` of the driver and then of its group (what a batch system
or a shell does to what is left) would leave Ray's agents running: they are the raylet's
children, and do not notice its death. So the group is led by a keeper: a small process of the
driver's session that waits for the driver to close a pipe (it does by exiting, however it
exits, the kernel closing the pipe for a killed driver) and then kills the whole group.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from orchestrator.ray_internals import ray_processes_in_group

#: The keeper: reads its stdin to the end (the driver gone), then kills its group, itself included.
_KEEPER = "import os, signal, sys; sys.stdin.buffer.read(); os.killpg(0, signal.SIGKILL)"

_keeper: subprocess.Popen | None = None


def _group() -> int:
    """The group the keeper leads, started once per driver process (a driver that starts Ray again
    reuses it)."""
    global _keeper
    if _keeper is None or _keeper.poll() is not None:
        _keeper = subprocess.Popen([sys.executable, "-c", _KEEPER], stdin=subprocess.PIPE, process_group=0,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return _keeper.pid


@contextmanager
def ray_in_its_own_group() -> Iterator[None]:
    """Within the block, a local ``ray.init`` starts Ray's processes in the keeper's group."""
    if sys.platform == "win32":  # Ray starts them in process groups of their own there already
        yield
        return
    with ray_processes_in_group(_group()):
        yield
