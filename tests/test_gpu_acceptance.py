"""``bench/gpu_acceptance.py``: on a machine without a GPU, ``--dry-run`` lists every pending GPU
measurement with the command it would run, and checks that everything it runs imports."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

MEASUREMENTS = (
    "accuracy_gpu_zoo_expandable", "accuracy_gpu_zoo_default", "accuracy_library_expandable", "accuracy_library_default",
    "largest_batch_expandable", "largest_batch_default", "sweep_packed", "sweep_oom", "plan_verification",
    "driver_off_the_gpu", "reused_worker_memory", "nccl_two_ranks",
)


def test_the_dry_run_lists_every_measurement_and_its_command():
    done = subprocess.run([sys.executable, "bench/gpu_acceptance.py", "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "PROBLEM" not in out
    for name in MEASUREMENTS:
        assert f"\n{name} (" in f"\n{out}", name
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("$ ")]
    assert len(commands) == len(MEASUREMENTS)
    assert any("--allocator-conf" in c for c in commands) and any("memory.estimator=none" in c for c in commands)
    # where plan verification is not built yet, it is listed as what it needs; one GPU or none: no NCCL
    assert "plan verification" in out
    assert "skipped: needs 2 GPUs" in out
