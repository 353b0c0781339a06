"""The switch that runs the suite without system packages (SLURM, munge, Chromium).

``scripts/test.sh`` installs them as root for the integration tests that need them, unless
``ORCHESTRATOR_NO_SYSTEM_PACKAGES=1``: then it installs none, and those tests skip, each naming
the variable, also where an earlier run installed the packages (the variable says this run
uses none: no daemons started as root, no browser).
"""

from __future__ import annotations

import os

NO_SYSTEM_PACKAGES = "ORCHESTRATOR_NO_SYSTEM_PACKAGES"


def left_out(packages: str) -> str | None:
    """Why a test that needs ``packages`` skips under the variable; None when it may use them."""
    if os.environ.get(NO_SYSTEM_PACKAGES) == "1":
        return f"{NO_SYSTEM_PACKAGES}=1: this run uses no system packages, and this test needs {packages}"
    return None
