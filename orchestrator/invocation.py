"""How the user started this command, so the commands we print for them run as printed.

``pip install`` puts ``orchestrator`` in the venv's ``bin`` folder, which is on nobody's PATH
until the venv is activated: a printed ``orchestrator run ... --resume`` would then answer
"command not found". Printed commands start with what the user typed instead
(``.venv/bin/orchestrator``, ``python -m orchestrator``), or the bare name where the shell
finds this very script by it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from orchestrator import follow_up

PROGRAM = "orchestrator"
_MAIN = Path(__file__).resolve().with_name("__main__.py")


def command_prefix(argv: list[str] | None = None, orig_argv: list[str] | None = None) -> list[str]:
    """The words that start this command again: ``["orchestrator"]`` when that name on PATH is
    the script that ran, the script's path as typed otherwise, ``[PYTHON, "-m", "orchestrator"]``
    after ``python -m orchestrator`` (the interpreter as typed), and this process's interpreter
    with ``-m`` when neither started it (``cli.main`` called from Python, as in tests)."""
    argv = sys.argv if argv is None else argv
    orig_argv = getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv
    started_by = argv[0] if argv else ""
    if os.path.basename(started_by) == PROGRAM:
        return [PROGRAM] if _same_file(shutil.which(PROGRAM), started_by) else [started_by]
    if started_by and Path(started_by).resolve() == _MAIN and orig_argv:
        return [orig_argv[0], "-m", PROGRAM]
    return [sys.executable, "-m", PROGRAM]


def shell_command(*words: str) -> str:
    """``orchestrator`` (as the user can run it) followed by ``words``, quoted for a POSIX shell; in
    a driver a launcher started elsewhere, as the user ran the launcher (``follow_up.prefix``)."""
    return shlex.join([*(follow_up.prefix() or command_prefix()), *words])


def tool(name: str) -> str:
    """Another console script of this environment (``ray``), as the user can run it: its bare
    name where PATH finds this one, else its path next to this Python."""
    here = Path(sys.executable).parent / name
    return name if _same_file(shutil.which(name), str(here)) or not here.exists() else str(here)


def _same_file(found: str | None, started_by: str) -> bool:
    """Whether PATH's ``orchestrator`` is the script at ``started_by``: compared as paths, not by
    following links, since a venv's scripts are found by where they are, not what they point to."""
    return found is not None and os.path.abspath(found) == os.path.abspath(started_by)
