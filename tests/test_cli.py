"""The installed ``orchestrator`` command, run as a user runs it: the README's own-model example
from the folder that holds ``my_models/``, the one line a broken user package gets, and sweeps
stopped (Ctrl-C, SIGTERM) or killed (kill -9), then resumed.

Every command here is the console script ``pip install`` wrote (not ``python -m``, which puts
the working directory on Python's path by itself) in a subprocess whose working directory is
a temporary folder outside the repository, with no PYTHONPATH.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import (
    ROOT,
    command_env,
    installed_command,
    interrupted_at,
    lines_until,
    rows_trained,
    trial_results,
)

# The README's WideNet at a pace a test can interrupt (about half a second an epoch on one core),
# in a module of the user's package beside it. PACE_ENV in the command's environment sets
# another pace (``unpaced()``: none) for a run that nobody interrupts: the sleep changes no number
# the trial computes, only how long it takes.
PACE_ENV = "ORCHESTRATOR_TEST_PACE_S"
PACED = f"""\
import dataclasses
import os
import time

from my_models.wide import WideNet

PACE_S = float(os.environ.get("{PACE_ENV}", "0.015"))


@dataclasses.dataclass
class PacedWideNet(WideNet):
    def loss(self, model, batch):
        time.sleep(PACE_S)
        return super().loss(model, batch)
"""

NO_PACKAGE = ("error: workload.name: workload 'my_models.wide:WideNet': cannot import module 'my_models.wide' "
              "(No module named 'my_models')")


def run(command: list[str], cwd, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=env or command_env(), capture_output=True, text=True, timeout=timeout)


def unpaced(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (a user's shell, ``command_env()``) with PacedWideNet at full speed: for a sweep
    that is resumed or run through, which nothing interrupts, so its trials need not be slow."""
    return {**(env or command_env()), PACE_ENV: "0"}


def test_the_readme_example_plans_with_the_installed_command(own_model_project):
    proc = run(own_model_project.command("plan"), own_model_project.folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plans = re.findall(r"^trial \d+ \(my_models\.wide:WideNet hidden=(\d+) .*\): (\d+ x \d+)", proc.stdout, re.M)
    assert sorted(hidden for hidden, _ in plans) == ["1024", "256"], proc.stdout
    assert "2 trials, 0 refused" in proc.stdout


@pytest.mark.integration
def test_the_readme_example_runs_with_the_installed_command(own_model_project):
    """Both trials of the README's sweep, cut to one epoch, on an embedded Ray of 2 CPUs: the
    workers import ``my_models`` from the driver's working directory."""
    command = own_model_project.command("run") + ["--set", "stop.epochs=1", "--num-cpus", "2"]
    proc = run(command, own_model_project.folder, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("trial  "):]
    assert "2/2 trials finished" in table and table.count("TERMINATED") == 2
    assert "hidden=256" in table and "hidden=1024" in table
    assert (own_model_project.folder / "mlflow.db").exists()  # results stay in the user's folder


@pytest.mark.parametrize("verb", ["plan", "run"])
def test_without_the_package_the_error_is_unchanged(own_model_project, tmp_path, verb):
    """From a folder that has the sweep file but not ``my_models/``: the one line it always said."""
    config = tmp_path / own_model_project.config
    config.write_text((own_model_project.folder / own_model_project.config).read_text())
    proc = run([installed_command(), verb, config.name], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == NO_PACKAGE and proc.stdout == ""
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "orchestrator_results").exists()


def test_a_syntax_error_in_the_users_module_is_one_line_naming_it(own_model_project):
    module = own_model_project.folder / "my_models" / "wide.py"
    lines = module.read_text().splitlines()
    [number] = [i + 1 for i, line in enumerate(lines) if "def build_model(self):" in line]
    lines[number - 1] = lines[number - 1].rstrip(":")
    module.write_text("\n".join(lines) + "\n")
    proc = run(own_model_project.command("plan"), own_model_project.folder)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: workload.name: workload 'my_models.wide:WideNet': cannot import module 'my_models.wide' "
        f"(my_models/wide.py:{number}: SyntaxError: expected ':')"
    )


@pytest.mark.integration
@pytest.mark.parametrize("verb", ["plan", "run"])
def test_a_shape_mismatch_in_the_users_model_is_one_line_and_writes_nothing(own_model_project, verb):
    """The first layer expects 21 features of the 20 the data has. The estimate runs the model on
    fake tensors, where torch logs each failing kernel with its traceback before raising; the user
    sees one line naming their file, and a refused ``run`` leaves no MLflow database and no
    results folder behind (it made both while checking them)."""
    module = own_model_project.folder / "my_models" / "wide.py"
    module.write_text(module.read_text().replace("torch.nn.Linear(20,", "torch.nn.Linear(21,"))
    proc = run(own_model_project.command(verb), own_model_project.folder)
    said = proc.stdout + proc.stderr
    assert proc.returncode == (1 if verb == "plan" else 2), said[-3000:]
    assert "mat1 and mat2 shapes cannot be multiplied (2x20 and 21x" in said and "my_models/wide.py:" in said
    assert "Traceback" not in said and "failed while attempting to run meta" not in said, said[-3000:]
    if verb == "run":
        [error] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert error.startswith("error: workload my_models.wide:WideNet hidden=")
        assert sorted(p.name for p in own_model_project.folder.iterdir()) == ["my_models", own_model_project.config]


def test_version_names_what_a_bug_report_needs(tmp_path):
    """``orchestrator --version``: exit 0 and one line with the versions pip installed of the
    orchestrator and of what decides what a sweep does (Ray, PyTorch, MLflow), and Python's."""
    from importlib.metadata import version

    proc = run([installed_command(), "--version"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        f"orchestrator {version('memory-aware-orchestrator')} (ray {version('ray')}, torch {version('torch')}, "
        f"mlflow {version('mlflow')}, Python {sys.version.split()[0]})\n"
    )
    assert proc.stderr == ""


EXITS_THROUGH_ENTRY = """
import atexit, gc, sys
from orchestrator.cli import entry
from orchestrator.garbage import YOUNG_THRESHOLD
atexit.register(lambda: print("exit handler ran; threshold:", gc.get_threshold()[0] == YOUNG_THRESHOLD,
                              "frozen:", gc.get_freeze_count() > 0))
sys.argv = ["orchestrator", "report", "nosuch", "--tracking-uri", "sqlite:///none.db"]
raise SystemExit(entry())
"""


def test_the_command_exits_with_main_s_status_its_exit_handlers_run_and_its_objects_skip_the_last_collection(tmp_path):
    """The installed command (``orchestrator.cli:entry``) returns what ``main`` returns. It runs
    with fewer garbage collections than Python's default, and afterwards it leaves the objects
    torch, Ray and MLflow made out of the interpreter's final collection (that one's ~1.2 s at
    exit, and the 9 full collections the demo's start paid: ``bench/RESULTS.md``). Exit
    handlers, which close what must be closed, still run."""
    proc = run([sys.executable, "-c", EXITS_THROUGH_ENTRY], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no MLflow database"), proc.stderr
    assert proc.stdout == "exit handler ran; threshold: True frozen: True\n"
    assert not (tmp_path / "none.db").exists()


@pytest.mark.parametrize("pipe", ["| head -1", "2>&1 | true"])
def test_a_reader_that_leaves_early_ends_plan_quietly(pipe, tmp_path):
    """``plan ... | head -1`` (the reader leaves after the first line) and ``| true`` (it leaves
    before plan writes anything, also its progress on stderr): no BrokenPipeError traceback,
    and plan's own exit status."""
    line = f"{shlex.quote(installed_command())} plan {shlex.quote(str(ROOT / 'configs' / 'demo_cpu.yaml'))} {pipe}"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=tmp_path, env=command_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr[-3000:]
    if pipe.startswith("| head"):
        assert proc.stdout.startswith("target cpu, budget unbounded") and proc.stdout.count("\n") == 1


PRINTS_A_LINE_AND_WAITS = """
import sys
from orchestrator.cli import lines_as_printed, quiet_when_the_reader_leaves
lines_as_printed()
quiet_when_the_reader_leaves()
print("Ray: 1 node(s), 2 CPUs, 0 GPUs")
sys.stdin.readline()
print("done")
"""


@pytest.mark.parametrize("into", ["pipe", "file"])
def test_a_line_reaches_a_pipe_or_a_log_file_when_it_is_printed(into, tmp_path):
    """``run ... | tee log`` and a SLURM job's log: a line is there as soon as the command prints
    it, not once 8 KiB have gathered or the command exits (the cluster's line waited for the
    first trial event; the dashboard's address would too)."""
    log = tmp_path / "log"
    env = command_env()
    env.pop("PYTHONUNBUFFERED", None)  # Python's default, as most shells have it
    with open(log, "w") as file:
        proc = subprocess.Popen([sys.executable, "-c", PRINTS_A_LINE_AND_WAITS], cwd=tmp_path, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE if into == "pipe" else file, text=True)
        try:
            if into == "pipe":  # the child waits for stdin: a line now came before its exit
                first = proc.stdout.readline() if select.select([proc.stdout], [], [], 20)[0] else ""
            else:
                deadline = time.monotonic() + 20
                while not log.read_text() and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                first = log.read_text()
            assert first == "Ray: 1 node(s), 2 CPUs, 0 GPUs\n" and proc.poll() is None
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if into == "file":
        assert log.read_text().endswith("done\n")


PRINTS_UNTIL_CTRL_C = """
import sys
from orchestrator.cli import quiet_when_the_reader_leaves
quiet_when_the_reader_leaves()
try:
    for number in range(10**9):
        print(f"line {number}", flush=True)
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
"""


def test_a_ctrl_c_as_a_line_goes_out_leaves_it_written_once(tmp_path):
    """A Ctrl-C that lands while a line is written to a pipe (under load, the test's SIGINT to
    ``run --address`` at its 'Uploading' line did) must not leave that line buffered, to be
    written a second time at exit. Writing the pipe from a Python method did so in 3 runs of 4."""
    for _ in range(30):
        proc = subprocess.Popen([sys.executable, "-c", PRINTS_UNTIL_CTRL_C], cwd=tmp_path, env=command_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _, out = interrupted_at(proc, "line 3")
        lines = [line for line in out.splitlines() if line.startswith("line ")]
        assert len(lines) == len(set(lines)), out[-2000:]
        assert "interrupted" in out and "Traceback" not in out, out[-2000:]


def _checkpointed_epochs(folder: Path) -> dict[str, int]:
    """The epoch of the newest checkpoint Tune has of each trial that has one, by trial folder:
    the epoch its results carry a checkpoint at last (``checkpoint_dir_name``)."""
    reported = trial_results(f"{folder}/orchestrator_results/wide_*/*/result.json")
    checkpointed = {trial: [line["epoch"] for line in lines if line.get("checkpoint_dir_name")]
                    for trial, lines in reported.items()}
    return {trial: epochs[-1] for trial, epochs in checkpointed.items() if epochs}


@pytest.mark.integration
def test_ctrl_c_then_the_printed_command_resumes_where_the_trials_were(own_model_project):
    """Ctrl-C (SIGINT to the command's process group, as a terminal sends it) once both trials
    have handed a checkpoint to Tune, then the resume command the sweep printed: each trial
    continues from that checkpoint on the same machine, so MLflow has every epoch once, the
    trials' results go on from the checkpoint's epoch (at the default cadence a trial hands one
    over at most every 10 s: the epochs since are trained again, not started over), and nothing
    says a trial moved (a restarted Ray's node has a new id but the same name)."""
    folder = own_model_project.folder
    (folder / "my_models" / "paced.py").write_text(PACED)
    # Typed as the README's setup leaves it: the venv's script by a relative path, not on PATH.
    typed = os.path.relpath(installed_command(), folder)
    user = command_env(venv_on_path=False)
    # 40 epochs of half a second or more: a trial's first hand-over, 10 s in, comes mid-trial.
    epochs = 40
    command = [typed, *own_model_project.command("run")[1:],
               "--set", "workload.name=my_models.paced:PacedWideNet", "--set", f"stop.epochs={epochs}",
               "--num-cpus", "2"]
    sweep = subprocess.Popen(command, cwd=folder, env=user, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while sweep.poll() is None and time.monotonic() < deadline:
            if len(_checkpointed_epochs(folder)) == 2:
                break
            time.sleep(0.2)
        assert sweep.poll() is None, "the sweep ended before both trials had a checkpoint"
        os.killpg(sweep.pid, signal.SIGINT)
        out, _ = sweep.communicate(timeout=300)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode == 1 and "0/2 trials finished" in out, out[-3000:]
    assert out.count("INTERRUPTED") >= 2
    [printed] = re.findall(r"^Interrupted trials continue from their last checkpoints with: (.*)$", out, re.M)
    resume = shlex.split(printed)
    assert resume[0] == typed and resume[-1] == "--resume" and "--num-cpus" in resume
    reported_at = {trial: len(lines) for trial, lines in
                   trial_results(f"{folder}/orchestrator_results/wide_*/*/result.json").items()}
    checkpointed_at = _checkpointed_epochs(folder)
    assert max(checkpointed_at.values()) < epochs, checkpointed_at

    # Pasted into the same shell as printed.
    proc = subprocess.run(printed, shell=True, cwd=folder, env=unpaced(user), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("trial  "):]
    assert "2/2 trials finished" in table and table.count("TERMINATED") == 2
    assert table.splitlines()[0].split()[:2] == ["trial", "config"] and " moved " not in table  # one node, no moves
    for trial, lines in trial_results(f"{folder}/orchestrator_results/wide_*/*/result.json").items():
        before, after = reported_at[trial], checkpointed_at[trial]
        assert [line["epoch"] for line in lines] == [*range(1, before + 1), *range(after + 1, epochs + 1)], (
            trial, before, after)  # continued from its checkpoint, not started over

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{folder}/mlflow.db")
    [experiment] = [e for e in client.search_experiments() if e.name == "wide"]
    runs = [r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get("orchestrator.role") == "trial"]
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    for r in runs:
        assert sorted(m.value for m in client.get_metric_history(r.info.run_id, "epoch")) == list(range(1, epochs + 1))
        assert "moves" not in r.data.tags


def test_a_second_ctrl_c_stops_at_once_with_the_resume_command_last_and_the_runs_killed(own_model_project):
    """Two Ctrl-Cs, half a second apart, once the trials train: Tune stops at once. The last line
    is the command that continues this sweep, nothing after it; MLflow's runs end KILLED, as one
    Ctrl-C leaves them, not RUNNING (which ``report`` reads as a sweep still running)."""
    import mlflow

    from orchestrator.tracking.runs import EXPERIMENT_PATH_TAG, PARENT_TAG

    folder = own_model_project.folder
    (folder / "my_models" / "paced.py").write_text(PACED)
    command = [*own_model_project.command("run"), "--set", "workload.name=my_models.paced:PacedWideNet",
               "--set", "stop.epochs=40", "--num-cpus", "2"]
    sweep = subprocess.Popen(command, cwd=folder, env=command_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = lines_until(sweep, " plan: ")
        os.killpg(sweep.pid, signal.SIGINT)
        time.sleep(0.5)
        os.killpg(sweep.pid, signal.SIGINT)
        rest, _ = sweep.communicate(timeout=120)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    out = "".join(lines) + rest
    assert sweep.returncode == 130, out[-3000:]
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("Interrupted. Continue the sweep with: "), out[-3000:]
    name = shlex.split(last)[shlex.split(last).index("--name") + 1]

    client = mlflow.MlflowClient(f"sqlite:///{folder}/mlflow.db")
    [parent] = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
                if r.data.tags.get(EXPERIMENT_PATH_TAG, "").endswith(name)]
    trials = [r for r in client.search_runs([parent.info.experiment_id]) if r.data.tags.get(PARENT_TAG) == parent.info.run_id]
    assert trials and {r.info.status for r in [parent, *trials]} == {"KILLED"}, [r.info.status for r in [parent, *trials]]


# -- stopped or killed, then resumed: sweeps whose evaluations and checkpoints count steps -------

# Evaluations every 50 steps, checkpoints every 20 (so most reports are checkpoint-only ones,
# without the metric), a budget in steps: the README's PacedWideNet, 32 steps an epoch.
STEP_SWEEP = """\
experiment: steps
workload: {name: my_models.paced:PacedWideNet}
search_space:
  hidden: {grid: [256, 1024]}
effective_batch_size: 128
stop: {steps: 150}
eval_every: {steps: 50}
checkpoint: {every: {steps: 20}}
metric: eval_loss
resources: {cpu: 1, gpu: 0}
"""
# The steps each trial reports at: every checkpoint and every evaluation, the last step once.
STEP_REPORTS = sorted({*range(20, 151, 20), *range(50, 151, 50), 150})
# ASHA's rungs by steps (40 and 80), apart from both cadences.
ASHA_BY_STEPS = ("--set", "scheduler.type=asha", "--set", "scheduler.time_attr=step",
                 "--set", "scheduler.grace_period=40")
# Evaluations and checkpoints by the clock (every 1.2 s and 0.6 s: some 15 and 8 steps), apart.
BY_THE_CLOCK = ("--set", "eval_every={minutes: 0.02}", "--set", "checkpoint.every={minutes: 0.01}")
# Each trial a data-parallel group of two ranks (64 samples a rank a step): four CPUs for both.
DATA_PARALLEL = ("--set", "resources.workers=2")


@pytest.fixture
def step_sweep(own_model_project) -> Path:
    """The README's own-model folder with a paced WideNet and ``steps.yaml`` (STEP_SWEEP): about
    80 ms a step, so a trial trains for some 15 s, long enough for both trials to checkpoint before
    either ends however slowly the second one's worker starts."""
    folder = own_model_project.folder
    (folder / "my_models" / "paced.py").write_text(PACED.replace('"0.015"', '"0.08"'))
    (folder / "steps.yaml").write_text(STEP_SWEEP)
    return folder


def _run_steps(name: str, *extra: str, resume: bool = False) -> list[str]:
    """``run steps.yaml`` as the sweep prints its resume command (flags in that order); a sweep of
    data-parallel groups gets CPUs for both trials' ranks."""
    cpus = "4" if extra == DATA_PARALLEL else "2"
    command = [installed_command(), "run", "steps.yaml", *extra, "--num-cpus", cpus, "--name", name]
    return command + ["--resume"] if resume else command


def _stopped_midway(folder: Path, command: list[str], stop) -> str:
    """Start the sweep in a session of its own, call ``stop(process)`` once every trial has a
    checkpoint (and none has reached its last step), and return what it printed."""
    sweep = subprocess.Popen(command, cwd=folder, env=command_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    pattern = f"{folder}/orchestrator_results/{command[command.index('--name') + 1]}/*/result.json"
    try:
        deadline = time.monotonic() + 400
        while sweep.poll() is None and time.monotonic() < deadline:
            reported = trial_results(pattern)
            if len(reported) == 2 and all(glob.glob(f"{trial}/checkpoint_*") for trial in reported):
                break
            time.sleep(0.2)
        assert sweep.poll() is None, "the sweep ended before every trial had a checkpoint"
        assert max(lines[-1]["step"] for lines in trial_results(pattern).values()) < 150
        stop(sweep)
        out, _ = sweep.communicate(timeout=300)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
            sweep.wait()
    return out


def _trial_histories(folder: Path, name: str, metrics=("step", "epoch", "train_loss", "eval_loss")):
    """The MLflow runs of sweep ``name``'s trials, by their ``hidden``: status and each metric's
    (step, value) history in step order."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{folder}/mlflow.db")
    [experiment] = [e for e in client.search_experiments() if e.name == "steps"]
    found = {}
    for run in client.search_runs([experiment.experiment_id]):
        if run.data.tags.get("orchestrator.role") == "trial" and f"/{name}/" in run.data.tags.get("tune.trial_path", ""):
            history = {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
                       for key in metrics}
            assert run.data.params["config.hidden"] not in found, "a trial has two MLflow runs"
            found[run.data.params["config.hidden"]] = (run.info.status, history)
    return found


def _sweep_run_statuses(folder: Path, name: str) -> list[str]:
    """The statuses of the MLflow sweep (parent) runs of sweep ``name``: one, however often it was resumed."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{folder}/mlflow.db")
    [experiment] = [e for e in client.search_experiments() if e.name == "steps"]
    return [run.info.status for run in client.search_runs([experiment.experiment_id], "tags.`orchestrator.role` = 'sweep'")
            if run.data.tags.get("tune.experiment_path", "").endswith(f"/{name}")]


def _assert_resumes_to_the_end(folder: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    """``run ... --name NAME --resume`` finishes every trial, prints no traceback, and MLflow has
    each trial's reports once, in the one run each trial and the sweep had before. Unpaced (the
    rest of the trials at full speed), except a sweep whose reports come by the clock."""
    env = command_env() if extra == BY_THE_CLOCK else unpaced()
    proc = run(_run_steps(name, *extra, resume=True), folder, timeout=600, env=env)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert "Traceback" not in said and "Error" not in said, said[-3000:]
    assert f"Resuming {folder}/orchestrator_results/{name}" in proc.stdout
    assert "2/2 trials finished" in proc.stdout
    for hidden, (status, history) in _trial_histories(folder, name).items():
        assert status == "FINISHED", hidden
        steps = [step for step, _ in history["step"]]
        assert steps == sorted(set(steps)), (hidden, steps)  # each report once
    assert _sweep_run_statuses(folder, name) == ["FINISHED"]
    return proc


@pytest.mark.integration
@pytest.mark.parametrize("signum, extra", [
    (signal.SIGINT, ()),
    (signal.SIGTERM, ()),
    (signal.SIGTERM, ASHA_BY_STEPS),
    ("SIGTERM to the group", ()),
    (signal.SIGTERM, BY_THE_CLOCK),
    (signal.SIGINT, DATA_PARALLEL),
], ids=["sigint", "sigterm", "sigterm-asha-by-steps", "sigterm-to-the-group", "sigterm-by-the-clock",
        "sigint-data-parallel"])
def test_a_step_cadence_sweep_stopped_by_a_signal_resumes_with_the_printed_command(step_sweep, signum, extra):
    """SIGINT to the process group (Ctrl-C in a terminal), SIGTERM to the driver alone (``kill``)
    and to its whole process group (SLURM, Kubernetes: the embedded Ray's processes are not in it,
    so they live on until the driver stops them): the same graceful stop, the table with both trials INTERRUPTED, the
    resume command, MLflow's runs marked KILLED, exit 1 and no stack dump. The printed command
    then resumes the sweep, whose checkpoint-only reports lack the metric, to the end: evaluations
    and checkpoints by steps (with ASHA's rungs by steps too) or by the clock, and trials that are
    data-parallel groups."""
    def stop(sweep):
        if signum == signal.SIGINT:
            os.killpg(sweep.pid, signal.SIGINT)
        elif signum == "SIGTERM to the group":
            os.killpg(sweep.pid, signal.SIGTERM)
        else:
            sweep.send_signal(signum)

    out = _stopped_midway(step_sweep, _run_steps("cut", *extra), stop)
    assert "Traceback" not in out, out[-3000:]
    assert "0/2 trials finished" in out and out.count("INTERRUPTED") >= 2, out[-3000:]
    [printed] = re.findall(r"^Interrupted trials continue from their last checkpoints with: (.*)$", out, re.M)
    assert shlex.split(printed)[1:] == _run_steps("cut", *extra, resume=True)[1:]
    assert {status for status, _ in _trial_histories(step_sweep, "cut").values()} == {"KILLED"}

    proc = _assert_resumes_to_the_end(step_sweep, "cut", *extra)
    if extra == DATA_PARALLEL:
        rows = [line for line in proc.stdout.splitlines() if line.endswith(" TERMINATED")]
        assert len(rows) == 2 and all(" x 2 ranks " in row for row in rows), proc.stdout[-3000:]  # groups' plans
    if extra != ASHA_BY_STEPS:  # ASHA may stop a trial at a rung
        assert rows_trained(proc.stdout, "150/150 steps") == 2
        for hidden, (_, history) in _trial_histories(step_sweep, "cut").items():
            steps = [step for step, _ in history["step"]]
            if extra == BY_THE_CLOCK:  # the reports' steps are the clock's
                assert steps[-1] == 150, (hidden, steps)
            else:
                assert steps == STEP_REPORTS, (hidden, steps)


@pytest.mark.integration
@pytest.mark.parametrize("extra", [(), DATA_PARALLEL], ids=["one-process-trials", "data-parallel"])
def test_a_killed_driver_resumes_to_the_losses_of_an_uninterrupted_sweep(step_sweep, extra):
    """``kill -9`` of the driver mid-sweep (no graceful stop: Tune's state is what it saved last,
    the MLflow runs stay RUNNING), then ``--resume``: no traceback, every step's report in MLflow
    once, and the same losses at every step as a sweep that ran through; also where each trial
    is a data-parallel group whose ranks lose their driver."""
    whole = run(_run_steps("whole", *extra), step_sweep, timeout=600, env=unpaced())  # nothing stops it: no pace needed
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]

    def kill_the_driver(sweep):
        sweep.kill()
        sweep.wait()
        # Then its group, as a batch system would: empty where the driver spawned nothing (its
        # estimates made in its own thread; Ray's processes are in a group of their own).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sweep.pid, signal.SIGKILL)

    _stopped_midway(step_sweep, _run_steps("cut", *extra), kill_the_driver)
    assert {status for status, _ in _trial_histories(step_sweep, "cut").values()} == {"RUNNING"}
    _assert_resumes_to_the_end(step_sweep, "cut", *extra)
    resumed, uninterrupted = _trial_histories(step_sweep, "cut"), _trial_histories(step_sweep, "whole")
    assert sorted(resumed) == sorted(uninterrupted) == ["1024", "256"]
    for hidden, (_, history) in resumed.items():
        assert [step for step, _ in history["step"]] == STEP_REPORTS, hidden
        assert history == uninterrupted[hidden][1], hidden
