"""``orchestrator run CONFIG``: the sweep's driver in this process, on an embedded local Ray or,
with ``--ray-address``, on a cluster's Ray (as inside a SLURM job). Its checks and its results
are the runner's (``runner.run_sweep``); tests launch through it as they would any backend.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from typing import ClassVar

from orchestrator.config import SweepSpec
from orchestrator.errors import UserError
from orchestrator.launch.base import EMBEDDED_RAY_FLAGS, Launcher, refuse_flags
from orchestrator.run_request import RunRequest
from orchestrator.runner import InterruptedBeforeStart, StoppedAtOnce, resume_command, run_sweep, summary_lines, summary_table


@dataclass(frozen=True)
class LocalLauncher(Launcher):
    """Runs the sweep here and prints its table; exit 0 iff every trial finished and MLflow has it all."""

    name: ClassVar[str] = "local"
    driver_here: ClassVar[bool] = True

    dashboard: bool = False  # start the embedded Ray's dashboard
    dashboard_host: str = "127.0.0.1"

    @classmethod
    def from_args(cls, args) -> LocalLauncher:
        if getattr(args, "ray_address", None):
            refuse_flags(args, EMBEDDED_RAY_FLAGS, "only for the embedded local Ray; with --ray-address the trials get "
                         "the cluster's resources and dashboard (what its `ray start` gave them)")
        for flag, value, least in (("--num-cpus", getattr(args, "num_cpus", None), 1),
                                   ("--num-gpus", getattr(args, "num_gpus", None), 0)):
            if value is not None and value < least:
                raise UserError(f"{flag}: expected {least} or more, got {value:g}")
        launcher = cls(dashboard=getattr(args, "dashboard", False), dashboard_host=getattr(args, "dashboard_host", "127.0.0.1"))
        if launcher.dashboard:
            check_bindable(launcher.dashboard_host)
        return launcher

    def submit(self, request: RunRequest, spec: SweepSpec) -> int:
        try:
            outcome = run_sweep(
                spec,
                tracking_uri=request.tracking_uri,
                storage_path=request.storage_path,
                ray_address=request.ray_address,
                name=request.name,
                resume=request.resume,
                num_cpus=request.num_cpus,
                num_gpus=request.num_gpus,
                host_memory=request.host_memory,
                dashboard=self.dashboard,
                dashboard_host=self.dashboard_host,
                offline_tracking=request.offline_tracking,
                verbose=request.verbose,
                allow_config_change=request.allow_config_change,
            )
        except InterruptedBeforeStart:
            print(f"\nInterrupted before the sweep started. Run it again with: {request.command()}", file=sys.stderr)
            raise
        except StoppedAtOnce as stopped:
            print(f"\nInterrupted. Continue the sweep with: {resume_command(request, stopped.name)}", file=sys.stderr)
            raise
        print()
        print(summary_table(outcome.rows, spec))
        print()
        print("\n".join(summary_lines(outcome, spec, request)))
        return 0 if outcome.ok else 1


def check_bindable(host: str) -> None:
    """``--dashboard-host`` must be an address of this machine: Ray would try 50 ports on one it
    cannot bind, for a minute, and then end the sweep with its own traceback."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.bind(address)
    except (OSError, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise UserError(
            f"--dashboard-host: expected an address of this machine (or 0.0.0.0 for all of them), got {host!r} ({reason})"
        ) from None
