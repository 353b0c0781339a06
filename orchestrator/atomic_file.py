"""Files the orchestrator keeps its own state in, written whole or not at all.

A driver or worker can die mid-write (killed, out of disk, the storage unmounted): a state file
cut off there would be read back as garbage by the next ``--resume`` (a truncated pickle is an
``EOFError``, a truncated ``state.pt`` a failed restore). :func:`atomic_write` writes a file
beside the target in the same folder, flushes it to disk and renames it over the target, so a
reader sees the old file or the new one, never a part. Every state file goes through it.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import IO, Any


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """``with atomic_write(path, "wb") as f: ...``: ``path`` holds what was written once the block
    ends without an error; on an error it keeps what it held before and the partial file is gone.

    The partial file is created as ``open`` would create the target (permissions from the
    umask), in the target's folder (a rename within one file system is atomic), under a name of
    its own, so two writers of one path do not write into each other's partial file.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes a whole file: mode 'w' or 'wb', not {mode!r}")
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    partial = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:12]}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise
