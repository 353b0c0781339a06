"""Whether MLflow at a tracking URI can be used, said in one line: ``run`` asks before a sweep
starts (:mod:`~orchestrator.tracking.check`) and ``report`` while it reads a sweep back, in the
same words. Imports neither torch nor Ray (``report`` loads it), and MLflow only when asked."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator

from orchestrator.errors import UserError
from orchestrator.tracking.outbox import first_line


def unusable(tracking_uri: str, exc: BaseException, advice: str) -> str:
    """Why MLflow at ``tracking_uri`` failed with ``exc``, then ``advice``; refused credentials
    say instead which variables carry them (the advice is then beside the point)."""
    from mlflow.exceptions import MlflowException

    status = exc.get_http_status_code() if isinstance(exc, MlflowException) else None
    if status in (401, 403):
        return (
            f"MLflow at {tracking_uri} refused our credentials (HTTP {status}); set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)"
        )
    return f"MLflow at {tracking_uri} is not usable ({first_line(exc)}); {advice}"


def is_store_error(exc: BaseException) -> bool:
    """An error of the store rather than of the code reading it: MLflow's own, a SQLite file that
    is not a database or is corrupted (SQLAlchemy's, sqlite3's), a server that does not answer."""
    from mlflow.exceptions import MlflowException

    kinds: tuple[type[BaseException], ...] = (MlflowException, sqlite3.Error, OSError)
    try:
        from sqlalchemy.exc import SQLAlchemyError
    except ImportError:  # a server-only MLflow client (mlflow-skinny) has no SQL store
        pass
    else:
        kinds += (SQLAlchemyError,)
    return isinstance(exc, kinds)


@contextlib.contextmanager
def reading(tracking_uri: str, advice: str) -> Iterator[None]:
    """The store's errors inside become one line (:func:`unusable`) and exit 2: a corrupted
    ``mlflow.db`` is the user's to fix, not a SQLAlchemy traceback."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        if not is_store_error(exc):
            raise
        raise UserError(unusable(tracking_uri, exc, advice)) from None
