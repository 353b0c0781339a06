"""Folders a command writes into, checked before anything is written there.

A command that refuses (exit 2) leaves nothing half-made: a folder is tried with a file before
the work that fills it starts (a path under a file, a read-only mount, a full disk are one line,
not a traceback after minutes of work), and a folder the command made for a run it then refused
is taken back. ``run`` does this for its storage folder and a new SQLite store
(``orchestrator.preflight``), ``report`` for its ``--out``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from orchestrator.errors import UserError


def check_folder(path: str | os.PathLike, what: str, advice: str) -> None:
    """``path`` exists (or is made) and takes a file; else one line naming ``what`` (the key or
    flag that gave it) and the reason, with ``advice``."""
    try:
        os.makedirs(path, exist_ok=True)
        take_a_file(path)
    except OSError as exc:
        reason = "a file, not a folder" if os.path.exists(path) and not os.path.isdir(path) else exc.strerror or exc
        raise UserError(f"{what}: cannot write to {path} ({reason}); {advice}") from None


def take_a_file(folder: str | os.PathLike) -> None:
    """Create and remove a file in ``folder``: raises the ``OSError`` a real write would meet."""
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".orchestrator-write-check-"):
        pass


def outermost_missing(path: Path) -> Path:
    """The first of ``path``'s folders (or ``path`` itself) that does not exist: what making it makes."""
    while not path.parent.exists():
        path = path.parent
    return path


@contextlib.contextmanager
def taken_back_if_refused(folder: str | os.PathLike) -> Iterator[None]:
    """What the block makes of ``folder`` goes again if the block refuses (raises ``UserError``)
    or is interrupted (Ctrl-C during ``run``'s checks and Ray's start, or a SIGTERM, which Ray's
    handler makes ``SystemExit``): only what did not exist before, and only while nothing was
    written under it.

    ``run``'s storage check makes the storage folder (does it take a file?), and a refusal after
    it (a model that cannot be estimated, a relative storage path on a cluster, no sweep to
    resume) would leave it, empty, in the user's working directory; so would ``report``'s
    ``--out`` for an experiment that is not there."""
    made = Path(os.path.abspath(folder))
    if made.exists():
        yield
        return
    made = outermost_missing(made)
    try:
        yield
    except (UserError, KeyboardInterrupt, SystemExit):
        if made.is_dir() and not any(p.is_file() for p in made.rglob("*")):
            shutil.rmtree(made, ignore_errors=True)
        raise
