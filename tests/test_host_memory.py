"""A trial's host memory against a node's (``orchestrator/host_memory.py``): pure arithmetic on
measured footprints."""

from __future__ import annotations

from orchestrator.config import DataLoading
from orchestrator.host_memory import available_host_memory, plan_host_memory, trial_parts
from trainables.footprint import DataFootprint

MiB = 1 << 20
# 100 MiB of tensors, 50 MiB of Python objects, 4 MiB batches, 30 MiB of model and optimizer.
FOOTPRINT = DataFootprint(shared_bytes=100 * MiB, copied_bytes=50 * MiB, batch_bytes=4 * MiB, state_bytes=30 * MiB)


def test_workers_share_tensors_copy_objects_and_hold_their_batches_ahead():
    parts = trial_parts(FOOTPRINT, DataLoading(num_workers=4, prefetch_factor=3), pinned=True)
    assert parts == {"datasets": (100 + 50 * 5) * MiB, "batches ahead": 4 * 3 * 4 * MiB, "pinned": 4 * 3 * 4 * MiB,
                     "checkpoint copy": 30 * MiB}
    alone = trial_parts(FOOTPRINT, DataLoading(), pinned=False)  # loading in the trial's process: one batch at a time
    assert alone == {"datasets": 150 * MiB, "batches ahead": 4 * MiB, "pinned": 0, "checkpoint copy": 30 * MiB}


def test_settings_that_fit_are_kept():
    data = DataLoading(num_workers=4)
    plan = plan_host_memory(FOOTPRINT, data, pinned=False, trials_at_once=2, available_bytes=10_000 * MiB)
    assert plan.data == data and not plan.reduced and plan.refusal is None
    assert plan.trial_bytes == (100 + 250 + 32 + 30) * MiB


def test_a_node_that_cannot_hold_its_trials_loads_fewer_batches_ahead_then_uses_fewer_workers():
    data = DataLoading(num_workers=8, prefetch_factor=4)
    # 8 workers: 100 + 450 + 8*4*4 + 30 = 708 MiB a trial; prefetch 1: 612; 4 workers: 100 + 250 + 16 + 30 = 396.
    plan = plan_host_memory(FOOTPRINT, data, pinned=False, trials_at_once=2, available_bytes=800 * MiB)
    assert plan.data == DataLoading(num_workers=4, prefetch_factor=1)
    assert plan.reduced == "data.num_workers 8->4, data.prefetch_factor 4->1" and plan.refusal is None
    assert "2 at once: 792.0 MiB of 800.0 MiB available; data.num_workers 8->4" in plan.describe()


def test_a_node_that_cannot_hold_them_even_without_workers_is_refused_in_one_line():
    plan = plan_host_memory(FOOTPRINT, DataLoading(num_workers=2), pinned=False, trials_at_once=4, available_bytes=500 * MiB)
    assert plan.data == DataLoading() and plan.reduced == "data.num_workers 2->0"
    assert plan.refusal.startswith("4 trial(s) at once need 736.0 MiB of host memory even loading in their own processes")
    assert "\n" not in plan.describe()



def _machine(tmp_path, cgroup: str, files: dict[str, str], mem_available_kib: int = 64 * 2**20):
    """A ``/proc`` and ``/sys/fs/cgroup`` under ``tmp_path``, laid out as the kernel shows them."""
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text(f"MemTotal: {2 * mem_available_kib} kB\nMemAvailable: {mem_available_kib} kB\n")
    (tmp_path / "proc" / "self" / "cgroup").write_text(cgroup)
    for path, text in files.items():
        (tmp_path / "sys/fs/cgroup" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "sys/fs/cgroup" / path).write_text(text)
    return str(tmp_path)


def test_available_memory_is_the_machine_s_or_what_its_cgroup_limit_leaves_whichever_is_less(tmp_path):
    # cgroup v2, a SLURM job's limit on the job (above the step the process is in): 8 GiB, 5 GiB used, 1 GiB of it cache.
    v2 = _machine(tmp_path / "v2", "0::/slurm/job_7/step_0\n", {
        "slurm/job_7/memory.max": str(8 << 30), "slurm/job_7/memory.current": str(5 << 30),
        "slurm/job_7/memory.stat": f"anon 1\ninactive_file {1 << 30}\n",
        "slurm/job_7/step_0/memory.max": "max", "slurm/job_7/step_0/memory.current": str(5 << 30),
    })
    assert available_host_memory(v2) == 4 << 30
    # cgroup v1, a container that sees its own cgroup at the mount's root; no limit: the machine's MemAvailable.
    v1 = _machine(tmp_path / "v1", "4:memory:/docker/abc\n3:cpu:/docker/abc\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": str(3 << 30)})
    assert available_host_memory(v1) == 64 << 30
    limited = _machine(tmp_path / "v1b", "4:memory:/docker/abc\n", {
        "memory/memory.limit_in_bytes": str(2 << 30), "memory/memory.usage_in_bytes": str(1 << 30)})
    assert available_host_memory(limited) == 1 << 30
    assert available_host_memory(str(tmp_path / "nothing")) is None
