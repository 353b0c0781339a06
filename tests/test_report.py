"""``orchestrator report`` on sweeps recorded in real MLflow by a real local Ray sweep.

The table, the summary, the Parquet file and the PNG are checked against what MLflow holds;
what the plot shows (its unit, its labels) is checked on records made here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sqlite3
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fake_sweep import ROOT, run_fake_sweep, runs_of
from mlflow_server import MlflowServer

from orchestrator.cli import main
from orchestrator.errors import UserError
from orchestrator.report import (
    SweepRecord,
    TrialRecord,
    config_labels,
    load_sweep,
    peak_chart,
    plot_peaks,
    short_value,
    summary,
    trial_table,
    write_parquet,
)
from orchestrator.tracking.reader import artifact_text
from orchestrator.units import KiB, MiB
from tests.conftest import command_env, installed_command

CASES = {0.01: {"epochs": 3}, 0.1: {"epochs": 3, "oom_at": 2}, 0.2: {"refuse": True}}


@pytest.fixture(scope="module")
def sqlite_sweep(local_ray, tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    _, results = run_fake_sweep(root, uri, CASES)
    assert not results.errors
    return root, uri


def report(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["report", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.integration  # a real local Ray sweep records what the report reads
def test_report_table_summary_parquet_and_png_match_mlflow(sqlite_sweep, tmp_path, capsys):
    _, uri = sqlite_sweep
    out = tmp_path / "out"
    code, text, _ = report(capsys, "tracking_test", "--tracking-uri", uri, "--out", str(out))
    assert code == 0
    client, parents, children = runs_of(uri)
    by_lr = {run.data.params["config.lr"]: run for run in children.values()}
    plain, retried, refused = by_lr["0.01"], by_lr["0.1"], by_lr["0.2"]

    # Each trial named as `run` names it: its Tune trial id (the MLflow run is Tune's str(trial)).
    trial_id = {name: run.data.tags["trial_id"] for name, run in (("plain", plain), ("retried", retried), ("refused", refused))}
    heading, table_text, summary_text = text.split("\n\n")[:3]
    lines = {line.split()[0]: line for line in table_text.splitlines() if line.split() and line.split()[0] in trial_id.values()}
    assert len(lines) == len(children) == 3
    assert all(run.info.run_name.endswith(run.data.tags["trial_id"]) for run in children.values())
    # trial, status, trained, plan, predicted peak, measured peak, estimate error, OOM retries, eval_loss
    assert lines[trial_id["plain"]].split() == [trial_id["plain"], "FINISHED", "3/3", "ep", "32", "x", "2,", "eval", "64,", "fp32",
                                                "4.0", "GiB", "4.2", "GiB", "+5.0%", "0", "0.5000"]
    assert lines[trial_id["retried"]].split()[1:9] == ["FINISHED", "3/3", "ep", "16", "x", "4,", "eval", "64,"]
    assert lines[trial_id["retried"]].split()[-2:] == ["1", "0.5000"]
    # Its prediction (above the 6 GiB budget) and nothing measured.
    assert lines[trial_id["refused"]].split()[1:] == ["REFUSED", "0/3", "ep", "64", "x", "1,", "eval", "64,", "fp32", "8.0", "GiB",
                                                      "-", "-", "0", "-"]
    assert "Trials: 3 (2 finished, 1 refused)" in text
    assert "OOMs survived: 1 (in 1 of 2 finished trials)" in text
    assert "Worst estimation error: +5.0%" in text
    assert "GPU hours: 0.000 (no trial had a GPU)" in text
    # Why the refused trial did not run, as `run` said it: the one trial that did not simply finish.
    assert [line for line in summary_text.splitlines() if line.split()[0] in trial_id.values()] == [
        f"{trial_id['refused']} refused: {refused.data.tags['refusal']}"]

    table = pq.read_table(out / "results.parquet")
    rows = table.to_pylist()
    assert len(rows) == 3 + 3 + 1  # one row per trial per epoch; the refused trial's epoch 0
    for column in ("experiment", "trial", "trial_id", "status", "workload", "config.lr", "config.width", "epoch",
                   "train_loss", "eval_loss", "peak_allocated_bytes", "predicted_peak_bytes", "prediction_error",
                   "budget_bytes", "oom_retries", "micro_batch", "accum_steps", "estimator", "precision"):
        assert column in table.column_names, column
    assert str(table.schema.field("peak_allocated_bytes").type) == "int64"
    assert str(table.schema.field("config.lr").type) == "double"
    for run in (plain, retried, refused):
        mine = [r for r in rows if r["run_id"] == run.info.run_id]
        assert {r["trial"] for r in mine} == {run.info.run_name}
        assert {r["experiment"] for r in mine} == {"tracking_test"}
        for key in ("train_loss", "peak_allocated_bytes", "micro_batch", "prediction_error", "oom_retries"):
            history = {int(m.step): m.value for m in client.get_metric_history(run.info.run_id, key)}
            parquet = {r["epoch"]: r[key] for r in mine if r[key] is not None}
            assert set(parquet) == set(history), key
            for epoch, value in history.items():
                assert parquet[epoch] == value or (math.isnan(value) and math.isnan(parquet[epoch])), (key, epoch)
    assert {r["status"] for r in rows if r["run_id"] == refused.info.run_id} == {"REFUSED"}
    assert {r["config.lr"] for r in rows} == {0.01, 0.1, 0.2}

    width, height = png_size(out / "report.png")
    assert width >= 900 and height >= 600
    logged = {a.path for a in client.list_artifacts(parents[0].info.run_id, "report")}
    assert logged == {"report/report.png", "report/results.parquet"}


@pytest.mark.integration  # a real local Ray sweep records what the report reads
def test_report_defaults_to_the_newest_sweep(sqlite_sweep, tmp_path, capsys, monkeypatch):
    root, _ = sqlite_sweep
    monkeypatch.chdir(root)  # the default tracking URI is ./mlflow.db
    code, text, _ = report(capsys, "--out", str(tmp_path / "out"))
    assert code == 0 and "experiment 'tracking_test'" in text


@pytest.mark.integration  # a real local Ray sweep records what the report reads
def test_report_errors_are_one_line(sqlite_sweep, tmp_path, capsys):
    _, uri = sqlite_sweep
    code, _, err = report(capsys, "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}")
    assert code == 2 and err.startswith("error: no MLflow database at") and not (tmp_path / "none.db").exists()
    code, _, err = report(capsys, "nope", "--tracking-uri", uri)
    assert code == 2 and "no MLflow experiment or sweep named 'nope'" in err and "tracking_test" in err


@pytest.mark.integration  # a real local Ray sweep records what the report reads
def test_a_sweep_is_reported_by_its_own_name_too(sqlite_sweep, tmp_path, capsys):
    """The results folder's name, or the folder, as `run` prints it: how an older sweep of an experiment is reported."""
    root, uri = sqlite_sweep
    code, text, _ = report(capsys, "tracking_test_run", "--tracking-uri", uri, "--out", str(tmp_path / "out"))
    assert code == 0 and text.startswith("Sweep tracking_test_run (experiment 'tracking_test'")
    # The folder itself, as run's "Results:" line prints it, names the sweep too.
    code, text, _ = report(capsys, str(root / "tune" / "tracking_test_run") + "/", "--tracking-uri", uri,
                           "--out", str(tmp_path / "out"))
    assert code == 0 and text.startswith("Sweep tracking_test_run (experiment 'tracking_test'")


@pytest.mark.integration  # a real local Ray sweep records what the report reads
def test_report_against_a_tracking_server(local_ray, tmp_path, capsys):
    with MlflowServer(tmp_path / "server") as server:
        _, results = run_fake_sweep(tmp_path, server.uri, {0.01: {"epochs": 2}, 0.1: {"epochs": 2, "oom_at": 2}})
        assert not results.errors
        code, text, _ = report(capsys, "tracking_test", "--tracking-uri", server.uri, "--out", str(tmp_path / "out"))
        assert code == 0
        assert "Trials: 2 (2 finished)" in text and "OOMs survived: 1" in text
        assert len(pq.read_table(tmp_path / "out" / "results.parquet")) == 4
        client, parents, _ = runs_of(server.uri)
        logged = {a.path for a in client.list_artifacts(parents[0].info.run_id, "report")}
        assert logged == {"report/report.png", "report/results.parquet"}
        (tmp_path / "out" / "report.png").unlink()

    # After the server (a SLURM job's, torn down with its job): its SQLite store read directly.
    # The runs' artifacts are the server's (mlflow-artifacts:/...): read and logged where it kept them.
    stored = f"sqlite:///{tmp_path / 'server' / 'mlflow.db'}"
    code, text, _ = report(capsys, "tracking_test", "--tracking-uri", stored, "--out", str(tmp_path / "out"))
    assert code == 0, text
    assert "OOMs survived: 1" in text
    assert [len(t.oom_events) for t in load_sweep(stored).trials] == [0, 1]  # its OOM events, read there too
    with MlflowServer(tmp_path / "server") as server:  # the files are where a server serves them from
        client, parents, _ = runs_of(server.uri)
        logged = {a.path for a in client.list_artifacts(parents[0].info.run_id, "report")}
        assert logged == {"report/report.png", "report/results.parquet"}


@pytest.mark.integration  # a real local Ray sweep records what the report reads
def test_real_sweep_with_ooms_reported_from_mlflow(local_ray, tmp_path, capsys, monkeypatch):
    """The real runner and trainable on an emulated 8 MiB device: trials OOM, shrink and finish;
    MLflow has every report once, the events and the final plan, and the report agrees with it,
    leaving nothing in the temporary folder it downloaded the trials' OOM events into."""
    from orchestrator.config import load_spec
    from orchestrator.runner import run_sweep

    spec = load_spec(str(ROOT / "configs" / "demo_oom_cpu.yaml"),
                     ["search_space.workload={grid: [cnn, staged_mlp]}", "search_space.width=48"])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    outcome = run_sweep(spec, tracking_uri=uri, storage_path=str(tmp_path / "tune"))
    assert outcome.ok

    client, parents, children = runs_of(uri, "demo_oom_cpu")
    assert len(parents) == 1 and len(children) == 2
    total_ooms = 0
    for run in children.values():
        assert run.info.status == "FINISHED"
        epochs = sorted(client.get_metric_history(run.info.run_id, "epoch"), key=lambda m: m.step)
        assert [m.value for m in epochs] == [1, 2, 3]  # one report per epoch, at MLflow step = optimizer step
        per_epoch = int(epochs[0].step)  # samples // 128: 8 steps for the cnn, 16 for the staged mlp
        assert per_epoch in (8, 16) and [int(m.step) for m in epochs] == [per_epoch, 2 * per_epoch, 3 * per_epoch]
        micro = sorted(client.get_metric_history(run.info.run_id, "micro_batch"), key=lambda m: m.step)[-1].value
        assert run.data.params["plan.micro_batch"] == str(int(micro))
        events = json.loads(artifact_text(client, run.info.run_id, "oom_events.json"))
        assert len(events) == run.data.metrics["oom_retries"] > 0
        total_ooms += len(events)

    report_temp = tmp_path / "report_temp"
    report_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(report_temp))  # where the report's downloads go
    code, text, _ = report(capsys, "demo_oom_cpu", "--tracking-uri", uri, "--out", str(tmp_path / "out"))
    assert code == 0
    assert list(report_temp.iterdir()) == []
    assert f"OOMs survived: {total_ooms} (in 2 of 2 finished trials)" in text
    rows = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    assert len(rows) == 6
    for run in children.values():
        last = max((r for r in rows if r["run_id"] == run.info.run_id), key=lambda r: r["epoch"])
        assert last["oom_retries"] == run.data.metrics["oom_retries"]
        assert last["peak_allocated_bytes"] == run.data.metrics["peak_allocated_bytes"]


@pytest.fixture(scope="module")
def sweep_store(tmp_path_factory) -> Path:
    """A real SQLite MLflow store holding a sweep as the tracking writes it (a parent run, trials
    with a metric history), made with MLflow's client: what the report reads, without a sweep."""
    from mlflow import MlflowClient

    from orchestrator.tracking.writer import get_or_create_experiment

    database = tmp_path_factory.mktemp("store") / "mlflow.db"
    uri = f"sqlite:///{database}"
    client = MlflowClient(uri)
    # As the tracking makes it: its artifacts (the report's chart and table) beside the database,
    # not in ./mlruns of the folder pytest runs in, which MLflow's client would pick by default.
    experiment = get_or_create_experiment(client, "stored", uri)
    parent = client.create_run(experiment, tags={"orchestrator.role": "sweep", "orchestrator.sweep_id": "s1"})
    for trial in range(3):
        run = client.create_run(experiment, run_name=f"t{trial}", tags={
            "orchestrator.role": "trial", "orchestrator.sweep_id": "s1", "mlflow.parentRunId": parent.info.run_id,
        })
        for step in range(1, 60):
            client.log_metric(run.info.run_id, "eval_loss", 1 / step, step=step)
            client.log_metric(run.info.run_id, "step", step, step=step)
    return database


def test_a_sweep_name_two_sweeps_have_is_refused_listing_them_and_a_run_id_names_one(tmp_path, capsys):
    """Two folders sharing one store, each with a sweep started in the same second: the name is
    theirs both, so the report refuses it, listing each sweep's run, start and results folder,
    rather than reporting one of them; the run id names either, and a trial's run id names none."""
    from mlflow import MlflowClient

    from orchestrator.tracking.writer import get_or_create_experiment

    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    client = MlflowClient(uri)
    experiment = get_or_create_experiment(client, "shared", uri)
    name = "shared_20261206-012237"
    parents = [client.create_run(experiment, run_name=name, tags={
        "orchestrator.role": "sweep", "orchestrator.sweep_id": f"s{n}", "tune.experiment_path": f"/home/u{n}/results/{name}",
    }) for n in (1, 2)]
    trial = client.create_run(experiment, run_name="t0", tags={
        "orchestrator.role": "trial", "orchestrator.sweep_id": "s1", "mlflow.parentRunId": parents[0].info.run_id})
    capsys.readouterr()  # MLflow's lines as it made the store

    code, _, err = report(capsys, name, "--tracking-uri", uri, "--out", str(tmp_path / "out"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: 2 sweeps at {uri} are named {name!r}: run ")
    for n, parent in zip((1, 2), parents):
        assert f"run {parent.info.run_id} (started " in err and f"results /home/u{n}/results/{name})" in err
    assert err.strip().endswith("name one by its MLflow run id (orchestrator report RUN_ID)")
    assert not (tmp_path / "out").exists()

    code, text, _ = report(capsys, parents[0].info.run_id, "--tracking-uri", uri, "--out", str(tmp_path / "out"))
    assert code == 0 and text.startswith(f"Sweep {name} (experiment 'shared', MLflow run {parents[0].info.run_id}")
    code, _, err = report(capsys, trial.info.run_id, "--tracking-uri", uri, "--out", str(tmp_path / "out2"))
    assert code == 2 and f"no MLflow experiment or sweep named {trial.info.run_id!r}" in err


def report_in(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """``orchestrator report`` as a user runs it, from ``folder`` (its default store is ./mlflow.db there)."""
    return subprocess.run([installed_command(), "report", *args], cwd=folder, env=command_env(), capture_output=True,
                          text=True, timeout=300)


def corrupted(database: Path, into: Path) -> Path:
    """A copy of ``database`` whose second half is overwritten, as a disk or a copy cut off can leave it:
    its schema reads, its records do not ("database disk image is malformed")."""
    data = bytearray(database.read_bytes())
    data[len(data) // 2:] = b"\xff" * (len(data) - len(data) // 2)
    into.write_bytes(data)
    return into


@pytest.mark.parametrize("store,message", [
    ("malformed", "is not usable ((sqlite3.DatabaseError) database disk image is malformed); "
                  "pass the sweep's --tracking-uri, or restore its store"),
    ("not a database", "is not usable ((sqlite3.DatabaseError) file is not a database); "
                       "pass the sweep's --tracking-uri, or restore its store"),
], ids=["malformed", "not a database"])
def test_a_store_that_cannot_be_read_is_one_line(sweep_store, tmp_path, store, message):
    """As ``run`` refuses such a store before it starts, ``report`` says so in one line, exit 2, not a
    SQLAlchemy traceback; the store as it was before reads (it is the damage that is refused)."""
    if store == "malformed":
        assert report_in(sweep_store.parent, "--out", str(tmp_path / "healthy")).returncode == 0
        corrupted(sweep_store, tmp_path / "mlflow.db")
    else:
        (tmp_path / "mlflow.db").write_bytes(b"this is not SQLite " * 1000)
    done = report_in(tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr == f"error: MLflow at sqlite:///{tmp_path / 'mlflow.db'} {message}\n"
    assert "Traceback" not in done.stdout + done.stderr


def test_a_missing_store_or_a_folder_is_one_line(tmp_path):
    done = report_in(tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr + done.stdout
    assert done.stderr == f"error: no MLflow database at {tmp_path / 'mlflow.db'}; pass --tracking-uri (the sweep's tracking URI)\n"
    assert not (tmp_path / "mlflow.db").exists()  # a report makes no store
    (tmp_path / "mlflow.db").mkdir()
    done = report_in(tmp_path)  # MLflow would retry opening a folder for minutes
    assert done.returncode == 2 and done.stderr.startswith(f"error: {tmp_path / 'mlflow.db'} is not an MLflow database file")


@pytest.mark.parametrize("store,what", [
    ("empty", "an empty file"),
    ("other program's", "a SQLite database without MLflow's tables"),
], ids=["empty", "another program's SQLite"])
def test_a_file_that_holds_no_mlflow_store_is_one_line_and_left_as_it_was(tmp_path, store, what):
    """MLflow would make its tables in an empty file (a ``touch``, a copy cut off at once) or in
    another program's SQLite database and then say it holds no sweep: a report writes nothing, so
    the file is refused as it is, named, and left byte for byte."""
    database = tmp_path / "mlflow.db"
    if store == "empty":
        database.touch()
    else:
        with sqlite3.connect(database) as db:
            db.execute("CREATE TABLE notes (text TEXT)")
        db.close()
    before = database.read_bytes()
    done = report_in(tmp_path)
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr == f"error: {database} is not an MLflow database ({what}); pass --tracking-uri (the sweep's tracking URI)\n"
    assert database.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


def test_an_out_folder_that_takes_no_file_is_one_line_before_mlflow_is_read(sweep_store, tmp_path):
    """``--out`` is tried first: a file in its way is one line, exit 2, no traceback, and no
    table printed for a report that is not written; a folder made for an experiment that is not
    there goes again; one that can be made gets both files, whole."""
    (tmp_path / "taken").write_text("a file where the folder should be")
    done = report_in(sweep_store.parent, "--out", str(tmp_path / "taken"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"error: --out: cannot write to {tmp_path / 'taken'} (a file, not a folder); "
                           "pass --out with a folder you can write\n")
    done = report_in(sweep_store.parent, "nosuch", "--out", str(tmp_path / "made" / "here"))
    assert done.returncode == 2 and done.stderr.startswith("error: no MLflow experiment or sweep named 'nosuch'")
    assert not (tmp_path / "made").exists()
    done = report_in(sweep_store.parent, "--out", str(tmp_path / "new" / "report"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "new" / "report").iterdir()) == ["report.png", "results.parquet"]
    assert png_size(tmp_path / "new" / "report" / "report.png")[0] > 0
    assert pq.read_table(tmp_path / "new" / "report" / "results.parquet").num_rows == 3 * 59


def test_a_write_cut_off_keeps_the_earlier_file_whole(tmp_path):
    """A disk that fills up mid-write (``ENOSPC`` after some bytes went out) leaves the file of the
    earlier report as it was and no partial file beside it, and says so in one line."""
    import errno

    from orchestrator.report import write_whole

    earlier = tmp_path / "results.parquet"
    earlier.write_bytes(b"the earlier report")

    def fills_the_disk(f):
        f.write(b"half of a new report")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UserError) as raised:
        write_whole({tmp_path / "report.png": lambda f: f.write(b"a new plot"), earlier: fills_the_disk})
    assert str(raised.value) == (f"--out: cannot write {earlier} (No space left on device); "
                                 "pass --out with a folder you can write")
    assert earlier.read_bytes() == b"the earlier report"
    assert [p.name for p in tmp_path.iterdir()] == ["results.parquet"]  # no new plot beside the old table


def test_a_file_that_cannot_be_put_in_place_leaves_the_others_as_they_were(tmp_path):
    from orchestrator.report import write_whole

    (tmp_path / "results.parquet").mkdir()
    with pytest.raises(UserError, match=r"^--out: cannot write .*/results\.parquet \(Is a directory\); "):
        write_whole({tmp_path / "report.png": lambda f: f.write(b"a plot"),
                     tmp_path / "results.parquet": lambda f: f.write(b"a table")})
    assert [p.name for p in tmp_path.iterdir()] == ["results.parquet"] and not any((tmp_path / "results.parquet").iterdir())


def test_report_loads_neither_torch_nor_ray():
    """A report is made wherever MLflow can be reached: reading it must not pay for (or need) torch and Ray."""
    check = "import orchestrator.report, sys; print('torch' in sys.modules, 'ray' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


# -- the plot, from records made here -------------------------------------------------------------


def record(index: int, config: dict[str, str], predicted: float | None, measured: float | None, *,
           budget: int | None = None, ooms: tuple[int, ...] = (), refused: bool = False) -> TrialRecord:
    """A trial as ``load_sweep`` reads it from MLflow: params as text, one result."""
    params = {f"config.{k}": v for k, v in config.items()}
    params.update({"budget_bytes": str(budget)} if budget else {})
    metrics = {"predicted_peak_bytes": predicted} if predicted else {}
    metrics.update({"peak_allocated_bytes": measured} if measured is not None else {})
    return TrialRecord(
        name=f"train_trial_a1b2c_{index:05d}", trial_id=f"a1b2c_{index:05d}", run_id=str(index), status="FINISHED", params=params,
        tags={"refusal": "needs 9 MiB"} if refused else {}, results={8: metrics},
        oom_events=[{"bytes_allocated": n, "bytes_requested": 0} for n in ooms], duration_s=1.0,
    )


def sweep_of(trials: list[TrialRecord]) -> SweepRecord:
    return SweepRecord("demo_cpu", "demo_cpu_2026", "r0", "eval_loss", trials)


def test_an_estimate_off_by_bytes_says_sizes_that_differ():
    """'+0.0% (measured 1.8 MiB above predicted 1.8 MiB)' read as a contradiction."""
    near = record(0, {"lr": "0.1"}, 1_873_500, 1_873_526)
    assert "Worst estimation error: +0.0% (a1b2c_00000: measured 1.78673 MiB above predicted 1.78671 MiB)" in summary(sweep_of([near]))
    exact = record(0, {"lr": "0.1"}, 1_873_500, 1_873_500)
    assert "Worst estimation error: +0.0% (a1b2c_00000: measured 1.8 MiB as predicted 1.8 MiB)" in summary(sweep_of([exact]))


def test_a_trial_the_scheduler_stopped_early_shows_what_it_trained_of_the_budget():
    """ASHA's stopped trials end FINISHED in MLflow, as those that trained to the end do."""
    stopped, whole = record(0, {"lr": "0.1"}, None, None), record(1, {"lr": "0.01"}, None, None)
    stopped.results[8].update(epoch=1, step=120)
    whole.results[8]["epoch"] = 3
    stopped.tags["stopped_early"] = "stopped early by ASHA after 1/3 epochs"
    table = trial_table(dataclasses.replace(sweep_of([stopped, whole]), stop_epochs=3))
    assert [line.split()[2] for line in table.splitlines()[2:]] == ["1/3", "3/3"]
    assert summary(sweep_of([stopped, whole])).splitlines()[0] == "Trials: 2 (2 finished; 1 stopped early by ASHA)"
    steps = dataclasses.replace(sweep_of([stopped]), stop_epochs=None, stop_steps=500)
    assert "1 ep, 120/500 steps" in trial_table(steps)


def test_a_diverged_trial_is_not_counted_among_the_finished_ones_of_the_oom_line():
    """``on_nan: stop`` ends a diverged trial FINISHED in MLflow; the summary's lines count it as
    diverged, both of them."""
    diverged, survived = record(0, {"lr": "1.0"}, None, None), record(1, {"lr": "0.01"}, None, None, ooms=(5,))
    diverged.tags["diverged"] = "loss not finite at step 9 (epoch 2); not retried (on_nan: stop)"
    lines = summary(sweep_of([diverged, survived])).splitlines()
    assert lines[:2] == ["Trials: 2 (1 diverged, 1 finished)", "OOMs survived: 1 (in 1 of 1 finished trials)"]


def test_every_parquet_file_has_the_orchestrators_columns_of_the_same_types(tmp_path):
    """A sweep with no estimate (``estimator: none``) or no measurement reports fewer metrics; its
    file still has every column another sweep's has, empty, so that the two concatenate."""
    from orchestrator.report import METRIC_ORDER, TRIAL_COLUMNS

    estimated = sweep_of([record(0, {"lr": "0.01"}, 1.7 * MiB, 1.8 * MiB, budget=8 * MiB)])
    bare = sweep_of([record(0, {"lr": "0.1"}, None, None)])
    write_parquet(estimated, tmp_path / "estimated.parquet")
    write_parquet(bare, tmp_path / "bare.parquet")
    schemas = [pq.read_schema(tmp_path / f"{name}.parquet") for name in ("estimated", "bare")]
    assert schemas[0] == schemas[1]
    assert {*METRIC_ORDER, *TRIAL_COLUMNS} <= set(schemas[1].names)
    both = pa.concat_tables([pq.read_table(tmp_path / f"{name}.parquet") for name in ("estimated", "bare")])
    assert both.column("predicted_peak_bytes").to_pylist() == [int(1.7 * MiB), None]


def test_an_unfinished_sweep_says_that_trials_that_never_started_are_not_listed():
    """A trial that never started has no MLflow run: the report of an interrupted sweep (its run
    KILLED) or of one still running says so, and how to finish it, below the count of those listed."""
    import dataclasses


    sweep = sweep_of([record(0, {"lr": "0.01"}, 1.7 * MiB, 1.8 * MiB)])
    assert "listed" not in summary(sweep)
    interrupted = summary(dataclasses.replace(sweep, status="KILLED")).splitlines()
    assert interrupted[:2] == ["Trials: 1 (1 finished)", "The sweep was interrupted: only the trials that started are "
                               "listed; `orchestrator run CONFIG --name demo_cpu_2026 --resume`, with the flags "
                               "it was started with, finishes it"]
    assert summary(dataclasses.replace(sweep, status="RUNNING")).splitlines()[1] == (
        "The sweep is running (or its driver was killed): only the trials that have started are listed")


def test_the_summary_says_why_each_trial_did_not_finish_as_run_said_it():
    """A failed trial's exception line, a refused trial's reason, a diverged trial's step: the
    words of ``run``'s line for it (``<trial> failed: ...``), which a report read days later has
    nowhere else; an error a resume then recovered from is not an ending. Past twenty such trials
    a line points to the Parquet file's columns, which have every trial's."""
    from orchestrator.report import ENDING_LINES, summary

    def ended(index, status, **tags):
        return dataclasses.replace(record(index, {"lr": "0.1"}, None, None), status=status, tags=tags)

    sweep = sweep_of([
        record(0, {"lr": "0.01"}, 1.7 * MiB, 1.8 * MiB),
        ended(1, "FAILED", error="ValueError: Invalid learning rate: -0.1"),
        ended(2, "FAILED", refusal="even micro-batch 1 needs 9 MiB, the budget is 8 MiB"),
        ended(3, "FINISHED", diverged="loss not finite at step 37 (epoch 2); last finite loss 0.4123"),
        ended(4, "FINISHED", error="RuntimeError: a node died"),  # then resumed to the end
    ])
    assert [line for line in summary(sweep).splitlines() if line.startswith("a1b2c_")] == [
        "a1b2c_00001 failed: ValueError: Invalid learning rate: -0.1",
        "a1b2c_00002 refused: even micro-batch 1 needs 9 MiB, the budget is 8 MiB",
        "a1b2c_00003 diverged: loss not finite at step 37 (epoch 2); last finite loss 0.4123",
    ]

    many = sweep_of([ended(i, "FAILED", error=f"ValueError: {i}") for i in range(ENDING_LINES + 5)])
    said = summary(many).splitlines()
    assert sum(line.startswith("a1b2c_") for line in said) == ENDING_LINES
    assert "... and 5 more trials that did not finish (results.parquet's refusal, diverged and error columns " \
           "have every trial's)" in said


def test_hyper_parameters_are_short_in_labels():
    assert [short_value(t) for t in ("0.0031622776601683794", "0.003", "0.1", "64", "mlp", "12345.678", "0.0")] == [
        "3.2e-3", "3e-3", "0.1", "64", "mlp", "1.2e4", "0"]


def test_bars_are_labelled_by_what_differs_between_the_trials():
    configs = [("mlp", "0.003", "64"), ("cnn", "0.003", "16"), ("mlp", "0.1", "16")]
    trials = [record(i, {"workload": w, "lr": lr, "width": width, "seed": "0"}, 1.0, 1.0)
              for i, (w, lr, width) in enumerate(configs)]
    assert config_labels(trials) == ["workload=mlp lr=3e-3 width=64", "workload=cnn lr=3e-3 width=16",
                                     "workload=mlp lr=0.1 width=16"]
    # Samples of the same configuration: their trial ids (as `run` names them) tell them apart;
    # a lone trial is its id, and a run without the id tag its MLflow run name.
    twins = [record(i, {"lr": "0.01", "width": w}, 1.0, 1.0) for i, w in enumerate(["16", "16", "32"])]
    assert config_labels(twins) == ["width=16 (a1b2c_00000)", "width=16 (a1b2c_00001)", "width=32"]
    assert config_labels(twins[:1]) == ["a1b2c_00000"]
    assert config_labels([dataclasses.replace(twins[0], trial_id="")]) == ["train_trial_a1b2c_00000"]


def test_the_unit_is_the_largest_values_and_bars_are_in_it():
    """The demo's MLP peaks at about 1.8 MiB on a CPU: in MiB, not 0.00175 GiB."""
    trials = [record(0, {"width": "16"}, 1.7 * MiB, 1.8 * MiB),
              record(1, {"width": "32"}, 300 * KiB, None, refused=True)]
    chart = peak_chart(sweep_of(trials))
    assert chart.unit == "MiB" and chart.budget is None and "the device was unbounded" in chart.title
    assert [(b.label, b.predicted, b.measured) for b in chart.bars] == [
        ("width=16", pytest.approx(1.7), pytest.approx(1.8)), ("width=32", pytest.approx(300 / 1024), None)]
    assert [b.note for b in chart.bars] == ["1.8 MiB, +5.9%", "refused"]  # the value, for a bar too short to see
    small = peak_chart(sweep_of([record(0, {"width": "8"}, 700, 800)]))
    assert small.unit == "B" and small.bars[0].measured == 800


def test_a_shared_budget_and_oom_events_set_the_unit_too():
    budget = 8 * MiB
    trials = [record(i, {"lr": lr}, 200 * KiB, 210 * KiB, budget=budget, ooms=(9 * MiB,) if i else ())
              for i, lr in enumerate(["0.01", "0.1"])]
    chart = peak_chart(sweep_of(trials))
    assert chart.unit == "MiB" and chart.budget == 8 and chart.bars[1].ooms == (9,)
    assert all(b.budget is None for b in chart.bars)  # one line for all
    own = peak_chart(sweep_of([record(0, {"lr": "0.01"}, 1, 2, budget=2 * KiB),
                               record(1, {"lr": "0.1"}, 1, 2, budget=KiB)]))
    assert own.unit == "KiB" and own.budget is None and [b.budget for b in own.bars] == [2, 1]


def test_a_plot_of_64_trials_grows_in_height(tmp_path):
    trials = [record(i, {"lr": str(10 ** (-1 - i / 16)), "width": str(16 << (i % 4))}, (i + 1) * 40 * KiB,
                     (i + 1) * 42 * KiB) for i in range(64)]
    plot_peaks(sweep_of(trials), tmp_path / "report.png")
    width, height = png_size(tmp_path / "report.png")
    assert height > width >= 1000


def test_a_plot_of_hundreds_of_trials_is_a_point_per_trial(tmp_path):
    """Above MAX_BARS trials a pair of bars each would be an image taller than anyone reads (and
    slower to draw than the rest of the report): one point per trial, on a figure of fixed size."""
    from orchestrator.report import MAX_BARS

    trials = [record(i, {"lr": str(10 ** (-1 - i / 64))}, (i + 1) * KiB, (i + 2) * KiB, budget=512 * KiB,
                     ooms=(600 * KiB,) if i % 50 == 0 else (), refused=i % 100 == 7)
              for i in range(MAX_BARS + 1)]
    plot_peaks(sweep_of(trials), tmp_path / "report.png")
    assert png_size(tmp_path / "report.png") == (1320, 960)
