"""``orchestrator report``: what a sweep did, read back from MLflow.

Prints one line per trial (status, epochs trained of the budget, plan, predicted and measured
peak, estimation error, OOM retries, final metric) and a short summary; writes ``report.png`` (predicted vs measured peak
per trial, the budget, the OOM events) and ``results.parquet`` (one row per trial per result);
logs both to the sweep's parent run. Everything comes from MLflow rather than Tune's folders,
so a report can be made wherever the tracking store can be reached, also for a sweep that is
still running or was interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import sqlite3
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from orchestrator.atomic_file import atomic_write
from orchestrator.contract import MEMORY_LABELS, survived_ooms
from orchestrator.errors import UserError
from orchestrator.table import format_table, split_text, trained_text
from orchestrator.tracking.client import mlflow_client
from orchestrator.tracking.artifacts import log_files, read_text
from orchestrator.tracking.reader import READERS, StoredRun, trial_runs
from orchestrator.tracking.runs import (
    EXPERIMENT_PATH_TAG, OOM_GAVE_UP_TAG, ROLE_TAG, STEP_METRIC, STOPPED_EARLY_TAG, SWEEP_ID_TAG, default_tracking_uri,
    sqlite_path,
)
from orchestrator.tracking.store import database_answers, reading
from orchestrator.trial_report import STOPPED_EARLY, TrialReport
from orchestrator.units import apart, binary_unit, human
from orchestrator.writable import check_folder, taken_back_if_refused

#: The report reads many histories: retry a little, but never for minutes against a dead server.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
#: Metrics that are counts or bytes: integers in the Parquet file (MLflow stores every metric as a double).
INT_METRICS = TrialReport.integer_keys() | {STEP_METRIC}
#: The measurements of each result, in this order, in every parquet file; any other metric a
#: workload reports follows, sorted.
METRIC_ORDER = (
    "epoch", "train_loss", "eval_loss", "peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes",
    "fragmentation", "predicted_peak_bytes", "prediction_error", "budget_bytes", "oom_retries",
    "micro_batch", "accum_steps", "effective_batch", "eval_batch", "activation_checkpointing",
    "plan_reductions", "time_total_s",
)
#: Per-trial strings (params or tags) repeated on each of its rows.
TRIAL_COLUMNS = ("estimator", "memory_source", "precision", "gpu_name", "refusal", "diverged", "error", "node_name",
                 "moves")
#: The most trials the summary says why they did not finish; the Parquet file has every trial's reason.
ENDING_LINES = 20


@dataclass(frozen=True)
class TrialRecord:
    """One child run: its identity, what it logged with each result, and its OOM events."""

    name: str
    trial_id: str
    run_id: str
    status: str  # MLflow's: RUNNING, FINISHED, FAILED, KILLED
    params: dict[str, str]
    tags: dict[str, str]
    results: dict[int, dict[str, float]]  # optimizer step -> metric -> value
    oom_events: list[dict]
    duration_s: float | None  # wall time between the run's start and end, if it ended

    @property
    def label(self) -> str:
        """What ``run``'s live view and table call the trial (Tune's trial id, ``a1b2c_00000``);
        its MLflow run name (Tune's ``train_trial_a1b2c_00000``) where the run lacks the tag."""
        return self.trial_id or self.name

    @property
    def shown_status(self) -> str:
        return "REFUSED" if self.tags.get("refusal") else "DIVERGED" if self.tags.get("diverged") else self.status

    def ending(self) -> str | None:
        """Why the trial did not simply finish, in the words of ``run``'s line for it (``refused:
        ...``, ``diverged: ...``, ``failed: <the exception line>``); None for a trial that did. The
        error of a trial a resume then finished is history, not its ending."""
        if self.tags.get("refusal"):
            return f"refused: {self.tags['refusal']}"
        if self.tags.get("diverged"):
            return f"diverged: {self.tags['diverged']}"
        if self.status == "FAILED" and self.tags.get("error"):
            return f"failed: {self.tags['error']}"
        return None

    def latest(self) -> TrialReport:
        """The trial's report as of its last result: each metric's value at the last step that has it."""
        return self._latest

    @property
    def oom_retries(self) -> int:
        """The OOMs the trial survived: as its last result counts them, or as its events do where
        it gave up on them before a result could (the retries an eval at its first epoch made)."""
        return max(self.latest().oom_retries, survived_ooms(self.oom_events))

    def peak(self) -> tuple[float | None, float | None, float | None]:
        """(predicted, measured, error) at the result whose measured peak was highest.

        Measured is what the prediction is compared with (:attr:`TrialReport.measured_peak`, the
        same rule the trainable uses for ``prediction_error``). A refused trial has a prediction
        and no measurement."""
        return self._peak

    # Worked out once: the table, the summary and the plot each ask for them, for thousands of trials.
    @functools.cached_property
    def _latest(self) -> TrialReport:
        merged: dict[str, float] = {}
        for step in sorted(self.results):
            merged.update(self.results[step])
        return TrialReport.from_result(merged)

    @functools.cached_property
    def _peak(self) -> tuple[float | None, float | None, float | None]:
        best: TrialReport | None = None
        for metrics in self.results.values():
            report = TrialReport.from_result(metrics)
            if report.measured_peak is not None and (best is None or report.measured_peak > best.measured_peak):
                best = report
        if best is None:
            return self.latest().predicted_peak_bytes, None, None
        predicted, error = best.predicted_peak_bytes, best.prediction_error
        if error is None and predicted:
            error = (best.measured_peak - predicted) / predicted
        return predicted, best.measured_peak, error

    def gpus(self) -> float:
        try:
            return float(self.params.get("resources.gpu", 0))
        except ValueError:
            return 0.0


@dataclass(frozen=True)
class SweepRecord:
    experiment: str
    name: str
    run_id: str
    metric: str
    trials: list[TrialRecord]
    status: str = "FINISHED"  # the sweep run's: KILLED while a resume can still finish it, RUNNING while it runs
    stop_epochs: int | None = None  # the budget a trial trains to (a trial ASHA stopped trained less)
    stop_steps: int | None = None


#: What the sweep run's status says of the trials a report lists (a trial that never started has no run).
UNFINISHED_SWEEP = {
    "KILLED": "The sweep was interrupted: only the trials that started are listed; `orchestrator run CONFIG --name {name} "
              "--resume`, with the flags it was started with, finishes it",
    "RUNNING": "The sweep is running (or its driver was killed): only the trials that have started are listed",
}


# -- the command ----------------------------------------------------------------------------------


#: What a store that cannot be read (a corrupted ``mlflow.db``, a server that does not answer) asks of the user.
STORE_ADVICE = "pass the sweep's --tracking-uri, or restore its store"
#: What an --out that cannot take the report's files asks of the user.
OUT_ADVICE = "pass --out with a folder you can write"


def report_command(args) -> int:
    tracking_uri = args.tracking_uri or default_tracking_uri()
    out = Path(args.out)
    # --out is tried before MLflow is read (thousands of trials take seconds), and a folder made
    # for a report that is then refused (no such experiment) goes again.
    with taken_back_if_refused(out):
        check_folder(out, "--out", OUT_ADVICE)
        with reading(tracking_uri, STORE_ADVICE):
            sweep = load_sweep(tracking_uri, _sweep_name(args.experiment))
        print(f"Sweep {sweep.name} (experiment {sweep.experiment!r}, MLflow run {sweep.run_id}, {tracking_uri})\n")
        print(trial_table(sweep))
        print()
        print(summary(sweep))
        png, parquet = out / "report.png", out / "results.parquet"
        write_whole({png: lambda f: plot_peaks(sweep, f), parquet: lambda f: write_parquet(sweep, f)})
    with reading(tracking_uri, STORE_ADVICE):
        log_files(mlflow_client(tracking_uri), tracking_uri, sweep.run_id, [png, parquet], "report")
    print(f"\nWrote {png} and {parquet} (also logged to the sweep's run under report/)")
    return 0


def _sweep_name(given: str | None) -> str | None:
    """A sweep's results folder, as ``run``'s ``Results:`` line prints it, names the sweep by its
    last part (the folder's name is the sweep's)."""
    if given and os.sep in given.rstrip(os.sep) and os.path.isdir(given):
        return os.path.basename(os.path.normpath(given))
    return given


def write_whole(files: dict[Path, Callable[[IO[bytes]], None]]) -> None:
    """Every path as its ``write`` makes it, or all as they were: a disk that fills up mid-write
    leaves no cut-off plot or Parquet file beside a whole one from an earlier report, and a file
    that cannot be written leaves none of the others new (a plot of one sweep beside the table of
    another)."""
    path = None
    try:
        with contextlib.ExitStack() as written:  # each file moved into place as the stack unwinds
            for path, write in files.items():
                write(written.enter_context(atomic_write(path, "wb")))
    except OSError as exc:
        path = getattr(exc, "filename2", None) or path  # a move into place names its target
        raise UserError(f"--out: cannot write {path} ({exc.strerror or exc}); {OUT_ADVICE}") from None


# -- reading MLflow -------------------------------------------------------------------------------


def load_sweep(tracking_uri: str, experiment: str | None = None) -> SweepRecord:
    """The newest sweep of ``experiment`` (of any experiment if None), with every trial's history.
    ``experiment`` may also name one sweep (its results folder's name, which ``run`` prints and
    the sweep's MLflow run takes): an older sweep of an experiment is reported that way. A name
    that sweeps of two folders sharing one store both have (started in the same second) is
    refused, listing them; the sweep's MLflow run id names one for certain."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    database = sqlite_path(tracking_uri)
    if database is not None and not database.exists():
        # MLflow would create an empty database here and report "no experiment".
        raise UserError(f"no MLflow database at {database}; pass --tracking-uri (the sweep's tracking URI)")
    if database is not None and not database.is_file():  # MLflow would retry opening it for minutes
        raise UserError(f"{database} is not an MLflow database file; pass --tracking-uri (the sweep's tracking URI)")
    if database is not None and (why_not := _not_an_mlflow_database(database)):
        raise UserError(f"{database} is not an MLflow database ({why_not}); pass --tracking-uri (the sweep's tracking URI)")
    database_answers(tracking_uri)
    client = mlflow_client(tracking_uri)
    experiments = client.search_experiments()
    sweep_filter = f"tags.`{ROLE_TAG}` = 'sweep'"
    named = [e for e in experiments if e.name == experiment]
    if named:
        experiments = named
    elif experiment is not None and "'" not in experiment:  # a sweep's name (MLflow's filter has no escape for a quote)
        sweep_filter += f" and tags.`mlflow.runName` = '{experiment}'"
    elif experiment is not None:
        experiments = []
    by_name = experiment is not None and not named  # a sweep's name: told apart from another sweep's of that name
    parents = client.search_runs(
        [e.experiment_id for e in experiments], sweep_filter, order_by=["attributes.start_time DESC"],
        max_results=AMBIGUOUS_LISTED if by_name else 1,
    ) if experiments else []
    if len(parents) > 1:
        raise UserError(f"{len(parents)}{'+' if len(parents) == AMBIGUOUS_LISTED else ''} sweeps at {tracking_uri} are "
                        f"named {experiment!r}: " + "; ".join(_sweep_text(p) for p in parents)
                        + "; name one by its MLflow run id (orchestrator report RUN_ID)")
    if not parents and by_name and RUN_ID.fullmatch(experiment):
        parents = _sweep_of_run(client, experiment)
    if not parents and experiment is not None and not named:
        raise UserError(f"no MLflow experiment or sweep named {experiment!r} at {tracking_uri}; experiments with "
                        f"sweeps there: {_sweep_experiments(client)}")
    if not parents:
        where = f"experiment {experiment!r}" if experiment else tracking_uri
        raise UserError(f"no orchestrator sweep in {where}; sweeps there: {_sweep_experiments(client)}")
    parent = parents[0]
    # Every trial's params, tags and metric histories, in a few requests (not one per metric per run).
    runs = trial_runs(client, parent.info.experiment_id, parent.data.tags[SWEEP_ID_TAG])
    # A trial that ran out of memory also has its events to download: a request each, several at a time.
    with ThreadPoolExecutor(READERS, thread_name_prefix="mlflow-artifacts") as pool:
        trials = sorted(pool.map(lambda run: _trial_record(client, tracking_uri, run), runs), key=lambda t: t.name)
    return SweepRecord(
        experiment=client.get_experiment(parent.info.experiment_id).name,
        name=parent.info.run_name,
        run_id=parent.info.run_id,
        metric=parent.data.params.get("metric", "eval_loss"),
        trials=trials,
        status=parent.info.status,
        stop_epochs=_count(parent.data.params.get("stop.epochs")),
        stop_steps=_count(parent.data.params.get("stop.steps")),
    )


def _count(param: str | None) -> int | None:
    """A budget as the sweep's run has it as a param (``3``, or ``None`` where none was set)."""
    return int(param) if param is not None and param.isdigit() else None


#: How many sweeps of one name a refusal lists.
AMBIGUOUS_LISTED = 10
#: An MLflow run id, which ``report`` takes for the sweep whose run it is.
RUN_ID = re.compile(r"[0-9a-f]{32}")


def _sweep_text(run) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.info.start_time / 1000))
    return f"run {run.info.run_id} (started {started}, results {run.data.tags.get(EXPERIMENT_PATH_TAG, '-')})"


def _sweep_of_run(client, run_id: str) -> list:
    """The sweep whose MLflow run ``run_id`` is (none where no run, or not a sweep's, has it)."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        return []
    return [run] if run.data.tags.get(ROLE_TAG) == "sweep" else []


#: A table every MLflow database has (its experiments): a SQLite file without it holds no store.
MLFLOW_TABLE = "experiments"


def _not_an_mlflow_database(database: Path) -> str | None:
    """Why the SQLite file ``database`` holds no MLflow store, or None where it may hold one.

    MLflow opening an empty file (a ``touch``, a copy cut off at once) or another program's SQLite
    database makes its tables there, and only then finds no sweep: a report must write nothing, so
    this looks first, read-only. A file SQLite cannot read at all (not SQLite, damaged, locked) is
    left to MLflow, whose error :func:`~orchestrator.tracking.store.reading` says in one line."""
    if database.stat().st_size == 0:
        return "an empty file"
    try:
        with contextlib.closing(sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True)) as db:
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError:
        return None
    return None if MLFLOW_TABLE in tables else "a SQLite database without MLflow's tables"


def _sweep_experiments(client) -> str:
    names = sorted({
        client.get_experiment(run.info.experiment_id).name
        for run in client.search_runs([e.experiment_id for e in client.search_experiments()] or ["0"],
                                      f"tags.`{ROLE_TAG}` = 'sweep'", max_results=200)
    })
    return ", ".join(names) or "none"


def _trial_record(client, tracking_uri: str, run: StoredRun) -> TrialRecord:
    duration = (run.end_time - run.start_time) / 1000 if run.end_time and run.start_time else None
    trial = TrialRecord(
        name=run.name, trial_id=run.tags.get("trial_id", ""), run_id=run.run_id, status=run.status,
        params=run.params, tags=run.tags, results=run.history, oom_events=[], duration_s=duration,
    )
    if trial.latest().oom_retries <= 0 and not trial.tags.get(OOM_GAVE_UP_TAG):
        return trial
    try:
        events = json.loads(read_text(client, tracking_uri, run.run_id, "oom_events.json"))
    except Exception:  # noqa: BLE001 - the count is still in the metrics
        return trial
    return dataclasses.replace(trial, oom_events=events)


# -- the table and the summary ------------------------------------------------------------------


def plan_text(trial: TrialRecord) -> str:
    """``16 x 4, eval 64, ckpt, bf16``: micro-batch x accumulation, eval batch, checkpointing, precision
    (a refused trial's: the plan its predicted peak, in the next column, is of)."""
    latest = trial.latest()

    def value(key: str, number: int | None) -> str | None:
        if f"plan.{key}" in trial.params:
            return trial.params[f"plan.{key}"]
        return None if number is None else str(int(number))

    micro = value("micro_batch", latest.micro_batch)
    accum, eval_batch = value("accum_steps", latest.accum_steps), value("eval_batch", latest.eval_batch)
    if micro is None:
        return "-"
    effective = value("effective_batch", latest.effective_batch)
    ranks = int(value("ranks", latest.ranks) or 1)
    parts = [split_text(int(micro), int(accum), int(effective) if effective else None, ranks), f"eval {eval_batch}"]
    checkpointing = trial.params.get("plan.activation_checkpointing") or str(int(latest.activation_checkpointing or 0))
    if checkpointing in ("True", "1"):
        parts.append("ckpt")
    precision = trial.params.get("plan.precision") or trial.tags.get("precision")
    if precision:
        parts.append(precision)
    return ", ".join(parts)


def _a_value(number: float | None) -> bool:
    """Whether a metric read from MLflow is a number to show: MLflow keeps a NaN as is and an
    infinity (a diverged trial's worst value) as the largest double."""
    return number is not None and math.isfinite(number) and abs(number) < sys.float_info.max


def trial_table(sweep: SweepRecord) -> str:
    rows = []
    for trial in sweep.trials:
        predicted, measured, error = trial.peak()
        latest = trial.latest()
        final = latest.metric(sweep.metric)
        trained = trained_text(latest.epoch or 0, latest.step or 0, sweep.stop_epochs, sweep.stop_steps)
        rows.append((
            trial.label, trial.shown_status, trained, plan_text(trial),
            human(predicted) if predicted else "-", human(measured) if measured is not None else "-",
            f"{error:+.1%}" if error is not None else "-",
            trial.oom_retries,
            f"{final:.4f}" if _a_value(final) else "-",
        ))
    headers = ["trial", "status", "trained", "plan", "predicted peak", "measured peak", "estimate error", "OOM retries",
               sweep.metric]
    nodes = [t.tags.get("node_name", "-") for t in sweep.trials]
    if len(set(nodes) - {"-"}) > 1:  # a cluster of several nodes: where each trial ran (last)
        headers.insert(1, "node")
        rows = [(row[0], node, *row[1:]) for row, node in zip(rows, nodes)]
    return format_table(headers, rows)


def summary(sweep: SweepRecord) -> str:
    counts: dict[str, int] = {}
    for trial in sweep.trials:
        counts[trial.shown_status.lower()] = counts.get(trial.shown_status.lower(), 0) + 1
    finished = [t for t in sweep.trials if t.shown_status == "FINISHED"]  # as the line above counts them
    survived = sum(t.oom_retries for t in finished)
    with_ooms = sum(1 for t in finished if t.oom_retries > 0)
    stopped = sum(STOPPED_EARLY_TAG in t.tags for t in finished)
    of_them = f"; {stopped} {STOPPED_EARLY}" if stopped else ""
    lines = [
        f"Trials: {len(sweep.trials)} ({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}{of_them})",
        f"OOMs survived: {survived} (in {with_ooms} of {len(finished)} finished trials)",
    ]
    if sweep.status in UNFINISHED_SWEEP:
        lines.insert(1, UNFINISHED_SWEEP[sweep.status].format(name=sweep.name))
    errors = [(t, *t.peak()) for t in sweep.trials if t.peak()[2] is not None]
    if errors:
        trial, predicted, measured, error = max(errors, key=lambda e: abs(e[3]))
        side = "above" if error > 0 else "below" if error < 0 else "as"
        measured_text, predicted_text = apart(int(measured), int(predicted))
        lines.append(
            f"Worst estimation error: {error:+.1%} "
            f"({trial.label}: measured {measured_text} {side} predicted {predicted_text})"
        )
    else:
        lines.append("Worst estimation error: - (no trial has both a prediction and a measurement)")
    gpu_hours = sum(t.gpus() * (t.latest().time_total_s or t.duration_s or 0) for t in sweep.trials) / 3600
    note = "" if any(t.gpus() for t in sweep.trials) else " (no trial had a GPU)"
    lines.append(f"GPU hours: {gpu_hours:.3f}{note}")
    # The sweep's lines above, then each trial that did not finish and why, and each that moved.
    endings = [f"{trial.label} {why}" for trial in sweep.trials if (why := trial.ending())]
    lines += endings[:ENDING_LINES]
    if len(endings) > ENDING_LINES:
        lines.append(f"... and {len(endings) - ENDING_LINES} more trials that did not finish "
                     "(results.parquet's refusal, diverged and error columns have every trial's)")
    for trial in sweep.trials:
        if trial.tags.get("moves"):
            lines.append(f"{trial.label}: {trial.tags['moves']}")
    return "\n".join(lines)


# -- the Parquet file -----------------------------------------------------------------------------


def result_rows(sweep: SweepRecord) -> list[dict[str, Any]]:
    """One row per trial per result (a trial that logged none still gets one row)."""
    rows = []
    for trial in sweep.trials:
        base = {
            "experiment": sweep.experiment, "sweep": sweep.name, "sweep_run_id": sweep.run_id,
            "trial": trial.name, "trial_id": trial.trial_id, "run_id": trial.run_id,
            "status": trial.shown_status, "workload": trial.tags.get("workload"),
        }
        base.update({key: _typed(value) for key, value in sorted(trial.params.items()) if key.startswith("config.")})
        base.update({key: trial.params.get(key) or trial.tags.get(key) for key in TRIAL_COLUMNS})
        for step in sorted(trial.results) or [None]:
            rows.append({**base, **trial.results.get(step, {}), STEP_METRIC: step})
    return rows


def write_parquet(sweep: SweepRecord, path: Path | IO[bytes]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = result_rows(sweep)
    identity = ["experiment", "sweep", "sweep_run_id", "trial", "trial_id", "run_id", "status", "workload"]
    keys = {key for row in rows for key in row}
    config = sorted(k for k in keys if k.startswith("config."))
    # The orchestrator's own columns are in every file, empty where a sweep had nothing to put
    # there (no estimate with `estimator: none`, no device reading): files of two sweeps concatenate.
    metrics = list(METRIC_ORDER)
    metrics += sorted(keys - set(identity) - set(config) - set(metrics) - set(TRIAL_COLUMNS) - {STEP_METRIC})
    columns = identity + config + [STEP_METRIC] + metrics + list(TRIAL_COLUMNS)
    arrays = {}
    for column in columns:
        values = [row.get(column) for row in rows]
        if column in INT_METRICS:
            values = [None if v is None or not math.isfinite(v) else int(v) for v in values]
        kind = _arrow_type(column, values)
        if kind == pa.string():
            values = [None if v is None else str(v) for v in values]
        arrays[column] = pa.array(values, type=kind)
    pq.write_table(pa.table(arrays), path)


def _typed(text: str) -> Any:
    """A hyper-parameter as MLflow stored it (text) -> the number it was, where it was one."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else text


def _arrow_type(column: str, values: list):
    """int64 for counts and bytes, float64 for other numbers, else text."""
    import pyarrow as pa

    present = [v for v in values if v is not None]
    if column in INT_METRICS or (present and all(isinstance(v, int) for v in present)):
        return pa.int64()
    if present and all(isinstance(v, (int, float)) for v in present):
        return pa.float64()
    return pa.string() if present or column in TRIAL_COLUMNS else pa.float64()


# -- the plot -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeakBar:
    """One trial's row of the plot, in the chart's unit."""

    label: str  # the trial's searched hyper-parameters, short: ``width=64 lr=3.2e-3``
    predicted: float | None
    measured: float | None
    note: str  # the measured peak and the estimation error (``1.8 MiB, +5.0%``), ``refused``, or nothing
    ooms: tuple[float, ...]  # each OOM event's bytes in use + requested
    budget: float | None


@dataclass(frozen=True)
class PeakChart:
    """What ``report.png`` shows, apart from how matplotlib draws it."""

    title: str
    unit: str  # B, KiB, MiB or GiB: the largest value of the chart reaches it
    bars: tuple[PeakBar, ...]
    budget: float | None  # the budget shared by every trial; per-trial budgets are on the bars
    measured_label: str


def short_value(text: str) -> str:
    """A hyper-parameter for a label: ``0.0031622776601683794`` -> ``3.2e-3``, ``64`` -> ``64``."""
    value = _typed(text)
    if not isinstance(value, float):
        return str(value)
    if value == 0 or 1e-2 <= abs(value) < 1e4:
        return f"{value:.3g}"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


def config_labels(trials: list[TrialRecord]) -> list[str]:
    """Each trial's hyper-parameters that differ between the trials (``workload`` first), short;
    trials with the same ones also get their name, and a lone trial is named by its name."""
    configs = [{k.removeprefix("config."): v for k, v in t.params.items() if k.startswith("config.")} for t in trials]
    varying = sorted({k for c in configs for k in c if len({d.get(k) for d in configs}) > 1},
                     key=lambda k: (k != "workload", k))
    labels = [" ".join(f"{k}={short_value(c[k])}" for k in varying if k in c) for c in configs]
    return [label if labels.count(label) == 1 and label else f"{label} ({t.label})" if label else t.label
            for label, t in zip(labels, trials)]


def bar_note(measured: float | None, error: float | None) -> str:
    """Beside a trial's bars, so that a bar too short to see next to the longest still reads."""
    if measured is None:
        return ""
    return human(measured) + (f", {error:+.1%}" if error is not None else "")


def peak_chart(sweep: SweepRecord) -> PeakChart:
    """Predicted vs measured peak per trial, the budget and the OOM events, scaled to one unit."""
    trials = sweep.trials
    peaks = [t.peak() for t in trials]
    ooms = [[(e.get("bytes_allocated") or 0) + (e.get("bytes_requested") or 0) for e in t.oom_events] for t in trials]
    budgets = {t.name: float(t.params["budget_bytes"]) for t in trials if t.params.get("budget_bytes")}
    largest = max([v for p, m, _ in peaks for v in (p, m) if v] + [n for need in ooms for n in need]
                  + list(budgets.values()) + [0])
    unit, size = binary_unit(largest)
    shared = next(iter(budgets.values())) if len(set(budgets.values())) == 1 else None

    def scaled(n: float | None) -> float | None:
        return None if n is None else n / size

    bars = []
    for trial, label, (predicted, measured, error), needs in zip(trials, config_labels(trials), peaks, ooms):
        note = "refused" if trial.shown_status == "REFUSED" else bar_note(measured, error)
        bars.append(PeakBar(label, scaled(predicted or None), scaled(measured), note,
                            tuple(n / size for n in needs if n),
                            None if shared is not None else scaled(budgets.get(trial.name))))
    sources = sorted({t.params.get("memory_source") or t.tags.get("memory_source", "") for t in trials} - {""})
    measured_label = "measured peak" + (f" ({', '.join(MEMORY_LABELS.get(s, s) for s in sources)})" if sources else "")
    title = f"{sweep.name}: predicted vs measured peak memory per trial"
    notes = [] if budgets else ["no memory budget: the device was unbounded"]
    if not any(p for p, _, _ in peaks):
        notes.append("no predicted peaks: the plans had no estimate")
    if notes:
        title += f"\n({'; '.join(notes)})"
    return PeakChart(title, unit, tuple(bars), scaled(shared), measured_label)


#: Up to this many trials the plot is a labelled pair of bars per trial; above, a point per trial.
#: 2,048 pairs of bars are a PNG 80,000 pixels tall that no one reads, and drawing them took
#: longer than the whole rest of a report (``bench/report_scale.py``).
MAX_BARS = 200


def plot_peaks(sweep: SweepRecord, path: Path | IO[bytes]) -> None:
    """Draws :func:`peak_chart`: a pair of bars per trial, or for more than :data:`MAX_BARS`
    trials a point per trial (its measured peak over its predicted one)."""
    import matplotlib

    matplotlib.use("Agg")
    chart = peak_chart(sweep)
    if len(chart.bars) > MAX_BARS:
        _plot_points(chart, path)
    else:
        _plot_bars(chart, path)


def _plot_bars(chart: PeakChart, path: Path | IO[bytes]) -> None:
    """A horizontal pair of bars per trial, so that each trial's label reads level however many
    trials there are (the figure grows in height with them)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    count = len(chart.bars)
    fig, ax = plt.subplots(figsize=(11.0, max(5.5, 0.34 * count + 2.5)), layout="constrained")
    height = 0.4
    tops = [0.0]
    legend: dict[str, object] = {}
    for i, bar in enumerate(chart.bars):
        if bar.predicted:
            legend["predicted peak (plan)"] = ax.barh(i - height / 2, bar.predicted, height, color="#9ecae1",
                                                      edgecolor="#3182bd", hatch="//")
        if bar.measured is not None:
            legend[chart.measured_label] = ax.barh(i + height / 2, bar.measured, height, color="#3182bd")
        top = max(bar.predicted or 0, bar.measured or 0)
        if bar.note:
            ax.annotate(bar.note, (top, i), textcoords="offset points", xytext=(4, 0), va="center", fontsize=8,
                        color="#b30000" if bar.note == "refused" else "black")
        if bar.ooms:
            legend["OOM event (in use + requested)"] = ax.scatter(
                bar.ooms, [i + height / 2] * len(bar.ooms), marker="X", s=70, color="#d62728", zorder=5)
        if bar.budget is not None:
            legend["budget per trial"] = ax.vlines(bar.budget, i - 0.45, i + 0.45, colors="#d62728", linestyles="--")
        tops.extend([top, *bar.ooms, bar.budget or 0])
    if chart.budget is not None:
        legend[f"budget {chart.budget:.3g} {chart.unit}"] = ax.axvline(
            chart.budget, color="#d62728", linestyle="--", linewidth=1.5)
        tops.append(chart.budget)
    ax.set_title(chart.title, fontsize=11)
    ax.set_xlabel(f"peak memory ({chart.unit})")
    ax.set_xlim(0, max(tops) * 1.15 or 1)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.4g}"))
    ax.set_yticks(range(count), [bar.label for bar in chart.bars], fontsize=8)
    ax.set_ylim(count - 0.5, -0.5)  # the first trial on top, as in the table
    ax.grid(axis="x", alpha=0.3)
    fig.legend(legend.values(), legend.keys(), loc="outside lower center", ncols=min(4, len(legend) or 1), fontsize=8)
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def _plot_points(chart: PeakChart, path: Path | IO[bytes]) -> None:
    """A point per trial at (predicted, measured), on a figure of fixed size: the diagonal is a
    perfect estimate, points above it trials that needed more than planned. A trial without a
    prediction sits on the left edge, one without a measurement (refused) on the bottom edge."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    bars = chart.bars
    fig, ax = plt.subplots(figsize=(11.0, 8.0), layout="constrained")
    legend: dict[str, object] = {}

    def points(label: str, chosen: list[tuple[float, float]], **style) -> None:
        if chosen:
            legend[label] = ax.scatter([x for x, _ in chosen], [y for _, y in chosen], **style)

    points(f"trial: {chart.measured_label} over predicted peak",
           [(b.predicted, b.measured) for b in bars if b.predicted and b.measured is not None],
           s=14, color="#3182bd", alpha=0.6, linewidths=0)
    points("trial without a prediction", [(0.0, b.measured) for b in bars if not b.predicted and b.measured is not None],
           s=14, marker=">", color="#3182bd", alpha=0.6, linewidths=0)
    points("refused (no measurement)", [(b.predicted, 0.0) for b in bars if b.predicted and b.measured is None],
           s=22, marker="v", color="#b30000")
    points("OOM event (in use + requested)", [(b.predicted or 0.0, need) for b in bars for need in b.ooms],
           s=40, marker="X", color="#d62728")
    points("budget per trial", [(b.predicted or 0.0, b.budget) for b in bars if b.budget is not None],
           s=60, marker="_", color="#d62728")
    top = max([v for b in bars for v in (b.predicted, b.measured, b.budget, *b.ooms) if v] + [chart.budget or 0, 0.0])
    top = top * 1.1 or 1.0
    legend["measured = predicted"] = ax.plot([0, top], [0, top], color="grey", linewidth=1, linestyle=":")[0]
    if chart.budget is not None:
        legend[f"budget {chart.budget:.3g} {chart.unit}"] = ax.axhline(chart.budget, color="#d62728", linestyle="--")
        ax.axvline(chart.budget, color="#d62728", linestyle="--", linewidth=0.8)
    ax.set_title(f"{chart.title} ({len(bars)} trials)", fontsize=11)
    ax.set_xlabel(f"predicted peak ({chart.unit})")
    ax.set_ylabel(f"{chart.measured_label} ({chart.unit})")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    formatter = FuncFormatter(lambda v, _: f"{v:.4g}")
    ax.xaxis.set_major_formatter(formatter)
    ax.yaxis.set_major_formatter(formatter)
    ax.grid(alpha=0.3)
    fig.legend(legend.values(), legend.keys(), loc="outside lower center", ncols=min(3, len(legend)), fontsize=8)
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
