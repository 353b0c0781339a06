"""Ray's authentication token: on disk readable by its owner only, and sent to a cluster.

Ray 2.60 turns token authentication on by default and keeps the token in ``~/.ray/auth_token``,
written with the process's umask: 0644 in a 0755 folder, so any user of the machine could read
it and, with it, run code on the cluster. Before a local Ray starts (which creates the token
when there is none) the folder is made 0700, so no other user can reach whatever Ray writes in
it; afterwards the token file is made 0600. The SLURM script does the same around ``ray
get-auth-token --generate``. Tokens named by ``RAY_AUTH_TOKEN_PATH`` are the user's own files
and are left as they are.

Ray's clients send the token only where ``RAY_AUTH_MODE=token`` is set, and Ray reads that when
it is imported. A cluster started with ``ray start --head`` has token authentication on, but the
shell a user joins it from rarely has the variable: ``ray.init(address=...)`` then retries for
20 s and fails. So ``run --ray-address`` sets it, before Ray is imported, wherever a token is
there to send (a cluster with authentication off accepts a driver that sends one).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from orchestrator.errors import UserError

FOLDER_MODE, FILE_MODE = 0o700, 0o600
#: Where Ray looks for the token, in its order.
TOKEN_SOURCES = "RAY_AUTH_TOKEN, the file named by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token"
AUTH_MODE = "RAY_AUTH_MODE"


def default_token_path() -> Path:
    return Path.home() / ".ray" / "auth_token"


def token_to_send() -> bool:
    """Whether one of :data:`TOKEN_SOURCES` has a token (without importing Ray, which reads
    ``RAY_AUTH_MODE`` once, on import)."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return True
    named = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(named).expanduser().is_file() if named else default_token_path().is_file()


def token_refused(sent: bool, detail: str | None = None) -> str:
    """A cluster's refusal of this machine's token (``sent``) or of its lack of one, and what to
    do, in the same words whichever way the sweep joins it (the dashboard's job API, the GCS)."""
    problem = "rejected our token" if sent else "needs a token and none was found"
    return (f"the cluster {problem}{f' ({detail})' if detail else ''}. Put the cluster's token "
            f"(`ray get-auth-token` where it was started) in {TOKEN_SOURCES}")


def send_token_to_clusters() -> None:
    """``RAY_AUTH_MODE=token`` for this process and those it starts, where a token is there to
    send and the user set no mode of their own (``disabled`` stays theirs). Only before Ray is
    imported: afterwards this process's client keeps the mode it read, and its children alone
    would change theirs (``main`` called in-process, as tests do)."""
    if "ray" not in sys.modules and AUTH_MODE not in os.environ and token_to_send():
        os.environ[AUTH_MODE] = "token"


def secure_token_files() -> None:
    """``~/.ray`` 0700 (created if missing) and ``~/.ray/auth_token`` 0600 when it exists. A home
    where the folder cannot be made is one line: a local Ray could not keep its token there either."""
    path = default_token_path()
    folder = path.parent
    try:
        folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        _restrict(folder, FOLDER_MODE)
        if path.exists():
            _restrict(path, FILE_MODE)
    except OSError as exc:
        raise UserError(
            f"cannot make {folder} private ({exc.strerror or exc}): Ray keeps the cluster's token there; "
            "run with HOME set to a folder you can write"
        ) from None


def _restrict(path: Path, mode: int) -> None:
    """chmod to ``mode`` if it is ours and allows more (never touching another user's file)."""
    info = path.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & ~mode:
        path.chmod(mode)
