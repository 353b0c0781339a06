"""``orchestrator report``: what a sweep did, read back from MLflow.

Prints one line per trial (status, plan, predicted and measured peak, estimation error, OOM
retries, final metric) and a short summary; writes ``report.png`` (predicted vs measured peak
per trial, the budget, the OOM events) and ``results.parquet`` (one row per trial per result);
logs both to the sweep's parent run. Everything comes from MLflow rather than Tune's folders,
so a report can be made wherever the tracking store can be reached, also for a sweep that is
still running or was interrupted.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.contract import MEMORY_LABELS
from orchestrator.errors import UserError
from orchestrator.table import format_table
from orchestrator.tracking import ROLE_TAG, STEP_METRIC, SWEEP_ID_TAG, sqlite_path
from orchestrator.units import GiB, human

#: The report reads many histories: retry a little, but never for minutes against a dead server.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
#: Metrics that are counts or bytes: integers in the Parquet file (MLflow stores every metric as a double).
INT_METRICS = frozenset({
    STEP_METRIC, "epoch", "micro_batch", "accum_steps", "effective_batch", "eval_batch", "activation_checkpointing",
    "plan_reductions", "oom_retries", "peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes",
    "predicted_peak_bytes", "budget_bytes", "gpu_total_bytes",
})
#: Column order of the measurements of each result; any other metric a workload reports follows, sorted.
METRIC_ORDER = (
    "epoch", "train_loss", "eval_loss", "peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes",
    "fragmentation", "predicted_peak_bytes", "prediction_error", "budget_bytes", "oom_retries",
    "micro_batch", "accum_steps", "effective_batch", "eval_batch", "activation_checkpointing",
    "plan_reductions", "time_total_s",
)
#: Per-trial strings (params or tags) repeated on each of its rows.
TRIAL_COLUMNS = ("estimator", "memory_source", "precision", "gpu_name", "refusal", "error", "node_name", "moves")


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
    def shown_status(self) -> str:
        return "REFUSED" if self.tags.get("refusal") else self.status

    def last(self, key: str) -> float | None:
        for step in sorted(self.results, reverse=True):
            if key in self.results[step]:
                return self.results[step][key]
        return None

    def peak(self) -> tuple[float | None, float | None, float | None]:
        """(predicted, measured, error) at the result whose measured peak was highest.

        Measured is what the prediction is compared with: reserved bytes on a GPU (the plan
        budgets reserved memory), tensor bytes elsewhere - the same rule the trainable uses for
        ``prediction_error``. A refused trial has a prediction and no measurement."""
        best: dict[str, float] | None = None
        for metrics in self.results.values():
            measured = metrics.get("peak_reserved_bytes", metrics.get("peak_allocated_bytes"))
            if measured is not None and (best is None or measured > best["measured"]):
                best = {**metrics, "measured": measured}
        if best is None:
            return self.last("predicted_peak_bytes"), None, None
        predicted = best.get("predicted_peak_bytes")
        error = best.get("prediction_error")
        if error is None and predicted:
            error = (best["measured"] - predicted) / predicted
        return predicted, best["measured"], error

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


# -- the command ----------------------------------------------------------------------------------


def report_command(args) -> int:
    tracking_uri = args.tracking_uri or f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    sweep = load_sweep(tracking_uri, args.experiment)
    print(f"Sweep {sweep.name} (experiment {sweep.experiment!r}, MLflow run {sweep.run_id}, {tracking_uri})\n")
    print(trial_table(sweep))
    print()
    print(summary(sweep))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png, parquet = out / "report.png", out / "results.parquet"
    plot_peaks(sweep, png)
    write_parquet(sweep, parquet)
    _client(tracking_uri).log_artifact(sweep.run_id, str(png), "report")
    _client(tracking_uri).log_artifact(sweep.run_id, str(parquet), "report")
    print(f"\nWrote {png} and {parquet} (also logged to the sweep's run under report/)")
    return 0


# -- reading MLflow -------------------------------------------------------------------------------


def _client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri)


def load_sweep(tracking_uri: str, experiment: str | None = None) -> SweepRecord:
    """The newest sweep of ``experiment`` (of any experiment if None), with every trial's history."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    database = sqlite_path(tracking_uri)
    if database is not None and not database.exists():
        # MLflow would create an empty database here and report "no experiment".
        raise UserError(f"no MLflow database at {database}; pass --tracking-uri (the sweep's tracking URI)")
    client = _client(tracking_uri)
    try:
        experiments = client.search_experiments()
    except Exception as exc:
        raise UserError(f"cannot read MLflow at {tracking_uri}: {str(exc).splitlines()[0][:300]}") from None
    if experiment is not None:
        experiments = [e for e in experiments if e.name == experiment]
        if not experiments:
            raise UserError(f"no MLflow experiment {experiment!r} at {tracking_uri}; sweeps there: {_sweep_experiments(client)}")
    sweep_filter = f"tags.`{ROLE_TAG}` = 'sweep'"
    parents = client.search_runs(
        [e.experiment_id for e in experiments], sweep_filter, order_by=["attributes.start_time DESC"], max_results=1,
    ) if experiments else []
    if not parents:
        where = f"experiment {experiment!r}" if experiment else tracking_uri
        raise UserError(f"no orchestrator sweep in {where}; sweeps there: {_sweep_experiments(client)}")
    parent = parents[0]
    trial_filter = f"tags.`{SWEEP_ID_TAG}` = '{parent.data.tags[SWEEP_ID_TAG]}' and tags.`{ROLE_TAG}` = 'trial'"
    runs = _all_runs(client, parent.info.experiment_id, trial_filter)
    trials = sorted((_trial_record(client, run) for run in runs), key=lambda t: t.name)
    return SweepRecord(
        experiment=client.get_experiment(parent.info.experiment_id).name,
        name=parent.info.run_name,
        run_id=parent.info.run_id,
        metric=parent.data.params.get("metric", "eval_loss"),
        trials=trials,
    )


def _sweep_experiments(client) -> str:
    names = sorted({
        client.get_experiment(run.info.experiment_id).name
        for run in client.search_runs([e.experiment_id for e in client.search_experiments()] or ["0"],
                                      f"tags.`{ROLE_TAG}` = 'sweep'", max_results=200)
    })
    return ", ".join(names) or "none"


def _all_runs(client, experiment_id: str, filter_string: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string, max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _trial_record(client, run) -> TrialRecord:
    results: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for point in client.get_metric_history(run.info.run_id, key):
            results.setdefault(int(point.step), {})[key] = point.value
    events: list[dict] = []
    if run.data.metrics.get("oom_retries", 0) > 0:
        try:
            events = json.loads(Path(client.download_artifacts(run.info.run_id, "oom_events.json")).read_text())
        except Exception:  # noqa: BLE001 - the count is still in the metrics
            events = []
    info = run.info
    duration = (info.end_time - info.start_time) / 1000 if info.end_time and info.start_time else None
    return TrialRecord(
        name=info.run_name, trial_id=run.data.tags.get("trial_id", ""), run_id=info.run_id, status=info.status,
        params=dict(run.data.params), tags=dict(run.data.tags), results=results, oom_events=events, duration_s=duration,
    )


# -- the table and the summary ------------------------------------------------------------------


def plan_text(trial: TrialRecord) -> str:
    """``16x4, eval 64, ckpt, bf16``: micro-batch x accumulation, eval batch, checkpointing, precision."""
    def value(key: str) -> str | None:
        if f"plan.{key}" in trial.params:
            return trial.params[f"plan.{key}"]
        number = trial.last(key)
        return None if number is None else str(int(number))

    micro, accum, eval_batch = value("micro_batch"), value("accum_steps"), value("eval_batch")
    if micro is None:
        return "-"
    parts = [f"{micro}x{accum}", f"eval {eval_batch}"]
    checkpointing = trial.params.get("plan.activation_checkpointing") or str(int(trial.last("activation_checkpointing") or 0))
    if checkpointing in ("True", "1"):
        parts.append("ckpt")
    precision = trial.params.get("plan.precision") or trial.tags.get("precision")
    if precision:
        parts.append(precision)
    return ", ".join(parts)


def trial_table(sweep: SweepRecord) -> str:
    rows = []
    for trial in sweep.trials:
        predicted, measured, error = trial.peak()
        final = trial.last(sweep.metric)
        rows.append((
            trial.name, trial.shown_status, plan_text(trial),
            human(predicted) if predicted else "-", human(measured) if measured is not None else "-",
            f"{error:+.1%}" if error is not None else "-",
            int(trial.last("oom_retries") or 0),
            f"{final:.4f}" if final is not None and math.isfinite(final) else "-",
        ))
    headers = ["trial", "status", "plan", "predicted peak", "measured peak", "error", "OOM retries", sweep.metric]
    nodes = [t.tags.get("node_name", "-") for t in sweep.trials]
    if len(set(nodes) - {"-"}) > 1:  # a cluster of several nodes: where each trial ran (last)
        headers.insert(1, "node")
        rows = [(row[0], node, *row[1:]) for row, node in zip(rows, nodes)]
    return format_table(headers, rows)


def summary(sweep: SweepRecord) -> str:
    counts: dict[str, int] = {}
    for trial in sweep.trials:
        counts[trial.shown_status.lower()] = counts.get(trial.shown_status.lower(), 0) + 1
    finished = [t for t in sweep.trials if t.status == "FINISHED"]
    survived = sum(int(t.last("oom_retries") or 0) for t in finished)
    with_ooms = sum(1 for t in finished if (t.last("oom_retries") or 0) > 0)
    lines = [
        f"Trials: {len(sweep.trials)} ({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))})",
        f"OOMs survived: {survived} (in {with_ooms} of {len(finished)} finished trials)",
    ]
    errors = [(t, *t.peak()) for t in sweep.trials if t.peak()[2] is not None]
    if errors:
        trial, predicted, measured, error = max(errors, key=lambda e: abs(e[3]))
        side = "above" if error > 0 else "below"
        lines.append(
            f"Worst estimation error: {error:+.1%} "
            f"({trial.name}: measured {human(measured)} {side} predicted {human(predicted)})"
        )
    else:
        lines.append("Worst estimation error: - (no trial has both a prediction and a measurement)")
    for trial in sweep.trials:
        if trial.tags.get("moves"):
            lines.append(f"{trial.name}: {trial.tags['moves']}")
    gpu_hours = sum(t.gpus() * (t.last("time_total_s") or t.duration_s or 0) for t in sweep.trials) / 3600
    note = "" if any(t.gpus() for t in sweep.trials) else " (no trial had a GPU)"
    lines.append(f"GPU hours: {gpu_hours:.3f}{note}")
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


def write_parquet(sweep: SweepRecord, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = result_rows(sweep)
    identity = ["experiment", "sweep", "sweep_run_id", "trial", "trial_id", "run_id", "status", "workload"]
    keys = {key for row in rows for key in row}
    config = sorted(k for k in keys if k.startswith("config."))
    metrics = [k for k in METRIC_ORDER if k in keys]
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


def plot_peaks(sweep: SweepRecord, path: Path) -> None:
    """Predicted vs measured peak per trial (GiB), the memory budget, and each OOM event."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    trials = sweep.trials
    fig, ax = plt.subplots(figsize=(max(9.0, 1.1 * len(trials) + 5.0), 5.5))
    width = 0.38
    tops = [0.0]
    sources = sorted({t.params.get("memory_source") or t.tags.get("memory_source", "") for t in trials} - {""})
    measured_label = "measured peak" + (f" ({', '.join(MEMORY_LABELS.get(s, s) for s in sources)})" if sources else "")
    for i, trial in enumerate(trials):
        predicted, measured, error = trial.peak()
        if predicted:
            ax.bar(i - width / 2, predicted / GiB, width, color="#9ecae1", edgecolor="#3182bd", hatch="//",
                   label="predicted peak (plan)" if "predicted peak (plan)" not in _labels(ax) else None)
            tops.append(predicted / GiB)
        if measured is not None:
            ax.bar(i + width / 2, measured / GiB, width, color="#3182bd",
                   label=measured_label if measured_label not in _labels(ax) else None)
            tops.append(measured / GiB)
        top = max(v for v in ((predicted or 0) / GiB, (measured or 0) / GiB))
        if trial.shown_status == "REFUSED":
            ax.annotate("refused", (i, top), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8, color="#b30000")
        elif error is not None:
            ax.annotate(f"{error:+.1%}", (i, top), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
        needs = [(e.get("bytes_allocated") or 0) + (e.get("bytes_requested") or 0) for e in trial.oom_events]
        needs = [n / GiB for n in needs if n]
        if needs:
            label = "OOM event (in use + requested)"
            ax.scatter([i + width / 2] * len(needs), needs, marker="X", s=90, color="#d62728", zorder=5,
                       label=label if label not in _labels(ax) else None)
            ax.annotate(f"{len(needs)} OOM{'s' if len(needs) > 1 else ''}", (i + width / 2, max(needs)),
                        textcoords="offset points", xytext=(8, -3), fontsize=8, color="#d62728")
            tops.extend(needs)
    budgets = {t.name: float(t.params["budget_bytes"]) for t in trials if t.params.get("budget_bytes")}
    if len(set(budgets.values())) == 1:
        budget = next(iter(budgets.values())) / GiB
        small = f" ({human(budget * GiB)})" if budget < 0.1 else ""
        ax.axhline(budget, color="#d62728", linestyle="--", linewidth=1.5, label=f"budget {budget:.3g} GiB{small}")
        tops.append(budget)
    else:
        for i, trial in enumerate(trials):
            if trial.name in budgets:
                ax.hlines(budgets[trial.name] / GiB, i - 0.45, i + 0.45, colors="#d62728", linestyles="--",
                          label="budget per trial" if "budget per trial" not in _labels(ax) else None)
                tops.append(budgets[trial.name] / GiB)
    title = f"{sweep.name}: predicted vs measured peak memory per trial"
    notes = [] if budgets else ["no memory budget: the device was unbounded"]
    if not any(t.peak()[0] for t in trials):
        notes.append("no predicted peaks: the plans had no estimate")
    if notes:
        title += f"\n({'; '.join(notes)})"
    ax.set_title(title, fontsize=11)
    ax.set_ylabel("peak memory (GiB)")
    ax.set_ylim(0, max(tops) * 1.18 or 1)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    ax.set_xticks(range(len(trials)), [t.name for t in trials], rotation=30, ha="right", fontsize=8)
    ax.set_xlim(-0.7, len(trials) - 0.3)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # outside: never over a bar
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _labels(ax) -> list[str]:
    return ax.get_legend_handles_labels()[1]
