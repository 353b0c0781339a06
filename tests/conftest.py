"""Fixtures shared by the test modules.

Every test runs with its own HOME, so Ray's auth token, MLflow's telemetry settings and
any cache land in a temporary folder instead of the user's home, and with its own Ray temp
root (``RAY_TMPDIR``), so the Rays the tests start leave no session in the machine's /tmp/ray, and
its own temp folder (``TMPDIR``), removed at the session's end with what killed processes left there.
``local_ray`` (an embedded Ray per module) and ``ray_head`` (one ``ray start --head`` per
session) start Ray; a test that uses them is marked ``integration``, so
``-m "not integration"`` starts no Ray and no server.
Tests write under temporary folders only: a run that leaves a file or folder in the checkout
fails, naming it (``pytest_sessionfinish``).

The README's own-model example is written out here as a user would copy it, for the tests
that run it with the installed ``orchestrator`` command.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def isolated_environment(tmp_path_factory, ray_temp_dir):
    home = tmp_path_factory.mktemp("home")
    saved = {k: os.environ.get(k)
             for k in ("HOME", "MLFLOW_DISABLE_TELEMETRY", "RAY_USAGE_STATS_ENABLED", "PATH", "RAY_TMPDIR",
                       "RAY_worker_niceness", "TMPDIR")}
    os.environ["HOME"] = str(home)
    # The temp folder of this process and of every process it starts: one of the session's,
    # removed at its end, so that what a killed process cannot remove (multiprocessing's pymp-*
    # folders of a SIGKILLed DataLoader worker, a killed trial's scratch folder) goes with the run
    # instead of piling up in /tmp. Short and in /tmp, as ray_temp_dir's are: sockets are made in it.
    temp = tempfile.mkdtemp(prefix="orch-tmp-", dir="/tmp")
    os.chmod(temp, 0o1777)  # as /tmp is: the PostgreSQL server a test starts as its own user makes its folder here
    os.environ["TMPDIR"] = temp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    # Ray's temp root for every Ray the tests start without a --temp-dir of their own (the
    # `orchestrator run`s in subprocesses, whose embedded Ray would use the machine's /tmp/ray):
    # their sessions go with the run instead of piling up there, and the user's own Ray keeps
    # its `session_latest`.
    os.environ["RAY_TMPDIR"] = str(ray_temp_dir("tests"))
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray runs its workers at nice 15 (so that its raylet stays responsive), which gives them a
    # fortieth of a core's time next to a nice-0 process. The suite's two xdist processes share
    # the cores: while one traced a model in-process, the other's trials ran ~40x slower (a torch
    # step 3 -> 123 ms), and a data-parallel sweep took the hang guard's 240 s (CI at bde835c).
    # At nice 0 the two share the cores evenly; no test is about the trials' priority.
    os.environ["RAY_worker_niceness"] = "0"
    # Subprocesses (Ray workers, `orchestrator` CLI) must find this venv's executables first.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    yield home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    tempfile.tempdir = None
    shutil.rmtree(temp, ignore_errors=True)


# -- the checkout, as the suite found it --------------------------------------------------------
#: What a run of the suite may add to the checkout: Python's and pytest's own caches.
LEFT_BY_PYTHON = ("__pycache__/", ".pytest_cache/")
_CHECKOUT_BEFORE = pytest.StashKey[set]()
_CHECKOUT_ADDED = pytest.StashKey[list]()


def checkout_additions() -> set[str] | None:
    """The untracked and ignored paths of the checkout as ``git status`` lists them (a new folder
    as one entry), less Python's caches; None where the tests do not run from a git checkout."""
    try:
        listed = subprocess.run(["git", "status", "--porcelain", "--ignored", "-z"], cwd=ROOT, capture_output=True,
                                text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if listed.returncode != 0:
        return None
    paths = {entry[3:] for entry in listed.stdout.split("\0") if entry[:2] in ("??", "!!")}
    return {path for path in paths if not path.endswith(LEFT_BY_PYTHON)}


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the process that runs the tests or hands them out
        before = checkout_additions()
        if before is not None:
            session.config.stash[_CHECKOUT_BEFORE] = before


def pytest_sessionfinish(session, exitstatus):
    """Tests write under temporary folders only: whatever the run added to the checkout (an
    MLflow client's default ``./mlruns``, say) fails the run, and the summary names it."""
    before = session.config.stash.get(_CHECKOUT_BEFORE, None)
    after = checkout_additions() if before is not None else None
    if after is not None and after - before:
        session.config.stash[_CHECKOUT_ADDED] = sorted(after - before)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    added = config.stash.get(_CHECKOUT_ADDED, None)
    if added:
        terminalreporter.section("the checkout", red=True)
        terminalreporter.line(f"the test run wrote into the checkout ({ROOT}): {', '.join(added)}; "
                              "tests must write under temporary folders only", red=True)


@pytest.fixture(autouse=True)
def no_loopback_flag_left_behind():
    """``orchestrator.cli.main(["run", ...])`` called in-process sets Ray's one-machine flag in this
    process's environment, as the command does in its own; a later test's subprocesses (a Ray
    worker node, a SLURM job) must not inherit it."""
    from orchestrator.cli import RAY_CLUSTER_ENV

    before = os.environ.get(RAY_CLUSTER_ENV)
    yield
    if before is None:
        os.environ.pop(RAY_CLUSTER_ENV, None)
    else:
        os.environ[RAY_CLUSTER_ENV] = before


@pytest.fixture
def default_sigint():
    """SIGINT handled as in a fresh process (``KeyboardInterrupt``), whatever an earlier test left
    (Tune's own handler stays after a sweep run in-process); the handler before is put back after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="session")
def ray_temp_dir():
    """``ray_temp_dir(name)``: a short path for a Ray's ``--temp-dir`` (``_temp_dir``), in a new
    folder of its own; Ray (or ``start_head``) makes ``NAME`` itself.

    Ray's unix sockets live under it, and a socket's path may not exceed 107 bytes: pytest's own
    temporary folders leave too little room under pytest-xdist, which adds a folder per worker
    (``.../popen-gw0/``). So these are made in /tmp (``/tmp/orch-ray-XXXXXXXX/NAME``) and removed
    at the end of the session, after the Rays in them stopped."""
    made: list[str] = []

    def make(name: str) -> Path:
        made.append(tempfile.mkdtemp(prefix="orch-ray-", dir="/tmp"))
        return Path(made[-1]) / name

    yield make
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def local_ray(isolated_environment, ray_temp_dir):
    """An embedded Ray for the module's tests, set as ``run``'s; its workers import ``tests/``
    modules (fake trainables)."""
    import ray

    from orchestrator.ray_internals import LOCAL_RAY_SYSTEM_CONFIG, shut_down_local_ray

    ray.init(
        address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
        _temp_dir=str(ray_temp_dir("local")), _system_config=LOCAL_RAY_SYSTEM_CONFIG,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}},
    )
    yield
    shut_down_local_ray()


@pytest.fixture(scope="session")
def ray_head(isolated_environment, ray_temp_dir):
    """One ``ray start --head`` with the dashboard for the session (jobs, metrics, browser tests)."""
    from ray_cluster import start_head

    head = start_head(ray_temp_dir("head"))
    yield head
    head.stop()


@dataclass(frozen=True)
class OwnModelProject:
    """The README's "Your own model" files, written into a folder of their own."""

    folder: Path
    config: str  # the sweep file's name, relative to ``folder``
    commands: list[list[str]]  # the README's commands for it, split into words

    def command(self, verb: str) -> list[str]:
        """The README's ``orchestrator VERB ...`` line, with the installed script's full path."""
        [words] = [c for c in self.commands if c[1] == verb]
        return [installed_command(), *words[1:]]


def trial_results(pattern: str) -> dict[str, list[dict]]:
    """What each trial reported to Tune so far, by trial folder, for a glob of Tune's
    ``result.json`` files (one JSON object a line); a line still being written ends its list."""
    found = {}
    for path in glob.glob(pattern):
        lines = []
        for line in Path(path).read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                break
        if lines:
            found[os.path.dirname(path)] = lines
    return found


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_traced_as_measured_on_cpu(workload) -> None:
    """On the CPU the trace and torch's own real steps (counted by the tensor tracker) count the
    same tensors: at every batch size measured, each phase's allocated bytes agree exactly."""
    from orchestrator.device import CpuDevice
    from orchestrator.memory import estimate

    traced = estimate(workload, "trace", target="cpu")
    real = estimate(workload, "measured", target="cpu", device=CpuDevice())
    assert traced.estimator == "trace", traced.notes
    for fake, measured in zip(traced.phases, real.phases):
        for b, _ in measured.points:
            assert fake.allocated_at(b) == measured.allocated_at(b), (fake.name, b)


def installed_command() -> str:
    """The console script ``pip install`` made next to this Python, as a user's shell finds it."""
    script = Path(sys.executable).parent / "orchestrator"
    assert script.exists(), f"{script} is missing: install the project (pip install -e .) to test its command"
    return str(script)


def rows_trained(stdout: str, trained: str) -> int:
    """How many rows of ``run``'s final table (those that end in TERMINATED) say ``trained``
    (``150/150 steps``); the console's ``finished`` lines say it too, and are not counted."""
    return sum(trained in line for line in stdout.splitlines() if line.rstrip().endswith(" TERMINATED"))


def lines_until(run: subprocess.Popen, marker: str) -> list[str]:
    """What ``run`` printed up to its first line holding ``marker`` (all of it, if none does)."""
    lines = []
    for line in run.stdout:
        lines.append(line)
        if marker in line:
            break
    return lines


def interrupted_at(run: subprocess.Popen, prefix: str) -> tuple[str, str]:
    """Ctrl-C to ``run`` as soon as it prints a line starting with ``prefix``: that line, and all it printed."""
    lines = []
    for line in run.stdout:
        lines.append(line)
        if line.startswith(prefix):
            break
    run.send_signal(signal.SIGINT)
    # Read on while it stops: a process that still prints once the pipe is full blocks until it
    # is read, so waiting for its exit first waited for ever (the 60 s limit, then a kill). Not
    # communicate(timeout=...): it reads the pipe under the text stream, and would drop what the
    # stream had already read ahead of the line.
    stuck = threading.Event()
    watchdog = threading.Timer(60, lambda: (stuck.set(), run.kill()))
    watchdog.start()
    try:
        rest = run.stdout.read()
        run.wait()
    finally:
        watchdog.cancel()
    assert not stuck.is_set(), f"still running 60 s after Ctrl-C: {''.join(lines)[-2000:]}{rest[-2000:]}"
    return lines[-1], "".join(lines) + rest


def command_env(venv_on_path: bool = True) -> dict[str, str]:
    """The environment of a user's shell: nothing puts the project or the working directory on
    Python's path, so the command must find the user's package itself. ``venv_on_path=False``:
    the venv not activated either, as the README's setup leaves it (``orchestrator`` is then
    only ``.venv/bin/orchestrator``)."""
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("PYTHONPATH", None)
    env.pop("RAY_AUTH_MODE", None)  # a Ray started in this process set it here; a user's shell has none
    if not venv_on_path:
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    return env


@pytest.fixture
def own_model_project(tmp_path_factory) -> OwnModelProject:
    """The files of the README's own-model example, each written to the path its first line
    names (``# my_models/wide.py``), in a temporary folder outside the repository; and the
    README's commands for them."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Your own model"):]
    section = section[: section.index("\n## ")]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    folder = tmp_path_factory.mktemp("own_model")
    config = None
    for language, text in blocks:
        named = re.match(r"# ([\w./-]+\.(?:py|yaml))\b", text)
        if language in ("python", "yaml") and named:
            path = folder / named.group(1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            if language == "yaml":
                config = named.group(1)
    commands = [line.split("#")[0].split() for language, text in blocks if language == "bash"
                for line in text.splitlines() if line.startswith("orchestrator ")]
    assert config and (folder / "my_models" / "wide.py").exists(), "the README's own-model files are missing"
    assert commands, "the README shows no orchestrator command for its own-model example"
    return OwnModelProject(folder, config, commands)


@pytest.fixture
def trial_with_checkpoints():
    """A maker of a stub Tune trial whose checkpoint manager registered ``steps`` checkpoints
    (folders under ``folder``), keeping ``keep``, as Tune's controller does; it returns the trial
    and a maker of its next checkpoint."""
    from ray.train import Checkpoint, CheckpointConfig
    from ray.train._internal.session import _TrainingResult
    from ray.tune.experiment import Trial

    def make(folder: Path, steps: int, keep: int = 2, status: str = "PENDING"):
        def checkpoint(step):
            made = folder / f"checkpoint_{step:06d}"
            made.mkdir(parents=True)
            return _TrainingResult(Checkpoint.from_directory(str(made)), {"training_iteration": step})

        trial = Trial("train_trial", config={}, trial_id=f"{folder.name}_00000", stub=True,
                      checkpoint_config=CheckpointConfig(num_to_keep=keep))
        trial.set_status(status)
        for step in range(steps):
            trial.run_metadata.checkpoint_manager.register_checkpoint(checkpoint(step))
        return trial, checkpoint

    return make


def kept_checkpoints(trial) -> list[str]:
    """The folder names of the checkpoints Tune keeps for ``trial``, oldest first."""
    return [os.path.basename(r.checkpoint.path) for r in trial.run_metadata.checkpoint_manager._checkpoint_results]
