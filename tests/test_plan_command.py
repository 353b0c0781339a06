"""``orchestrator plan``: table and JSON for every trial, progress on stderr, refusals, user errors."""

from __future__ import annotations

import inspect
import json
import re
from argparse import Namespace

import pytest

from orchestrator.cli import main
from orchestrator.contract import COMPILED_MODEL_NOTE
from orchestrator.errors import UserError
from orchestrator.plan_command import plan_command
from tests.conftest import ROOT
from tests.workloads import BuggyWorkload

SWEEP = """
experiment: plan_test
workload:
  name: staged_mlp
  params: {{aux_width: 256, aux_start_epoch: 2}}
search_space:
  workload: {{grid: [staged_mlp, cnn]}}
  lr: {{grid: [0.001, 0.01]}}
effective_batch_size: 32
stop: {{epochs: 3}}
resources: {{cpu: 1}}
memory:
  device: {device}
  {capacity}
  estimator: trace
"""


@pytest.fixture
def sweep(tmp_path):
    def write(device="cpu", capacity=None):
        path = tmp_path / "sweep.yaml"
        path.write_text(SWEEP.format(device=device, capacity=f"capacity: {capacity}" if capacity else ""))
        return str(path)

    return write


def args(config, **kwargs):
    return Namespace(**{"config": config, "overrides": [], "device_memory": None, "estimator": None, "json": False, **kwargs})


def test_trials_of_one_memory_signature_share_one_plan(sweep, capsys, monkeypatch):
    """Planning counts the eval set, which builds it: once per signature, not once per trial."""
    from orchestrator import plan_command as command

    made = []
    real = command._plan
    monkeypatch.setattr(command, "_plan", lambda workload, *a: made.append(workload) or real(workload, *a))
    assert plan_command(args(sweep(), device_memory="2GiB", json=True)) == 0
    trials = json.loads(capsys.readouterr().out)["trials"]
    assert len(trials) == 4 and len(made) == 2  # 2 workloads x 2 learning rates
    assert [t["plan"] for t in trials][0::2] == [t["plan"] for t in trials][1::2]


def test_a_model_that_reads_its_weights_as_it_is_built_is_planned_and_says_why_its_host_memory_is_not(tmp_path, capsys):
    """The trace builds it on fake tensors, which hold values; host memory's count builds it on ``meta``."""
    path = tmp_path / "sweep.yaml"
    path.write_text("experiment: plan_test\nworkload: {name: tests.workloads:ValueInitWorkload}\nsearch_space: {lr: 0.01}\n"
                    "effective_batch_size: 32\nstop: {epochs: 1}\nmemory: {device: emulated, capacity: 4MiB}\n")
    assert plan_command(args(str(path))) == 0
    out = capsys.readouterr().out
    assert "trial 0 (" in out and ": 32 x 1 (eval" in out, out
    [line] = [line for line in out.splitlines() if line.startswith("run: host memory")]
    assert line.startswith("run: host memory not planned, the trials' data and model state could not be measured "
                           "(RuntimeError: Tensor.item() cannot be called on meta tensors (in tests/workloads.py:"), line


def test_table_shows_every_phase_of_every_trial_and_the_plan(sweep, capsys):
    assert plan_command(args(sweep(), device_memory="2GiB")) == 0
    out, err = capsys.readouterr()
    # trials that differ only in lr have the same memory and plan: they share their rows and plan line
    rows = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines() if line[:1].isdigit() and "trials," not in line]
    assert {(r[0], r[1], r[2]) for r in rows} == {
        *(("0, 1", "staged_mlp", p) for p in ("train", "eval", "train@epoch3", "eval@epoch3")),
        *(("2, 3", "cnn", p) for p in ("train", "eval")),
    }
    [header] = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines() if line.startswith("trial  workload")]
    assert header[-1] == "worst" and len(header) == len(max(rows, key=len))  # every column has a header
    worst = {r[0]: r[2] for r in rows if r[-1] == "yes"}
    assert worst["0, 1"] == "train@epoch3" and worst["2, 3"] == "eval"  # the aux block; the 4x eval batch
    # a CUDA target: every phase's reserved memory is the allocator model's, and the table says so
    assert "reserved by" in out and all(" allocator model " in f" {' '.join(r)} " for r in rows)
    assert "trials 0, 1 (staged_mlp" in out
    assert re.search(r"32 x 1 \(eval 128, fp32\); peak [\d.]+MiB of 1\.96G", out), out  # not 0.5xG: a unit it reaches
    assert "lr=" not in out  # the one key the group's trials differ in
    assert "of 1.96G (2.00G x safety margin 0.98)" in out  # the plan's peak against its limit
    assert "target cuda, budget 2.00G" in out and "ctx" in out  # a card of that size, with its context
    assert "4 trials, 0 refused" in out
    # progress on stderr: one line per memory signature (trials differing only in lr share one)
    lines = sorted(line for line in err.splitlines() if line.startswith("["))
    assert len(lines) == 2
    assert "staged_mlp (trials 0, 1): trace" in err and "cnn (trials 2, 3): trace" in err


def test_table_and_plan_say_where_reserved_memory_is_not_the_allocator_model(sweep, capsys):
    assert plan_command(args(sweep(), device_memory="2GiB", estimator="static")) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:1].isdigit() and "trials," not in line]
    assert rows and all(" x 1.1 " in f"{row} " and "allocator model" not in row for row in rows)
    plans = [line for line in out.splitlines() if line.startswith("trial ") and "):" in line]
    assert all("reserved = allocated x 1.1, not the allocator model (the static estimator logs no allocations)" in p
               for p in plans), plans


def test_json_has_the_plan_and_the_profile_of_every_trial(sweep, capsys):
    assert plan_command(args(sweep(device="emulated", capacity="8MiB"), json=True, estimator="static")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target"] == "emulated" and report["budget_bytes"] == 8 * 2**20 and report["estimator"] == "static"
    trial = report["trials"][0]
    assert trial["config"]["workload"] == "staged_mlp" and trial["worst_phase"] == trial["plan"]["predicted_phase"]
    assert [p["name"] for p in trial["profile"]["phases"]] == ["train", "eval", "train@epoch3", "eval@epoch3"]
    assert trial["plan"]["predicted_peak_bytes"] <= 0.98 * 8 * 2**20
    assert trial["plan"]["safety_margin"] == 0.98 and trial["limit_bytes"] == int(0.98 * 8 * 2**20)


def test_a_refused_trial_is_shown_not_an_error(sweep, capsys):
    assert plan_command(args(sweep(), device_memory="256KiB")) == 0
    out = capsys.readouterr().out
    assert "refused: needs" in out and "budget 256.0KiB" in out and "4 trials, 4 refused" in out


def test_user_mistakes_exit_2_with_one_line(sweep, capsys):
    with pytest.raises(UserError, match="--device-memory"):
        plan_command(args(sweep(), device_memory="24XB"))
    assert main(["plan", sweep(), "--device-memory", "lots"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --device-memory")
    # Before any estimate: a typo is not worth minutes of tracing first.
    assert main(["plan", sweep(), "--host-memory", "1e400GiB"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --host-memory: expected a size of at most 2**63 - 1 bytes (8 EiB), got '1e400GiB'"
    ]


def test_a_random_search_of_hundreds_of_trials_is_a_row_group_per_memory_configuration(sweep, capsys):
    """Hundreds of learning rates over two models: two groups of rows and two plan lines, each naming
    its first trials and how many it has, not a row and a line per trial; ``--json`` keeps every trial."""
    overrides = ["num_samples=75"]  # x the grid's 2 workloads x 2 learning rates
    assert plan_command(args(sweep(), device_memory="2GiB", overrides=overrides)) == 0
    out = capsys.readouterr().out
    rows = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines() if line[:1].isdigit() and "trials," not in line]
    assert {r[0] for r in rows} == {"0, 1, 4, ... (150)", "2, 3, 6, ... (150)"}
    assert len(rows) == 6  # staged_mlp's four phases, the CNN's two
    plans = [line for line in out.splitlines() if line.startswith("trials ")]
    assert [p.split(" (")[0] for p in plans] == ["trials 0, 1, 4, 5, 8, 9, 12, 13, ...", "trials 2, 3, 6, 7, 10, 11, 14, 15, ..."]
    assert all("(150 in all; " in p for p in plans)
    assert "300 trials, 0 refused" in out
    assert plan_command(args(sweep(), device_memory="2GiB", overrides=overrides, json=True)) == 0
    assert [t["trial"] for t in json.loads(capsys.readouterr().out)["trials"]] == list(range(300))


def test_a_sampled_learning_rate_reads_as_run_prints_it(sweep, capsys):
    """``plan`` names a trial by its values as ``run``'s lines and table do (4 significant digits),
    not by a float's 17; ``--json`` keeps the exact value."""
    overrides = ["search_space.lr={loguniform: [0.0001, 0.01]}", "search_space.workload={grid: [staged_mlp]}", "seed=7"]
    assert plan_command(args(sweep(), device_memory="2GiB", overrides=overrides, json=True)) == 0
    exact = json.loads(capsys.readouterr().out)["trials"][0]["config"]["lr"]
    assert len(repr(exact)) > 8  # a draw, not a round number
    assert plan_command(args(sweep(), device_memory="2GiB", overrides=overrides)) == 0
    plan_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("trial 0 "))
    assert f"lr={exact:.4g} " in plan_line and repr(exact) not in plan_line


def test_a_trial_that_cannot_be_estimated_is_shown_and_the_rest_planned(sweep, capsys, tmp_path, monkeypatch):
    """A model whose library is not installed where the plan is made: its trials show the error."""
    (tmp_path / "needs_library.py").write_text(
        "import dataclasses\n"
        "from trainables.cnn import CNNWorkload\n"
        "@dataclasses.dataclass\n"
        "class NeedsLibrary(CNNWorkload):\n"
        "    def build_model(self):\n"
        "        import torchvision_not_installed_here\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # estimate processes (where there are any) inherit it, as from the CLI
    config = sweep()
    overrides = ["search_space.workload={grid: [staged_mlp, needs_library:NeedsLibrary]}"]
    assert plan_command(args(config, device_memory="2GiB", overrides=overrides)) == 1
    out = capsys.readouterr().out
    assert "could not be estimated: ModuleNotFoundError: No module named 'torchvision_not_installed_here'" in out
    assert "trials 0, 1 (staged_mlp" in out and "4 trials, 0 refused, 2 could not be estimated" in out
    assert "trials 2, 3 (needs_library:NeedsLibrary" in out  # the error once, for both of its trials


def test_a_model_that_crashes_is_shown_with_the_line_of_its_code(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # tests.workloads, as a user's package in the working directory
    path = tmp_path / "sweep.yaml"
    path.write_text(
        "experiment: crash\nworkload: {name: 'tests.workloads:BuggyWorkload', "
        f"params: {{attempts_file: {tmp_path / 'attempts'}}}}}\n"
        "search_space: {lr: 0.01}\neffective_batch_size: 32\nstop: {epochs: 1}\nmemory: {estimator: trace}\n"
    )
    assert plan_command(args(str(path), device_memory="2GiB")) == 1
    out = capsys.readouterr().out
    line = inspect.getsourcelines(BuggyWorkload.loss)[1] + 1
    assert (
        "could not be estimated: ValueError: mat1 and mat2 shapes cannot be multiplied (64x32 and 31x16) "
        f"(in tests/workloads.py:{line} (loss))"
    ) in out
    assert "act/sample" not in out  # no table header over no rows


def test_a_compiled_model_is_planned_from_its_eager_trace_and_the_plan_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # tests.workloads, as a user's package in the working directory
    path = tmp_path / "sweep.yaml"
    path.write_text(
        "experiment: compiled\nworkload: {name: 'tests.workloads:CompiledMLPWorkload', params: {width: 16}}\n"
        "search_space: {lr: 0.01}\neffective_batch_size: 32\nstop: {epochs: 1}\nmemory: {estimator: trace}\n"
    )
    assert plan_command(args(str(path), device_memory="2GiB")) == 0
    out = capsys.readouterr().out
    assert "1 trials, 0 refused" in out and f"note: {COMPILED_MODEL_NOTE}" in out
    assert "note: optimizer AdamW (foreach), as built for a cuda device" in out


def test_each_trial_s_host_memory_is_planned_for_the_trials_a_node_runs_at_once(sweep, capsys):
    """With room, the loader settings stay; a byte short of what the trials at once hold, fewer
    batches are loaded ahead (then fewer workers); far too little, the trials are refused."""
    config = sweep()
    workers = {"overrides": ["data.num_workers=8", "data.prefetch_factor=4"], "estimator": "static"}
    assert plan_command(args(config, json=True, host_memory="64GiB", **workers)) == 0
    shown = json.loads(capsys.readouterr().out)
    [host] = [t["host_memory"] for t in shown["trials"][:1]]
    swept = shown["run_host_memory"]  # what `run` applies: every trial process as the sweep's largest
    assert swept["num_workers"] == 8 and not swept["reduced"] and swept["refusal"] is None
    assert host["num_workers"] == 8 and host["prefetch_factor"] == 4 and not host["reduced"] and host["refusal"] is None
    assert host["available_bytes"] == 64 * 2**30 and host["trials_at_once"] >= 1
    assert set(host["parts"]) == {"datasets", "loader interpreters", "batches ahead", "pinned", "checkpoint copy"}

    short = host["trial_bytes"] * host["trials_at_once"] - 1
    assert plan_command(args(config, json=True, host_memory=f"{short}B", **workers)) == 0
    host = json.loads(capsys.readouterr().out)["trials"][0]["host_memory"]
    assert host["reduced"].startswith("data.prefetch_factor 4->1") and host["prefetch_factor"] == 1 and host["refusal"] is None

    assert plan_command(args(config, host_memory="1KiB", **workers)) == 0  # a plan outcome, as a refused device plan
    out = capsys.readouterr().out
    assert "4 trials, 0 refused for device memory, 4 for host memory" in out
    assert "refused: " in out and "of host memory even loading in their own processes" in out
    [run_line] = [line for line in out.splitlines() if line.startswith("run (every trial as the largest")]
    assert "of 1.0 KiB available; refused: " in run_line, run_line

    # A trial this machine cannot hold (a GPU it lacks): `run` plans the nodes it runs on, and says so here.
    assert plan_command(args(config, device_memory="24GiB", host_memory="64GiB", overrides=["resources.gpu=1"],
                             estimator="static")) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == ("run: host memory not planned here: this machine holds no trial (resources: "
                                             "cpu 1, gpu 1); `run` plans it for the nodes the sweep runs on"), out[-500:]


def _installed_plan(project, *flags: str):
    import subprocess

    from tests.conftest import command_env, installed_command

    proc = subprocess.run([installed_command(), "plan", project.config, "--set", "data.num_workers=2", *flags],
                          cwd=project.folder, env=command_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_installed_plan_shows_host_memory_from_a_user_folder(own_model_project):
    out = _installed_plan(own_model_project, "--host-memory", "1MiB")
    lines = [line for line in out.splitlines() if line.startswith("  host memory ")]
    assert len(lines) == 2 and all("datasets " in line and "of 1.0 MiB available; refused: " in line for line in lines), out
    assert "2 trials, 0 refused for device memory, 2 for host memory" in out


def test_the_installed_plan_loads_fewer_batches_ahead_on_a_node_a_byte_short(own_model_project):
    """The larger trial's trials at once need one byte more than the node has: that trial's
    loader keeps fewer batches ahead (the line says so), the smaller one is left as it was."""
    trials = json.loads(_installed_plan(own_model_project, "--json", "--host-memory", "64GiB"))["trials"]
    need = [t["host_memory"]["trial_bytes"] * t["host_memory"]["trials_at_once"] for t in trials]
    assert len(need) == 2 and need[0] < need[1], need  # hidden 256, then 1024
    out = _installed_plan(own_model_project, "--host-memory", f"{need[1] - 1}B")
    small, large = [line for line in out.splitlines() if line.startswith("  host memory ")]
    assert "refused: " not in out and "2 trials, 0 refused\n" in out, out
    assert small.endswith(" available") and large.endswith(" available; data.prefetch_factor 2->1"), out
