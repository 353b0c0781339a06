"""One sweep's ``orchestrator run`` as a value, and the one builder of its command line.

Every launcher starts the same command: the local one runs it in this process, a Ray Job runs
it on the cluster's head, a SLURM job's script runs it on the allocation's first node, and the
resume hint printed after an interrupted sweep is it again with ``--resume``. Each used to
assemble its own list of flags; a flag added to ``run`` now reaches all of them here.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator import follow_up
from orchestrator.invocation import shell_command


class Expanded(str):
    """A word the shell fills in when the command runs (``"$TRACKING_URI"`` in a SLURM job's
    script, known only once its MLflow server is up): written as it is, never quoted."""


@dataclass(frozen=True)
class RunRequest:
    """What ``orchestrator run`` is asked to do, apart from where it runs (the launcher's part).

    Only what changes the sweep or where its results go is here; how a launcher starts it
    (``--address``, ``--dashboard``, a SLURM allocation) belongs to that launcher.
    """

    config: str
    overrides: tuple[str, ...] = ()
    storage_path: str | None = None
    tracking_uri: str | None = None
    ray_address: str | None = None  # the driver joins this cluster's GCS instead of starting a Ray
    num_cpus: int | None = None  # of the embedded local Ray
    num_gpus: float | None = None
    host_memory: str | None = None  # each node's available memory for the trials, as given ("64GiB")
    offline_tracking: bool = False
    verbose: bool = False  # Ray's and Tune's own output instead of one line per trial event
    name: str | None = None  # the sweep's folder under the storage path
    resume: bool = False
    allow_config_change: bool = False  # resume even where the config differs from the stored sweep's

    @classmethod
    def from_args(cls, args) -> RunRequest:
        """The request a parsed ``run`` or ``submit`` command line makes (flags a command lacks
        keep their defaults)."""
        values = {field.name: getattr(args, field.name, field.default) for field in dataclasses.fields(cls)}
        return cls(**{**values, "overrides": tuple(values["overrides"])})

    def replace(self, **changes) -> RunRequest:
        return dataclasses.replace(self, **changes)

    def arguments(self) -> list[str]:
        """The words after the program: ``run CONFIG --set ... --name NAME --resume``."""
        words = ["run", self.config]
        for override in self.overrides:
            words += ["--set", override]
        for flag, value in (("--storage-path", self.storage_path), ("--tracking-uri", self.tracking_uri),
                            ("--ray-address", self.ray_address), ("--num-cpus", self.num_cpus),
                            ("--num-gpus", self.num_gpus), ("--host-memory", self.host_memory)):
            if value is not None:
                words += [flag, value if isinstance(value, str) else str(value)]
        if self.offline_tracking:
            words.append("--offline-tracking")
        if self.verbose:
            words.append("--verbose")
        if self.name:
            words += ["--name", self.name]
        if self.resume:
            words.append("--resume")
        if self.allow_config_change:
            words.append("--allow-config-change")
        return words

    def command(self, program: Sequence[str] | None = None) -> str:
        """The command line for a POSIX shell. ``program`` starts it (``python -m orchestrator``
        on a cluster); by default it starts as the user started this command
        (``orchestrator.invocation``), so a printed command runs as printed, with the flags a
        launcher adds to it (``follow_up.run_flags``: a Ray Job's ``--address``)."""
        if program is None:
            words = self.arguments()
            return shell_command(*words[:2], *follow_up.run_flags(), *words[2:])
        return " ".join(word if isinstance(word, Expanded) else shlex.quote(word)
                        for word in (*program, *self.arguments()))
