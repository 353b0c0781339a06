"""The launcher contract: one sweep's ``run`` (a :class:`RunRequest`) started on one backend.

In submitit's shape: a launcher is built from its own options (``from_args``), checks what only
its backend can refuse (``check``), and starts the request (``submit``); :func:`launch` runs
the same pre-flight for every one of them in between, so a mistake ``run`` refuses in one line
here is refused in the same line before anything reaches a cluster.
"""

from __future__ import annotations

import contextlib
import sys
from abc import ABC, abstractmethod
from typing import ClassVar

from orchestrator.config import SweepSpec, folder_name, load_spec, storage_folder, tracking_store
from orchestrator.errors import UserError
from orchestrator.preflight import check_workloads
from orchestrator.run_request import RunRequest


#: ``run``'s flags that size or open the embedded local Ray this machine would start; a sweep on a
#: cluster's Ray has the resources and dashboard the cluster's ``ray start`` gave it.
EMBEDDED_RAY_FLAGS = (("num_cpus", "--num-cpus"), ("num_gpus", "--num-gpus"), ("dashboard", "--dashboard"))


def refuse_flags(args, flags: tuple[tuple[str, str], ...], why: str) -> None:
    """The first of ``flags`` (attribute, flag) the command line set is a one-line error: a flag
    the backend cannot honour is not silently dropped."""
    for attribute, flag in flags:
        value = getattr(args, attribute, None)
        if value is not None and value is not False:  # given (a --num-gpus 0 too), not argparse's default
            raise UserError(f"{flag}: {why}")


class Launcher(ABC):
    """One backend that runs sweeps."""

    #: The name the registry (``orchestrator.launch``) knows it by.
    name: ClassVar[str]
    #: Whether the sweep's driver runs in this process (``runner.run_sweep``): it makes the
    #: pre-flight's checks itself, its estimates while Ray starts. For every other launcher
    #: :func:`launch` makes them here before :meth:`submit`.
    driver_here: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_args(cls, args) -> Launcher:
        """The launcher for a parsed command line; flags it cannot honour are one-line errors."""

    def check(self, request: RunRequest, spec: SweepSpec) -> None:
        """What only this backend can refuse (an allocation too small for a trial, a config
        outside the folder a job uploads); cheap, and before the pre-flight's slower checks."""

    @abstractmethod
    def submit(self, request: RunRequest, spec: SweepSpec) -> int:
        """Start the sweep (and follow it as far as the backend lets); the command's exit status."""


def launch(launcher: Launcher, request: RunRequest) -> int:
    """Check ``request`` as ``run`` does, then hand it to ``launcher``; its exit status."""
    spec = load_spec(request.config, list(request.overrides))
    if request.name is not None:
        folder_name(request.name, "--name")
    if request.storage_path is not None:
        storage_folder(request.storage_path, "--storage-path")
    if request.tracking_uri is not None:  # an empty one would quietly be the default store
        tracking_store(request.tracking_uri, "--tracking-uri")
    if request.allow_config_change and not request.resume:
        raise UserError("--allow-config-change: only with --resume (a new sweep has no config to differ from)")
    launcher.check(request, spec)
    if not launcher.driver_here:
        preflight(spec)
    return launcher.submit(request, spec)


def preflight(spec: SweepSpec) -> None:
    """What ``run`` checks of the sweep itself before its trials start, wherever it will run: each
    workload's model builds and it has data for a step and a collate that takes it
    (``preflight.check_workloads``), and each model takes the step of the estimate the driver
    makes (``runner.estimate_before_start``; its target is the sweep's, not this machine's).
    Where results go is a place on the cluster, which only the sweep's own driver can check
    there. What the checks say goes to standard error: standard output is the command's own
    (``submit --dry-run``'s script)."""
    from orchestrator.runner import estimate_before_start

    with contextlib.redirect_stdout(sys.stderr):
        check_workloads(spec)
        estimate_before_start(spec)
