"""This machine's available memory: the one reader, for every part that weighs something against it.

Two parts ask: the host-memory plan, which ``plan`` shows and ``run`` applies, weighs what the
trials a node runs at once hold against it (``orchestrator.host_memory``, ``node_memory``), and
the ``static`` estimator refuses to build a model for real whose states would not fit in it
(``orchestrator.memory.static``). Both read it here, so they agree on what "available" means. Neither torch nor Ray: the contract layer, below both.

Available is Linux's ``MemAvailable`` (free memory plus what the kernel can reclaim without
swapping: page cache, reclaimable slabs), not ``MemFree``, which leaves out a page cache that
on a busy machine is most of its memory. A kernel without it (before 3.14) or another Unix
gives its free pages instead (less: the safe side); where neither can be read it is unknown.

A process in a cgroup with a memory limit (a container's, a Kubernetes pod's, a SLURM job's
under ``ConstrainRAMSpace``) is killed at that limit whatever the machine has free, and
``MemAvailable`` is the machine's. So where this process's cgroup, or one above it, has a
limit, available is at most its headroom: the limit less the memory the cgroup holds that the
kernel cannot take back (its usage less its inactive page cache, the working set as Docker and
Kubernetes count it). Both cgroup versions: v2's ``memory.max``, v1's ``memory.limit_in_bytes``.
"""

from __future__ import annotations

import os

MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"  # this process's cgroup in each hierarchy
CGROUP_ROOT = "/sys/fs/cgroup"

#: v1 writes "no limit" as the largest page-aligned 64-bit number; anything past this is none.
_V1_UNLIMITED = 1 << 62

#: (file of the limit, file of the usage, memory.stat's count of inactive page cache) per version
_V2 = ("memory.max", "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def available_host_memory(meminfo: str = MEMINFO, *, cgroup: str = PROC_CGROUP,
                          cgroup_root: str = CGROUP_ROOT) -> int | None:
    """Bytes of memory this process can take without swapping or meeting its cgroup's limit;
    None where it cannot be read."""
    machine = _machine_available(meminfo)
    headroom = _cgroup_headroom(cgroup, cgroup_root)
    if headroom is None:
        return machine
    return headroom if machine is None else min(machine, headroom)


def _machine_available(meminfo: str) -> int | None:
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name (macOS)
        return None


def _cgroup_headroom(cgroup: str, root: str) -> int | None:
    """The smallest headroom of this process's memory cgroups and those above them; None
    without a limit (or outside Linux)."""
    try:
        with open(cgroup) as f:
            memberships = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    headrooms = []
    for _, controllers, path in (m for m in memberships if len(m) == 3):
        if controllers == "":  # v2: one hierarchy at the root (a hybrid system's memory controller is v1's)
            base, files = root, _V2
        elif "memory" in controllers.split(","):
            base, files = os.path.join(root, "memory"), _V1
        else:
            continue
        headrooms += _headrooms_up(base, path, files)
    return min(headrooms) if headrooms else None


def _headrooms_up(base: str, path: str, files: tuple[str, str, str]) -> list[int]:
    """The headroom of each limited cgroup from ``path`` up to the hierarchy's root. Where
    ``path`` is not under ``base`` (a container sees its own cgroup at the mount's root, while
    /proc names it from the host's), of ``base`` alone."""
    parts = [part for part in path.split("/") if part]
    if not os.path.isdir(os.path.join(base, *parts)):
        parts = []
    headrooms = (_headroom(os.path.join(base, *parts[:depth]), files) for depth in range(len(parts), -1, -1))
    return [h for h in headrooms if h is not None]


def _headroom(folder: str, files: tuple[str, str, str]) -> int | None:
    limit_file, usage_file, inactive_key = files
    try:
        with open(os.path.join(folder, limit_file)) as f:
            limit = f.read().strip()
        if limit == "max" or int(limit) >= _V1_UNLIMITED:
            return None
        with open(os.path.join(folder, usage_file)) as f:
            usage = int(f.read())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        with open(os.path.join(folder, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
                    break
    except (OSError, ValueError):
        pass
    return max(int(limit) - (usage - inactive), 0)
