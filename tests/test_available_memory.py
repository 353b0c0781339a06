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
