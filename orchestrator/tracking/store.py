"""Whether MLflow at a tracking URI can be used, said in one line: ``run`` asks before a sweep
starts (:mod:`~orchestrator.tracking.check`) and ``report`` while it reads a sweep back, in the
same words. Imports neither torch nor Ray (``report`` loads it), and MLflow only when asked."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator

from orchestrator.errors import UserError
from orchestrator.tracking.outbox import causes, first_line


#: SQLAlchemy's database drivers, by the module a URI needs, and the package pip installs it from
#: (``postgresql://`` is psycopg 3 for SQLAlchemy 2, ``postgresql+psycopg2://`` psycopg2).
DRIVER_PACKAGES = {"psycopg": "psycopg[binary]", "psycopg2": "psycopg2-binary", "MySQLdb": "mysqlclient",
                   "pymysql": "pymysql", "pyodbc": "pyodbc", "pymssql": "pymssql"}


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
    from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    from mlflow.utils.uri import is_local_uri

    # A local folder is MLflow's file store (./mlruns, file:///...), refused unless its own opt-out is set.
    if isinstance(exc, MlflowException) and is_local_uri(tracking_uri) and not MLFLOW_ALLOW_FILE_STORE.get():
        return (
            f"{tracking_uri} is MLflow's file store, which MLflow 3 refuses (it is in maintenance mode); use a database "
            "store, e.g. sqlite:///mlflow.db (`mlflow migrate-filestore` moves the runs already there into one), "
            "or set MLFLOW_ALLOW_FILE_STORE=true"
        )
    from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException as UnknownScheme

    unknown = next((e for e in causes(exc) if isinstance(e, UnknownScheme)), None)
    if unknown is not None:  # MLflow's words name its model registry, and its list of schemes ran past a first line
        known = [f"{scheme}://" for scheme in unknown.supported_uri_schemes if scheme]
        return (f"{tracking_uri}: MLflow has no tracking store for this URI's scheme; it takes {', '.join(known)} "
                "(e.g. sqlite:///mlflow.db, or http://HOST:5000 for a tracking server)")
    missing = next((e for e in causes(exc) if isinstance(e, ModuleNotFoundError)), None)
    if missing is not None:  # a database's driver
        package = DRIVER_PACKAGES.get(missing.name or "", missing.name)
        also = (" (or write postgresql+psycopg2://..., whose driver `pip install -e '.[postgres]'` installs)"
                if missing.name == "psycopg" else "")
        return (f"MLflow at {tracking_uri} needs the database driver {missing.name!r}, which is not installed here: "
                f"pip install {package!r}{also}")
    return f"MLflow at {tracking_uri} is not usable ({first_line(exc)}); {advice}"


def is_store_error(exc: BaseException) -> bool:
    """An error of the store rather than of the code reading it: MLflow's own, a SQLite file that
    is not a database or is corrupted (SQLAlchemy's, sqlite3's), a server that does not answer, a
    database whose driver is not installed."""
    from mlflow.exceptions import MlflowException

    kinds: tuple[type[BaseException], ...] = (MlflowException, sqlite3.Error, OSError, ModuleNotFoundError)
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


#: Seconds a database server may take to accept a connection before the check gives up.
CONNECT_TIMEOUT_S = 10


def database_answers(tracking_uri: str) -> None:
    """A database store (``postgresql://``, ``mysql://``, ``mssql://``) accepts a connection, or
    the driver's error is raised at once: MLflow itself tries ten times over about 100 s, printing
    a warning of several lines each time, before it says that a server is down. SQLite has no
    server to ask; MLflow's HTTP client gives up at once already (``writer.fail_fast``)."""
    from mlflow.store.db.db_types import DATABASE_ENGINES
    from mlflow.utils.uri import extract_db_type_from_uri

    scheme = tracking_uri.partition("://")[0].partition("+")[0]
    if scheme not in DATABASE_ENGINES or scheme == "sqlite":
        return
    import sqlalchemy

    extract_db_type_from_uri(tracking_uri)  # MLflow's own check of the URI's form
    timeout = {"connect_timeout": CONNECT_TIMEOUT_S} if scheme in ("postgresql", "mysql") else {}
    engine = sqlalchemy.create_engine(tracking_uri, connect_args=timeout)
    try:
        with engine.connect():
            pass
    finally:
        engine.dispose()
