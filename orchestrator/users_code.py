"""Which lines of a traceback are the user's own code, and how a line is shown.

A failure in a trial, a workload's constructor or its ``build_model`` is the user's to fix, so
every message about it points at the user's line: not at torch's (where the error was raised),
the standard library's, or ours (where our hooks, such as the preflight's ``meta`` device,
passed the call through). Both the driver, which reads a trial's traceback as text, and the
training library, which holds the exception, ask this one rule.
"""

from __future__ import annotations

import os
import sysconfig

#: The standard library's folders, each ending in a separator.
_STDLIB = tuple(os.path.join(sysconfig.get_paths()[key], "") for key in ("stdlib", "platstdlib"))
#: The orchestrator's own packages, wherever they are installed (a checkout, an editable install).
_OURS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), package, "")
              for package in ("orchestrator", "trainables"))
#: Installed packages, wherever the environment keeps them (a venv, the system, a conda env).
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def standard_library(file: str) -> bool:
    return os.path.abspath(file).startswith(_STDLIB)


def installed(file: str) -> bool:
    """Whether ``file`` belongs to an installed package (torch, Ray, ...)."""
    return any(part in os.path.abspath(file) for part in _INSTALLED)


def users(file: str) -> bool:
    """Whether ``file`` is the user's own code: a file, and not the standard library's, an
    installed package's or ours."""
    return not (file.startswith("<") or standard_library(file) or installed(file)
                or os.path.abspath(file).startswith(_OURS))


def shown(file: str, line: int | str) -> str:
    """``FILE:LINE``, the file relative to the working directory when it is below it."""
    relative = os.path.relpath(file)
    return f"{file if relative.startswith('..') else relative}:{line}"
