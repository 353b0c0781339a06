"""How many CPUs this process may use: what the embedded local Ray schedules trials on, and how
many estimate processes run beside the driver.

Two limits make it fewer than the machine has, and neither is counted by ``os.cpu_count()``:

* the **affinity** (``taskset``, ``numactl``, a SLURM step's cpuset): the cores the process may
  run on at all. Ray ignores it (it counts the machine, ray issue 34846), so ``orchestrator run``
  inside ``srun --cpus-per-task=4`` on a 64-core node would start 64 trials on 4 cores;
* a **CPU quota** (Docker's ``--cpus``, a Kubernetes limit, a systemd slice's ``CPUQuota``): any
  cores, but only so much time of them per period. Ray reads it only at the cgroup root of the
  mount, so a quota on the process's own cgroup below the root is missed too.

Both are read here, the quota from the process's own cgroup and every cgroup above it (a
parent's limit binds its children), cgroup v2 (``cpu.max``) and v1 (``cpu.cfs_quota_us``), and
the smaller count wins. A fractional quota counts as its whole CPUs, at least one, as Ray counts
it: 1.5 CPUs of time run one trial at full speed, not two.
"""

from __future__ import annotations

import math
import os

NO_LIMIT = math.inf


def usable_cores(proc: str = "/proc") -> int:
    """The CPUs this process may use: its affinity, capped by the CPU quota of its cgroups.
    ``proc`` is where ``/proc`` is mounted (a test gives a folder of its own)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no affinity, no cgroups
        return os.cpu_count() or 1
    quota = cpu_quota(proc)
    return max(1, math.floor(quota)) if quota < cores else cores


def cpu_quota(proc: str = "/proc") -> float:
    """The tightest CPU quota on this process's cgroups, in CPUs; :data:`NO_LIMIT` when none is set
    (or the cgroups cannot be read: no quota is then assumed, as without cgroups)."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            memberships = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        with open(os.path.join(proc, "self", "mountinfo")) as f:
            mounts = [_mount(line) for line in f]
    except OSError:
        return NO_LIMIT
    tightest = NO_LIMIT
    for _, controllers, path in memberships:
        version = 2 if controllers == "" else 1
        if version == 1 and "cpu" not in controllers.split(","):
            continue
        for root, mount_point in _mounts_of(mounts, version):
            folder = _folder(mount_point, root, path)
            if folder is not None:
                tightest = min(tightest, _quota_up_to(folder, mount_point, version))
    return tightest


def _mount(line: str) -> tuple[str, str, str, set[str]]:
    """(root within the hierarchy, mount point, file system type, super options) of a mountinfo line."""
    fields = line.split()
    after = fields.index("-")
    return fields[3], fields[4], fields[after + 1], set(fields[after + 3].split(",")) if len(fields) > after + 3 else set()


def _mounts_of(mounts, version: int):
    for root, mount_point, fstype, options in mounts:
        if (version == 2 and fstype == "cgroup2") or (version == 1 and fstype == "cgroup" and "cpu" in options):
            yield root, mount_point


def _folder(mount_point: str, root: str, path: str) -> str | None:
    """Where the cgroup ``path`` is under a mount of its hierarchy whose root is ``root`` (a
    container sees its own cgroup as the mount's root); None if the mount does not show it."""
    if root != "/" and path != root and not path.startswith(root.rstrip("/") + "/"):
        return None
    relative = path[len(root):] if root != "/" else path
    folder = os.path.normpath(os.path.join(mount_point, relative.lstrip("/")))
    return folder if os.path.isdir(folder) else None


def _quota_up_to(folder: str, mount_point: str, version: int) -> float:
    """The tightest quota from ``folder`` up to the mount point."""
    tightest = NO_LIMIT
    while True:
        tightest = min(tightest, _quota(folder, version))
        if os.path.normpath(folder) == os.path.normpath(mount_point):
            return tightest
        folder = os.path.dirname(folder)


def _quota(folder: str, version: int) -> float:
    try:
        if version == 2:
            with open(os.path.join(folder, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
            return NO_LIMIT if quota == "max" else int(quota) / int(period)
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return NO_LIMIT if quota < 0 else quota / period
    except (OSError, ValueError):  # no cpu controller here (a v2 cgroup without it, the root)
        return NO_LIMIT
