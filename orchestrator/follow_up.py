"""What a sweep's driver prints for what comes next (continue it, report it) where a launcher
started the driver somewhere other than the user's shell.

A local ``run`` prints its own command again (``invocation``). A Ray Job's driver runs as
``python -m orchestrator`` in a copy of the project on the cluster, without the ``--address``
that took it there: ``python -m orchestrator run ... --resume`` in the user's shell finds no
orchestrator, or runs the sweep here. A SLURM job's driver names the job's own Ray and MLflow
server, both gone once the job ends. Their launchers tell the driver what the user runs instead,
in its environment; neither torch nor Ray, read wherever a command is printed.
"""

from __future__ import annotations

import os
import shlex

#: The words a printed command starts with (the user's own ``orchestrator``, as they ran it).
PREFIX = "ORCHESTRATOR_PRINTED_PREFIX"
#: Flags a printed ``run`` adds (``--address URL``: the sweep continues on the cluster it ran on).
RUN_FLAGS = "ORCHESTRATOR_PRINTED_RUN_FLAGS"
#: The whole command that continues the sweep (``sbatch <job folder>/job.sbatch``).
RESUME = "ORCHESTRATOR_PRINTED_RESUME"
#: The store the sweep's records are read from afterwards (``sqlite:///<job folder>/mlflow.db``).
TRACKING_URI = "ORCHESTRATOR_PRINTED_TRACKING_URI"


def prefix() -> list[str] | None:
    return shlex.split(os.environ[PREFIX]) if os.environ.get(PREFIX) else None


def run_flags() -> list[str]:
    return shlex.split(os.environ.get(RUN_FLAGS, ""))


def resume() -> str | None:
    return os.environ.get(RESUME) or None


def tracking_uri() -> str | None:
    return os.environ.get(TRACKING_URI) or None
