"""Ray's authentication token on disk: readable by its owner only.

Ray 2.60 turns token authentication on by default and keeps the token in ``~/.ray/auth_token``,
written with the process's umask: 0644 in a 0755 folder, so any user of the machine could read
it and, with it, run code on the cluster. Before a local Ray starts (which creates the token
when there is none) the folder is made 0700, so no other user can reach whatever Ray writes in
it; afterwards the token file is made 0600. The SLURM script does the same around ``ray
get-auth-token --generate``. Tokens named by ``RAY_AUTH_TOKEN_PATH`` are the user's own files
and are left as they are.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

FOLDER_MODE, FILE_MODE = 0o700, 0o600


def default_token_path() -> Path:
    return Path.home() / ".ray" / "auth_token"


def secure_token_files() -> None:
    """``~/.ray`` 0700 (created if missing) and ``~/.ray/auth_token`` 0600 when it exists."""
    path = default_token_path()
    folder = path.parent
    folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
    _restrict(folder, FOLDER_MODE)
    if path.exists():
        _restrict(path, FILE_MODE)


def _restrict(path: Path, mode: int) -> None:
    """chmod to ``mode`` if it is ours and allows more (never touching another user's file)."""
    info = path.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & ~mode:
        path.chmod(mode)
