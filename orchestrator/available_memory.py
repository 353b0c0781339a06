"""This machine's available memory: the one reader, for every part that weighs something against it.

Two parts ask: ``plan`` weighs the host memory of the trials a node runs at once against it
(``orchestrator.host_memory``), and the ``static`` estimator refuses to build a model for real
whose states would not fit in it (``orchestrator.memory.static``). Both read it here, so they
agree on what "available" means. Neither torch nor Ray: the contract layer, below both.

Available is Linux's ``MemAvailable`` (free memory plus what the kernel can reclaim without
swapping: page cache, reclaimable slabs), not ``MemFree``, which leaves out a page cache that
on a busy machine is most of its memory. A kernel without it (before 3.14) or another Unix
gives its free pages instead (less: the safe side); where neither can be read it is unknown.
"""

from __future__ import annotations

import os

MEMINFO = "/proc/meminfo"


def available_host_memory(meminfo: str = MEMINFO) -> int | None:
    """Bytes of memory this machine can give without swapping; None where it cannot be read."""
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
