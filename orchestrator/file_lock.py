"""An exclusive lock on a file that is removed again when its holder lets go.

``flock`` is released by the kernel when its holder dies, however it dies, so a killed process
never leaves a lock taken. The file is removed by a holder that lets go (nothing is left beside
a sweep, or in the temp folder); so a process that waited on the file its holder then removed
holds a lock no one else can see, and takes it again on the file now at the path: the inode it
locked must be the one there. Used for a sweep's folder (``sweep_guard``), the opening of a
SQLite tracking store (``tracking.client``) and a trial attempt's scratch folder, which its holder
removes whole (``trial.checkpoint``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


def take(path: str, wait: bool = True) -> int | None:
    """An open descriptor of ``path`` holding its exclusive lock; None where ``wait`` is False and
    another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def give_back(path: str, fd: int) -> None:
    """Remove the lock's file, then let go of it (in that order: see the module's docstring)."""
    with contextlib.suppress(OSError):
        os.remove(path)
    os.close(fd)


def held_elsewhere(path: str) -> bool:
    """Whether a process holds the lock of ``path`` now (asked for an instant with a shared lock,
    which does not make the file where there is none)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


@contextlib.contextmanager
def held(path: str) -> Iterator[None]:
    """The lock for the block, waiting for it as long as another process holds it."""
    fd = take(path)
    try:
        yield
    finally:
        give_back(path, fd)
