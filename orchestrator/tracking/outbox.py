"""The operations waiting to reach MLflow, in order, and the one thread that sends them: a
round at a time, each run's writes of the round merged into one request
(:mod:`orchestrator.tracking.batching`); an outage is waited out, a write MLflow rejects is
dropped after a few attempts and reported."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from itertools import islice

from orchestrator.tracking.batching import LINGER_S, RunBatch, merged, parts
from orchestrator.tracking.operations import Operation, describe
from orchestrator.tracking.writer import MlflowWriter

logger = logging.getLogger(__name__)

RETRY_FIRST_S, RETRY_MAX_S = 1.0, 10.0
ATTEMPTS_WHEN_REJECTED = 3  # an operation MLflow rejects this often is dropped (and reported)
ROUND = 1000  # the most queued operations one round sends (and the backlog at which it does not linger)
#: HTTP statuses that say nothing about the data: the server is away, overloaded or not letting us in yet.
OUTAGE_STATUSES = frozenset({401, 403, 408, 429})


def is_outage(exc: BaseException) -> bool:
    """Whether a failed MLflow call says the store is unavailable rather than that the data is bad.

    MLflow turns a locked SQLite database into ``TEMPORARILY_UNAVAILABLE``, a connection error or
    a timeout into an ``INTERNAL_ERROR`` (500) wrapping the ``requests`` error, and a server's
    error reply into its HTTP status; a rejected value is a 4xx. Credentials refused (401, 403)
    are not the data's fault either: fixed, the same write goes through.
    """
    from mlflow.exceptions import MlflowException

    if isinstance(exc, MlflowException):
        status = exc.get_http_status_code()
        return status >= 500 or status in OUTAGE_STATUSES
    if isinstance(exc, OSError):  # requests' errors, a full or unreadable disk under a local store
        return True
    return any(type(e).__name__ in ("OperationalError", "TimeoutError") for e in causes(exc))


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, outermost first."""
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


class Outbox:
    """Operations waiting to reach MLflow, in order, and the one thread that sends them."""

    def __init__(self, writer: MlflowWriter, pending: list[Operation]):
        self._writer = writer
        self._ops: deque[Operation] = deque(pending)
        self._cv = threading.Condition()
        self._closing = False
        self._draining = 0  # callers waiting in drain(): nothing lingers meanwhile
        self._offline_since: float | None = None
        self.reached = False  # whether a round ever reached the store
        self._thread = threading.Thread(target=self._run, name="mlflow-outbox", daemon=True)
        self._thread.start()

    def put(self, op: Operation) -> None:
        with self._cv:
            self._ops.append(op)
            self._cv.notify_all()

    def pending(self) -> list[Operation]:
        with self._cv:
            return list(self._ops)

    @property
    def dropped(self) -> list[str]:
        return self._writer.dropped

    def drain(self, timeout: float) -> bool:
        """Wait until everything was sent (or ``timeout`` passed); True if the queue is empty."""
        with self._cv:
            self._draining += 1
            self._cv.notify_all()
            try:
                return self._cv.wait_for(lambda: not self._ops, timeout=timeout)
            finally:
                self._draining -= 1

    def close(self) -> None:
        """Stop the thread once its current request (bounded by the HTTP timeout) returns."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        delay = RETRY_FIRST_S
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._ops or self._closing)
                self._cv.wait_for(lambda: self._closing or self._draining or len(self._ops) >= ROUND, timeout=LINGER_S)
                if self._closing:
                    return
                taken = list(islice(self._ops, ROUND))
            handled: list[Operation] = []
            try:
                self._send(taken, handled)
            except Exception as exc:  # noqa: BLE001 - only an outage gets here (_send)
                self._went_offline(exc)
                self._pause(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                continue
            finally:
                self._remove(handled)
            self.reached = True
            self._came_back()
            delay = RETRY_FIRST_S

    def _send(self, taken: list[Operation], handled: list[Operation]) -> None:
        """Send a round's operations, adding each one sent (or dropped) to ``handled``; an outage
        is raised, and what was not handled is sent again in the next round."""
        for send in merged(taken):
            if self._closing:
                return
            try:
                send.apply(self._writer)
            except Exception as exc:  # noqa: BLE001 - tracking must never take the sweep down
                self._writer.forget()  # what landed is unknown
                if is_outage(exc):
                    raise
                if isinstance(send, RunBatch):  # find the write at fault: each alone
                    for op in send.parts:
                        self._send_alone(op, failures=0)
                        handled.append(op)
                    continue
                self._send_alone(send, failures=1, rejected=exc)
            handled.extend(parts(send))

    def _send_alone(self, op: Operation, failures: int, rejected: Exception | None = None) -> None:
        """Send one operation, dropping it (and saying so) once MLflow has rejected it
        :data:`ATTEMPTS_WHEN_REJECTED` times; an outage is raised."""
        while failures < ATTEMPTS_WHEN_REJECTED:
            if failures:
                self._pause(RETRY_FIRST_S)
            try:
                op.apply(self._writer)
                return
            except Exception as exc:  # noqa: BLE001 - tracking must never take the sweep down
                self._writer.forget()
                if is_outage(exc):
                    raise
                failures, rejected = failures + 1, exc
        logger.warning("MLflow rejected %s %d times, dropping it: %s", describe(op), failures, first_line(rejected))
        self._writer.dropped.append(f"{describe(op)}: {first_line(rejected)}")

    def _remove(self, handled: list[Operation]) -> None:
        """Take the handled operations off the queue (they were its first ones, in another order)."""
        if not handled:
            return
        done = {id(op) for op in handled}
        with self._cv:
            self._ops = deque(op for op in self._ops if id(op) not in done)
            self._cv.notify_all()

    def _pause(self, seconds: float) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._closing, timeout=seconds)

    def _went_offline(self, exc: Exception) -> None:
        if self._offline_since is None:
            self._offline_since = time.monotonic()
            logger.warning(
                "MLflow at %s is unavailable (%s); keeping %d write(s) and retrying",
                self._writer.tracking_uri, first_line(exc), len(self._ops),
            )

    def _came_back(self) -> None:
        if self._offline_since is not None:
            logger.warning(
                "MLflow at %s is reachable again after %.0f s; sending %d buffered write(s)",
                self._writer.tracking_uri, time.monotonic() - self._offline_since, len(self._ops),
            )
            self._offline_since = None
