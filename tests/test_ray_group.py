"""The embedded Ray's process group (``orchestrator/ray_group.py``): out of reach of a signal to
the driver's group, and killed when the driver dies, however it dies. Real processes stand in
for Ray's: a driver that starts one in the group, as ``ray.init`` does within the block."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.conftest import alive

DRIVER = """\
import signal, subprocess, sys, time
from orchestrator.ray_group import _group

ray_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], process_group=_group())
signal.signal(signal.SIGTERM, lambda *_: print("stopping", flush=True))  # a driver's graceful stop
print(ray_process.pid, flush=True)
time.sleep(600)
"""


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_a_signal_to_the_driver_s_group_reaches_the_driver_alone():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ray_process = int(driver.stdout.readline())
        assert os.getpgid(ray_process) not in (driver.pid, os.getpgrp())
        os.killpg(driver.pid, signal.SIGTERM)  # what SLURM and Kubernetes send: the driver's group
        assert driver.stdout.readline() == "stopping\n"
        time.sleep(1)
        assert alive(ray_process) and driver.poll() is None  # for the driver to stop it
    finally:
        driver.kill()
        driver.wait()
    assert _gone_within(ray_process, 10)


def test_a_killed_driver_takes_ray_s_group_with_it():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    ray_process = int(driver.stdout.readline())
    time.sleep(0.5)
    assert alive(ray_process)
    driver.kill()
    driver.wait()
    assert _gone_within(ray_process, 10)
