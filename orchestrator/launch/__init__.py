"""Where a sweep runs: one launcher per backend behind one contract (``base.Launcher``).

Each backend is one module, registered below by one line: ``local`` (this process, an embedded
or given Ray; also what tests launch through), ``ray-job`` (a Ray Job on a running cluster) and
``slurm`` (a SLURM job that starts its own Ray cluster). A launcher's module is imported when
it is used, so ``submit`` never imports Ray.
"""

from __future__ import annotations

from importlib import import_module

from orchestrator.launch.base import Launcher, launch, preflight

__all__ = ["LAUNCHERS", "Launcher", "get_launcher", "launch", "preflight", "register"]

#: name -> launcher class, or "module:Class" for one imported when it is first used.
LAUNCHERS: dict[str, type[Launcher] | str] = {
    "local": "orchestrator.launch.local:LocalLauncher",
    "ray-job": "orchestrator.launch.ray_job:RayJobLauncher",
    "slurm": "orchestrator.launch.slurm:SlurmLauncher",
}


def register(launcher: type[Launcher]) -> type[Launcher]:
    """Add a launcher class defined elsewhere (a site's, a test's) under its ``name``."""
    LAUNCHERS[launcher.name] = launcher
    return launcher


def get_launcher(name: str) -> type[Launcher]:
    """The launcher class registered as ``name``."""
    found = LAUNCHERS[name]
    if isinstance(found, str):
        module, _, attribute = found.partition(":")
        found = LAUNCHERS[name] = getattr(import_module(module), attribute)
    return found
