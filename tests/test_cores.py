"""The CPUs this process may use: its affinity, capped by the CPU quota of its cgroups, read the
way the kernel shows them (``/proc/self/cgroup``, ``/proc/self/mountinfo``, the cgroup files);
and an embedded local Ray started with that count, not the machine's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from orchestrator.cores import NO_LIMIT, cpu_quota, usable_cores
from tests.conftest import command_env, installed_command

V1_MOUNTINFO = ("32 31 0:29 {root} {cpu} rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
                "33 31 0:30 / {memory} rw,relatime - cgroup cgroup rw,memory\n")
V2_MOUNTINFO = "30 23 0:26 / {unified} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def a_proc(tmp_path: Path, cgroup: str, mountinfo: str) -> str:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(mountinfo)
    return str(proc)


def write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text + "\n")


def test_a_quota_on_a_cgroup_above_the_process_s_binds_it_and_the_tightest_one_counts(tmp_path):
    # cgroup v2: a systemd slice with 1.5 CPUs, the process's scope below it unlimited.
    unified = tmp_path / "unified"
    write(unified, cpu_max="max 100000")
    write(unified / "team.slice", cpu_max="150000 100000")
    write(unified / "team.slice" / "sweep.scope", cpu_max="max 100000")
    proc = a_proc(tmp_path, "0::/team.slice/sweep.scope\n", V2_MOUNTINFO.format(unified=unified))
    assert cpu_quota(proc) == 1.5
    # Its whole CPUs, as Ray counts a fractional quota; never more than the affinity allows.
    assert usable_cores(proc) == min(len(os.sched_getaffinity(0)), 1)
    write(unified / "team.slice" / "sweep.scope", cpu_max="50000 100000")
    assert cpu_quota(proc) == 0.5
    assert usable_cores(proc) == 1  # at least one


def test_a_container_s_v1_cgroup_is_its_mount_s_root(tmp_path):
    # Docker without a cgroup namespace: /proc/self/cgroup names the container's cgroup, which is
    # mounted as the root of /sys/fs/cgroup/cpu,cpuacct.
    cpu, memory = tmp_path / "cpu,cpuacct", tmp_path / "memory"
    write(cpu, cpu_cfs_quota_us="200000", cpu_cfs_period_us="100000")
    write(memory)
    proc = a_proc(tmp_path, "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n",
                  V1_MOUNTINFO.format(root="/docker/abc", cpu=cpu, memory=memory))
    assert cpu_quota(proc) == 2.0
    assert usable_cores(proc) == min(len(os.sched_getaffinity(0)), 2)


def test_no_quota_leaves_the_affinity(tmp_path):
    cpu, memory = tmp_path / "cpu", tmp_path / "memory"
    write(cpu, cpu_cfs_quota_us="-1", cpu_cfs_period_us="100000")
    write(memory)
    proc = a_proc(tmp_path, "2:cpu,cpuacct:/\n", V1_MOUNTINFO.format(root="/", cpu=cpu, memory=memory))
    assert cpu_quota(proc) == NO_LIMIT
    assert usable_cores(proc) == len(os.sched_getaffinity(0))
    # No /proc to read (not Linux's, a sandbox): no quota is assumed.
    assert cpu_quota(str(tmp_path / "nowhere")) == NO_LIMIT


def test_the_affinity_counts_the_cores_the_process_is_pinned_to():
    everywhere = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(everywhere)})
    try:
        assert usable_cores() == 1
    finally:
        os.sched_setaffinity(0, everywhere)


@contextmanager
def cgroup_of_one_cpu():
    """A real cgroup (v2 where its cpu controller can be given, else v1's cpu hierarchy) whose
    quota is one CPU; skips where none can be made (not root, a read-only cgroup file system)."""
    name = f"orchestrator-test-{uuid.uuid4().hex[:8]}"
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
    if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.subtree_control").read_text().split():
        folder, files = v2 / name, {"cpu.max": "100000 100000"}
    elif (v1 / "cpu.cfs_quota_us").exists():
        folder, files = v1 / name, {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}
    else:
        pytest.skip("no cgroup cpu controller this test can use (cgroup v2 with cpu delegated, or v1's cpu)")
    try:
        folder.mkdir()
        for file, text in files.items():
            (folder / file).write_text(text)
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup with a CPU quota here ({exc.strerror}: {folder})")
    try:
        yield folder
    finally:
        for _ in range(100):  # Ray's last processes may take a moment to exit
            try:
                folder.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def in_cgroup(folder: Path, command: list[str]) -> list[str]:
    """``command``, run as a process of the cgroup ``folder`` (it joins it, then execs)."""
    return ["sh", "-c", f'echo $$ > "{folder}/cgroup.procs" && exec "$@"', "sh", *command]


def test_a_cpu_quota_of_the_process_s_own_cgroup_is_read_from_the_kernel():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: a quota of one CPU changes nothing to see")
    with cgroup_of_one_cpu() as folder:
        probe = [sys.executable, "-c", "from orchestrator.cores import usable_cores, cpu_quota; "
                                       "print(usable_cores(), cpu_quota())"]
        out = subprocess.run(in_cgroup(folder, probe), capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["1", "1.0"]


@pytest.mark.integration
def test_the_embedded_ray_gets_the_cpus_a_taskset_leaves_not_the_machine_s(tmp_path):
    """Ray alone counts the machine's CPUs (ray issue 34846): inside ``taskset`` or a SLURM step it
    would run more trials at once than there are cores to run them."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: pinning to one changes nothing to see")
    (tmp_path / "sweep.yaml").write_text(textwrap.dedent("""\
        experiment: pinned
        workload: {name: mlp, params: {depth: 1, width: 16}}
        search_space: {lr: {grid: [0.01]}}
        effective_batch_size: 64
        stop: {epochs: 1}
        resources: {cpu: 1, gpu: 0}
        memory: {device: cpu}
        storage_path: ./results
    """))
    core = str(min(os.sched_getaffinity(0)))
    run = subprocess.run(["taskset", "-c", core, installed_command(), "run", "sweep.yaml"], cwd=tmp_path,
                         env=command_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Ray: 1 node(s), 1 CPUs, 0 GPUs" in run.stdout.splitlines(), run.stdout[-3000:]
