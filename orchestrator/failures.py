"""What a failed trial's error says, read in one place for the retry scheduler, the table and MLflow.

Tune keeps a trial's failures in its ``error.txt`` as ``Failure # N`` blocks of text (``str`` of
the exception), and the newest Ray exception itself in ``error.pkl``. Both are written on the
driver, in the trial's staging folder, before Tune calls the scheduler, so they are read there
(``Trial.get_pickled_error()`` reads the copy on the storage path, which is synced later and may
still hold the previous failure).

A dead worker is an out-of-memory failure only with evidence: Ray's memory monitor killed it
(``ray.exceptions.OutOfMemoryError``, "killed due to the node running low on memory"), or the
trial wrote an OOM event before it died (:mod:`orchestrator.trial.evidence`). A ``kill -9``, a lost node or
a segfault is none of those: the trial restarts with the plan it had. The kernel's OOM killer
leaves no trace Ray can see (Ray only lists it among the possible causes of a SIGKILL), so a
worker it killed is restarted with the same plan, and the in-process OOM handling or Ray's
memory monitor (which acts before the kernel) are what shrink plans.
"""

from __future__ import annotations

import re

from orchestrator.contract import OOM_MESSAGES
from orchestrator.users_code import shown, users

_GAVE_UP = ("OomRetriesExhausted",)
#: ``orchestrator.trial.errors.NotRetriedError``'s name, before the earlier error its message holds.
_NOT_RETRIED = "NotRetriedError: "
_WORKER_DIED = ("RayActorError", "actor died unexpectedly", "ActorDiedError")
#: What Ray says of an actor whose node was lost (its raylet gone: a machine down, preempted, drained).
_NODE_DIED = re.compile(r"its node has died|node (?:was|has been) (?:terminated|marked dead)|NodeDiedError|raylet (?:has )?died")
#: What the driver sees first when a node vanishes: the connection to the trial's actor is gone
#: (Ray's ``ActorUnavailableError``) before Ray has declared the node dead (a few health checks later).
_UNREACHABLE = re.compile(r"ActorUnavailableError|actor is temporarily unavailable")
#: What Ray's memory monitor says when it kills workers (its error text has no exception name).
_MEMORY_MONITOR = re.compile(r"killed due to the node running low on memory|ray\.exceptions\.OutOfMemoryError")

#: A traceback's frame, and what separates the tracebacks of a chained exception.
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in ', re.MULTILINE)
_CHAINED = re.compile(r"^(?:The above exception was the direct cause|During handling of the above exception)", re.MULTILINE)
#: ``package.module.SomeError: message`` (the module path is dropped when shown)
_EXCEPTION_LINE = re.compile(r"^(?:\w+\.)*(\w+(?:Error|Exception|Exhausted|Refused)\b.*: .*)$")


def last_failure(error_file: str | None) -> str:
    """The text of the newest ``Failure # N`` block Tune wrote for a trial."""
    if not error_file:
        return ""
    try:
        with open(error_file) as f:
            text = f.read()
    except OSError:
        return ""
    return text.rsplit("Failure # ", 1)[-1]


def exception_line(text: str) -> str:
    """The line a person needs from a traceback: the innermost exception and its message, and
    where the user's own code raised it or called into what did (``(at my_models/wide.py:14)``)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    raised = [m.group(1) for line in text.splitlines() if (m := _EXCEPTION_LINE.match(line))]
    if raised:
        line = raised[-1].removeprefix(_NOT_RETRIED)  # the restart that fails at once: the earlier error is the news
        where = raised_at(text)
        return f"{line} (at {where})" if where and where not in line else line
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "unknown error"


def raised_at(text: str) -> str | None:
    """``FILE:LINE`` of the innermost frame of the user's own code in a traceback's text (its last
    exception's: a chained one's cause is another story), relative to the working directory when
    below it; None where no frame is the user's (installed packages, the standard library and
    the orchestrator's own packages are not)."""
    last = _CHAINED.split(text)[-1]
    own = [(file, line) for file, line in _FRAME.findall(last) if users(file)]
    return shown(*own[-1]) if own else None


def pickled_failure(pickled_error_file: str | None, failure: str) -> BaseException | None:
    """The exception Tune pickled for this failure, or None (none, unreadable, or from an earlier
    failure: Tune pickles only Ray's task and actor errors and leaves an older pickle in place)."""
    if not pickled_error_file:
        return None
    try:
        import cloudpickle

        with open(pickled_error_file, "rb") as f:
            error = cloudpickle.load(f)
    except Exception:  # noqa: BLE001 - missing, or classes this process cannot load: use the text
        return None
    return error if str(error).strip() and str(error).strip() in failure else None


def classify(failure: str, error: BaseException | None = None, oom_evidence: bool = False) -> str:
    """``gave_up`` | ``oom`` | ``node_died`` | ``node_unreachable`` | ``worker_died`` | ``other``,
    from the exception where Tune pickled it, else from the text; a dead worker is ``oom`` only
    with evidence (see the module), a worker whose whole node was lost is ``node_died``, and one
    whose node stopped answering ``node_unreachable`` (both keep their plan)."""
    from ray.exceptions import ActorUnavailableError, NodeDiedError, OutOfMemoryError, RayActorError, RayTaskError

    if isinstance(error, OutOfMemoryError) or _MEMORY_MONITOR.search(failure):
        return "oom"
    if isinstance(error, ActorUnavailableError) or _UNREACHABLE.search(failure):
        return "node_unreachable"
    if isinstance(error, NodeDiedError) or (
            isinstance(error, RayActorError) and not isinstance(error, RayTaskError) and _NODE_DIED.search(failure)):
        return "node_died"
    if isinstance(error, RayActorError) and not isinstance(error, RayTaskError):
        return "oom" if oom_evidence else "worker_died"
    if any(s in failure for s in _GAVE_UP):
        return "gave_up"
    if "OutOfMemoryError" in failure or OOM_MESSAGES.search(failure):  # the worker's own test, on text
        return "oom"
    if any(s in failure for s in _WORKER_DIED):
        if _NODE_DIED.search(failure):
            return "node_died"
        return "oom" if oom_evidence else "worker_died"
    return "other"


def gave_up_message(failure: str) -> str:
    """The ``OomRetriesExhausted`` message (reason and event lines) out of a failure's traceback."""
    lines = failure.splitlines()
    start = max(i for i, line in enumerate(lines) if "OomRetriesExhausted:" in line)
    message = [lines[start].split("OomRetriesExhausted:", 1)[1].strip()]
    message += [line for line in lines[start + 1 :] if line.startswith("  epoch ")]
    return "\n".join(message)
