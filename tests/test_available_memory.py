"""This machine's available memory, the one reader (``orchestrator/available_memory.py``)."""

import os

import pytest

from orchestrator.available_memory import available_host_memory

linux = pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux's /proc/meminfo")


def meminfo() -> dict[str, int]:
    with open("/proc/meminfo") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[-1] == "kB"}


@linux
def test_it_is_linux_s_mem_available_in_bytes():
    fields = meminfo()
    available = available_host_memory()
    assert 0 < available <= fields["MemTotal"]
    # Read a moment apart, on a machine other tests share: the same to within a tenth of it.
    assert abs(available - fields["MemAvailable"]) < fields["MemTotal"] / 10


@linux
@pytest.mark.parametrize("where", ["old kernel", "no meminfo"])
def test_without_mem_available_it_is_the_free_pages(tmp_path, where):
    """A kernel before 3.14 writes no MemAvailable: its free memory instead, the smaller."""
    path = tmp_path / "meminfo"
    if where == "old kernel":
        path.write_text("MemTotal:       16384 kB\nMemFree:         8192 kB\n")
    fields = meminfo()
    available = available_host_memory(str(path))
    assert 0 < available <= fields["MemTotal"]
    assert abs(available - fields["MemFree"]) < fields["MemTotal"] / 10


MiB = 1 << 20


def cgroups(tmp_path, membership: str, files: dict[str, object]) -> dict[str, str]:
    """A /proc/self/cgroup and a cgroup mount of these files, as the kernel writes them."""
    tmp_path.mkdir(exist_ok=True)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(membership)
    root = tmp_path / "cgroup"
    root.mkdir()
    for name, value in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"{value}\n")
    return {"cgroup": str(proc), "cgroup_root": str(root)}


@linux
def test_a_cgroup_limit_is_the_headroom_left_under_it_less_what_the_kernel_cannot_take_back(tmp_path):
    """A SLURM job's step (v2): the job's limit less its working set (usage less inactive page
    cache); a tighter limit below it wins; a limit of 'max' is none."""
    job = {"job_7/memory.max": 1024 * MiB, "job_7/memory.current": 700 * MiB,
           "job_7/memory.stat": f"anon {600 * MiB}\nfile {100 * MiB}\ninactive_file {100 * MiB}",
           "job_7/step_0/memory.max": "max", "job_7/step_0/memory.current": 650 * MiB}
    assert available_host_memory(**cgroups(tmp_path / "a", "0::/job_7/step_0\n", job)) == 424 * MiB
    step = {**job, "job_7/step_0/memory.max": 700 * MiB}
    assert available_host_memory(**cgroups(tmp_path / "b", "0::/job_7/step_0\n", step)) == 50 * MiB


@linux
def test_a_v1_memory_cgroup_counts_too_and_its_unlimited_is_none(tmp_path):
    files = {"memory/slurm/job_1/memory.limit_in_bytes": 2048 * MiB, "memory/slurm/job_1/memory.usage_in_bytes": 1536 * MiB,
             "memory/slurm/job_1/memory.stat": f"inactive_file 0\ntotal_inactive_file {512 * MiB}",
             "memory/slurm/memory.limit_in_bytes": 9223372036854771712, "memory/slurm/memory.usage_in_bytes": 1536 * MiB}
    membership = "12:memory:/slurm/job_1\n4:cpu,cpuacct:/slurm/job_1\n0::/\n"
    assert available_host_memory(**cgroups(tmp_path, membership, files)) == 1024 * MiB


@linux
def test_a_container_s_cgroup_is_its_mount_s_root_whatever_proc_names_it(tmp_path):
    files = {"memory.max": 256 * MiB, "memory.current": 56 * MiB}
    assert available_host_memory(**cgroups(tmp_path, "0::/kubepods/pod1/ctr\n", files)) == 200 * MiB


@linux
def test_without_a_limit_it_is_the_machine_s(tmp_path):
    fields = meminfo()
    available = available_host_memory(**cgroups(tmp_path, "0::/user.slice\n", {"user.slice/memory.max": "max"}))
    assert abs(available - fields["MemAvailable"]) < fields["MemTotal"] / 10
