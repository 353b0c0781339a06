"""A checkpoint the sweep's storage does not take: retried, then the sweep stops, losing nothing.

Tune copies each reported checkpoint to the storage path before ``tune.report`` returns. A full
disk (``ENOSPC``, a quota), a storage that turned read-only (``EROFS``, ``EACCES``) or went away
(an unmounted share: ``ENOENT``, or Tune's storage marker missing) fails that copy, and Tune
would end the trial as an error: not retried, and not continued by ``run --resume``. Such an
outage is often short, and it is the storage's, not the trial's: so the report is tried again
a few times, and if the storage still refuses, the trial says so in a report of its own
(``TrialReport.storage_fault``) and waits; the driver (``orchestrator.storage_fault``) then
stops the sweep as Ctrl-C does, every trial ``INTERRUPTED`` at its last checkpoint, to be
continued with the printed ``run ... --resume`` once the storage is back.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: Seconds between the tries of one checkpoint's report: 15 s in all before the sweep is stopped.
RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)
#: How long a trial that reported a storage fault waits for the driver to stop the sweep, before
#: it fails as it would have without this module (a driver that does not stop it: an old one).
STOP_WAIT_S = 120.0

#: What a storage that is full, read-only, gone or unreachable answers a write with.
STORAGE_ERRNOS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EIO,
    errno.ESTALE, errno.ENOTCONN, errno.EHOSTDOWN,
})
#: Tune's check, before each checkpoint copy, that the experiment's storage marker is there; a
#: storage that was unmounted fails it (``ray.train._internal.storage._check_validation_file``).
_MARKER_MISSING = "Unable to set up cluster storage"


class StorageUnavailable(RuntimeError):
    """The storage did not take a checkpoint, tried :data:`RETRY_DELAYS_S` apart. One line."""


def storage_fault(exc: BaseException) -> str | None:
    """The exception's line when it is the storage refusing a write, else None."""
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        return " ".join(str(exc).split())  # pyarrow's messages run over lines
    if isinstance(exc, RuntimeError) and str(exc).startswith(_MARKER_MISSING):
        return "the storage path is gone (Tune's storage marker is missing: unmounted?)"
    return None


def report_with_retries(send: Callable[[], None], where: str | None = None,
                        sleep: Callable[[float], None] = time.sleep) -> None:
    """``send()`` (a report that copies a checkpoint to storage, into the folder ``where``), tried
    again while the storage refuses it; :class:`StorageUnavailable` once every try failed, naming
    ``where`` when the refusal does not (a full disk's does not). Any other error is raised as is."""
    for delay in (*RETRY_DELAYS_S, None):
        try:
            send()
            return
        except Exception as exc:  # noqa: BLE001 - only the storage's refusals are retried
            line = storage_fault(exc)
            if line is None:
                raise
            if delay is None:
                tries, waited = len(RETRY_DELAYS_S) + 1, sum(RETRY_DELAYS_S)
                if where and where not in line:
                    line += f" (writing a checkpoint into {where})"
                raise StorageUnavailable(f"{line} (tried {tries} times over {waited:g} s)") from None
            logger.warning("the storage did not take a checkpoint (%s); trying again in %g s", line, delay)
            sleep(delay)


def wait_to_be_stopped(fault: StorageUnavailable, sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait for the driver to stop the sweep (it kills this trial's worker); raise ``fault`` if
    it does not within :data:`STOP_WAIT_S`."""
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        sleep(0.5)
    raise fault
