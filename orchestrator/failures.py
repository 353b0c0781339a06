"""What a failed trial's error says, read in one place for the retry scheduler, the table and MLflow.

Tune keeps a trial's failures in its ``error.txt`` as ``Failure # N`` blocks of traceback text
(the newest also as ``Result.error``). The exception lines in that text are all there is to tell
an OOM from a dead worker from a bug in the user's model.
"""

from __future__ import annotations

import re

from orchestrator.oom import OOM_MESSAGES

_GAVE_UP = ("OomRetriesExhausted",)
_WORKER_DIED = ("RayActorError", "actor died unexpectedly", "ActorDiedError")

#: ``package.module.SomeError: message`` (the module path is dropped when shown)
_EXCEPTION_LINE = re.compile(r"^(?:\w+\.)*(\w+(?:Error|Exception|Exhausted|Refused)\b.*: .*)$")


class NotRetriedError(RuntimeError):
    """A trial's restart that fails at once: its earlier error is one a retry would not fix."""


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
    """The line a person needs from a traceback: the innermost exception and its message."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    raised = [m.group(1) for line in text.splitlines() if (m := _EXCEPTION_LINE.match(line))]
    if raised:
        return raised[-1]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "unknown error"


def classify(failure: str) -> str:
    """``gave_up`` | ``oom`` | ``worker_died`` | ``other``."""
    if any(s in failure for s in _GAVE_UP):
        return "gave_up"
    if "OutOfMemoryError" in failure or OOM_MESSAGES.search(failure):  # the worker's own test, on text
        return "oom"
    if any(s in failure for s in _WORKER_DIED):
        return "worker_died"
    return "other"


def gave_up_message(failure: str) -> str:
    """The ``OomRetriesExhausted`` message (reason and event lines) out of a failure's traceback."""
    lines = failure.splitlines()
    start = max(i for i, line in enumerate(lines) if "OomRetriesExhausted:" in line)
    message = [lines[start].split("OomRetriesExhausted:", 1)[1].strip()]
    message += [line for line in lines[start + 1 :] if line.startswith("  epoch ")]
    return "\n".join(message)
