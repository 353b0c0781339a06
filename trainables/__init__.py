"""Workloads and the one generic training loop that runs them."""

from trainables.workload import Workload, build_workload, resolve_workload

__all__ = ["Workload", "build_workload", "resolve_workload"]
