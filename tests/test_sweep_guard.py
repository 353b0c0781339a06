"""orchestrator.sweep_guard: one driver per sweep folder, and a resume runs the stored config.

The unit tests claim folders in this process (an ``flock`` taken through another open of the
file conflicts, as another driver's would); the integration tests run the installed command
from a user's folder: a second driver of a running sweep refused, a killed driver's lock gone
with it, a resume with a changed config refused naming the key or accepted with the flag.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from orchestrator.config import parse_spec
from orchestrator.errors import UserError
from orchestrator.cores import usable_cores
from orchestrator.sweep_guard import CONFIG_FILE, LOCK_FILE, changed_keys, claim_sweep, config_values
from tests.conftest import alive

RAW = {
    "experiment": "guard",
    "workload": {"name": "mlp", "params": {"depth": 2}},
    "search_space": {"lr": {"grid": [0.01, 0.1]}},
    "effective_batch_size": 32,
    "stop": {"epochs": 2},
}


STORE = "sqlite:////sweeps/mlflow.db"  # the MLflow store a started sweep records


def spec(**changes):
    return parse_spec({**RAW, **changes})


def test_the_config_is_compared_by_the_key_paths_a_user_writes():
    values = config_values(spec())
    assert values["workload.name"] == "mlp" and values["workload.params.depth"] == 2
    assert values["stop.epochs"] == 2 and "memory.estimator" in values  # defaults filled in
    changed = spec(workload={"name": "mlp", "params": {"depth": 3}}, stop={"epochs": 2, "steps": 100})
    assert changed_keys(values, config_values(changed)) == ["stop.steps", "workload.params.depth"]


def test_a_key_written_with_its_default_value_is_no_change():
    assert changed_keys(config_values(spec()), config_values(spec(seed=0, max_failures=0))) == []


def test_a_second_claim_of_a_claimed_sweep_is_refused_in_one_line(tmp_path):
    folder = str(tmp_path / "sweep")
    first = claim_sweep(folder, spec(), resuming=False)
    with pytest.raises(UserError) as refused:
        claim_sweep(folder, spec(), resuming=True)
    message = str(refused.value)
    assert "\n" not in message
    assert f"sweep {folder} is already running (driver pid {os.getpid()})" in message and "--resume" in message
    first.release()
    assert not os.path.exists(os.path.join(folder, LOCK_FILE))
    claim_sweep(folder, spec(), resuming=True).release()


def test_a_driver_killed_holding_the_lock_does_not_block_the_next(tmp_path):
    """The kernel drops a dead process's flock: no stale lock file to clean up by hand."""
    folder = str(tmp_path / "sweep")
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from orchestrator.config import parse_spec
            from orchestrator.sweep_guard import claim_sweep
            claim_sweep({folder!r}, parse_spec({RAW!r}), resuming=False)
            print("held", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"driver pid {holder.pid}"):
            claim_sweep(folder, spec(), resuming=False)
    finally:
        holder.kill()
        holder.wait()
    assert os.path.exists(os.path.join(folder, LOCK_FILE))  # left by the killed driver, and harmless
    claim_sweep(folder, spec(), resuming=True).release()


def test_a_new_sweep_in_the_folder_of_a_started_one_is_refused_and_leaves_it_as_it_was(tmp_path):
    """`run --name taken` without --resume: one line, and the first sweep's folder untouched. A
    --resume that found nothing to restore (``new`` false) may start the sweep there again."""
    folder = str(tmp_path / "sweep")
    started = claim_sweep(folder, spec(), resuming=False, new=True)
    started.record(spec(), STORE)
    started.release()
    before = sorted(os.listdir(folder))
    with pytest.raises(UserError) as refused:
        claim_sweep(folder, spec(), resuming=False, new=True)
    assert str(refused.value) == (
        f"sweep {folder} already exists; continue it with --resume, or start a new sweep with another --name"
    )
    assert sorted(os.listdir(folder)) == before == [CONFIG_FILE]
    claim_sweep(folder, spec(), resuming=False).release()


def test_a_resume_with_a_changed_config_is_refused_naming_the_keys(tmp_path):
    folder = str(tmp_path / "sweep")
    started = claim_sweep(folder, spec(), resuming=False)
    started.record(spec(), STORE)
    started.release()
    changed = spec(workload={"name": "mlp", "params": {"depth": 3}})
    with pytest.raises(UserError) as refused:
        claim_sweep(folder, changed, resuming=True)
    assert str(refused.value) == (
        f"--resume: the config differs from the one {folder} was started with in workload.params.depth (2 -> 3); "
        "resume with the same config, start a new sweep (another --name), or pass --allow-config-change"
    )
    assert not os.path.exists(os.path.join(folder, LOCK_FILE))  # the refused driver let go
    claim_sweep(folder, spec(storage_path=str(tmp_path / "moved")), resuming=True).release()  # may change


def test_allow_config_change_resumes_and_says_what_changed(tmp_path, capsys):
    folder = str(tmp_path / "sweep")
    started = claim_sweep(folder, spec(), resuming=False)
    started.record(spec(), STORE)
    started.release()
    claim = claim_sweep(folder, spec(stop={"epochs": 4}), resuming=True, allow_config_change=True)
    assert "--allow-config-change): stop.epochs (2 -> 4)" in capsys.readouterr().out
    claim.record(spec(stop={"epochs": 4}), STORE)
    claim.release()
    claim_sweep(folder, spec(stop={"epochs": 4}), resuming=True).release()  # the next resume compares with it


def test_a_sweep_kept_before_its_config_was_resumes_unchecked(tmp_path):
    folder = tmp_path / "sweep"
    folder.mkdir()
    claim_sweep(str(folder), spec(stop={"epochs": 9}), resuming=True).release()
    assert not (folder / CONFIG_FILE).exists()


def test_a_refused_claim_takes_back_the_folder_it_made(tmp_path):
    """With what the driver wrote in it before the sweep started (stopped while Tune made its
    Tuner: the config, ``tuner.pkl``); a folder that was there keeps what it held."""
    folder = tmp_path / "new"
    claim_sweep(str(folder), spec(), resuming=False).release(refused=True)
    assert not folder.exists()
    claim = claim_sweep(str(folder), spec(), resuming=False)
    claim.record(spec(), "sqlite:///mlflow.db")
    (folder / "tuner.pkl").write_bytes(b"Tune's")
    claim.release(refused=True)
    assert not folder.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "tuner.pkl").write_bytes(b"an earlier sweep's")
    claim_sweep(str(kept), spec(), resuming=True).release(refused=True)
    assert sorted(p.name for p in kept.iterdir()) == ["tuner.pkl"]


def test_a_name_of_our_own_that_another_sweep_has_becomes_the_next_free_one(tmp_path):
    """A default name (the experiment and the second): sweeps started in one second each get a
    folder, ``name``, ``name_2``, ..., where a name the user gave would be refused."""
    folder = str(tmp_path / "exp_20261206-011532")
    first = claim_sweep(folder, spec(), resuming=False, new=True, named=False)
    second = claim_sweep(folder, spec(), resuming=False, new=True, named=False)
    assert (first.folder, second.folder) == (folder, f"{folder}_2")
    first.record(spec(), STORE)
    first.release()
    third = claim_sweep(folder, spec(), resuming=False, new=True, named=False)  # a finished sweep has it too
    assert third.folder == f"{folder}_3"
    third.release(refused=True)  # refused: the folder it made goes
    second.release(refused=True)
    assert sorted(os.listdir(tmp_path)) == ["exp_20261206-011532"]


def test_claims_of_one_name_of_our_own_at_once_each_get_a_folder(tmp_path):
    folder = str(tmp_path / "exp_20261206-011532")
    start = threading.Barrier(8)

    def claim(_):
        start.wait()
        return claim_sweep(folder, spec(), resuming=False, new=True, named=False)

    with ThreadPoolExecutor(8) as pool:
        claims = list(pool.map(claim, range(8)))
    assert sorted(c.folder for c in claims) == sorted([folder] + [f"{folder}_{n}" for n in range(2, 9)])
    for c in claims:
        c.release()


# -- the installed command, from a user's folder ---------------------------------------------

TINY_MODEL = '''
import dataclasses
import multiprocessing
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from trainables import Workload


@dataclasses.dataclass
class Tiny(Workload):
    hidden: int = 8

    def build_model(self):
        estimating = multiprocessing.parent_process() is not None or threading.current_thread().name.startswith("estimate")
        if estimating and os.environ.get("SLOW_ESTIMATES"):
            # an estimate (a spawned process's, or the driver's estimate thread's) that takes its time, and says so
            with open(os.path.join(os.environ["SLOW_ESTIMATES"], str(os.getpid())), "a") as mark:
                mark.write(f"hidden={self.hidden}\\n")
            time.sleep(float(os.environ.get("SLOW_ESTIMATES_S", "600")))
        return torch.nn.Sequential(torch.nn.Linear(4, self.hidden), torch.nn.ReLU(), torch.nn.Linear(self.hidden, 2))

    def train_data(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, (x[:, 0] > 0).long())

    def eval_data(self):
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
        return TensorDataset(x, (x[:, 0] > 0).long())

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)
'''

TINY_SWEEP = """
experiment: tiny
workload: {name: my_models.tiny:Tiny, params: {hidden: 8}}
search_space:
  lr: {grid: [0.01]}
effective_batch_size: 32
stop: {epochs: 1}
resources: {cpu: 1, gpu: 0}
"""

#: Two memory signatures (hidden 8 and 16): two estimate processes where there are three usable
#: cores or more, the driver's own thread on two (``orchestrator.estimates``).
TWO_ESTIMATES = TINY_SWEEP.replace("lr: {grid: [0.01]}", "hidden: {grid: [8, 16]}")


@pytest.fixture
def user_folder(tmp_path):
    (tmp_path / "my_models").mkdir()
    (tmp_path / "my_models" / "__init__.py").write_text("")
    (tmp_path / "my_models" / "tiny.py").write_text(TINY_MODEL)
    (tmp_path / "sweep.yaml").write_text(TINY_SWEEP)
    (tmp_path / "two.yaml").write_text(TWO_ESTIMATES)
    return tmp_path


def children(pid: int) -> dict[int, str]:
    """The live descendants of ``pid`` (from /proc), with their command lines."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                found[child] = command_line(child)
                todo.append(child)
    return found


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def estimate_processes(driver: subprocess.Popen, marks: Path, timeout: float = 180) -> list[int]:
    """The driver's spawned estimate processes, once both are in their estimate (each leaves a
    file named for its pid in ``marks``); none where the driver estimates in its own thread (two
    usable cores), once that thread is in its estimate."""
    spawns = usable_cores() > 2
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert driver.poll() is None, driver.communicate()[0][-3000:]
        marked = {int(p.name) for p in marks.iterdir()}
        if spawns and len(spawned := marked & set(children(driver.pid))) >= 2:
            return sorted(spawned)
        if not spawns and driver.pid in marked:
            assert not marked & set(children(driver.pid)), "an estimate process on two cores"
            return []
        time.sleep(0.5)
    raise AssertionError(f"no estimate under way after {timeout} s: {children(driver.pid)}")


def kill_driver_and_wait_for(driver: subprocess.Popen, estimates: list[int]) -> None:
    """kill -9 the driver: its estimate processes, if it has any, are gone within seconds (they
    would run on for minutes), and so, soon after, is every other process of ours it started (multiprocessing's
    resource tracker). Ray's own processes are Ray's to end (its agents notice their raylet gone
    within about a minute and a half): they are killed here, not asserted on."""
    started = children(driver.pid)
    ours = [p for p, line in started.items() if not ("ray::" in line or "/ray/" in line)]
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    try:
        for pids, within in ((estimates, 10), (ours, 30)):
            deadline = time.monotonic() + within
            while any(alive(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.2)
            left = {p: command_line(p) for p in pids if alive(p)}
            assert not left, f"processes outlived their killed driver by {within} s: {left}"
    finally:
        for p in started:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.integration
def test_a_running_sweep_is_not_run_twice_and_its_killed_driver_takes_its_estimates_along(user_folder):
    """`run --name same` while a driver runs it: one line, exit 2, before Ray starts. kill -9 of
    that driver during its estimates: the estimate processes (where it spawns them) die with it,
    and the `--resume` that follows is not blocked by the dead driver's lock."""
    from tests.conftest import command_env, installed_command

    marks = user_folder / "estimating"
    marks.mkdir()
    env = {**command_env(), "SLOW_ESTIMATES": str(marks)}
    command = [installed_command(), "run", "two.yaml", "--name", "same", "--num-cpus", "2"]
    first = subprocess.Popen(command, cwd=user_folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        spawned = estimate_processes(first, marks)
        second = subprocess.run(command, cwd=user_folder, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert second.stderr.strip().splitlines() == [
            f"error: sweep {user_folder / 'orchestrator_results' / 'same'} is already running (driver pid {first.pid}); "
            "wait for it to end, or stop it and continue it with --resume; a new sweep needs another --name"
        ], second.stderr
        kill_driver_and_wait_for(first, spawned)

        resumed = subprocess.Popen(command + ["--resume"], cwd=user_folder, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            kill_driver_and_wait_for(resumed, estimate_processes(resumed, marks))  # it got past the lock
        finally:
            if resumed.poll() is None:
                os.killpg(resumed.pid, signal.SIGKILL)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)


@pytest.mark.integration
def test_a_ctrl_c_before_the_sweep_starts_leaves_no_folder_behind(user_folder):
    """Ctrl-C (SIGINT to the command's group, as a terminal sends it) while the driver estimates:
    the sweep never started, so neither its folder nor the storage folder made for it stays, and
    the command says to run it again, not to resume it. (The command waits for an estimate under
    way in its thread to end, 5 s here, and starts no other: the sweep has two.)"""
    from tests.conftest import command_env, installed_command

    marks = user_folder / "estimating"
    marks.mkdir()
    driver = subprocess.Popen([installed_command(), "run", "two.yaml", "--num-cpus", "2"], cwd=user_folder,
                              env={**command_env(), "SLOW_ESTIMATES": str(marks), "SLOW_ESTIMATES_S": "5"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        estimate_processes(driver, marks)
        os.killpg(driver.pid, signal.SIGINT)
        out, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode == 130, out
    assert not (user_folder / "orchestrator_results").exists(), out
    assert re.search(r"^Interrupted before the sweep started\. Run it again with: \S*orchestrator run two\.yaml --num-cpus 2$",
                     out, re.M), out
    assert "--resume" not in out and "Estimated the memory" not in out, out
    if usable_cores() <= 2:  # the estimates in the driver's thread, one after the other
        assert (marks / str(driver.pid)).read_text().count("hidden=") == 1


@pytest.mark.integration
def test_a_resume_with_a_changed_config_is_refused_unless_allowed(user_folder):
    """A sweep started with --tracking-uri: its --name again without --resume is refused in one
    line; a --resume with another config is refused naming the key, or with the flag resumes,
    and writes to (and names) the sweep's store although the resume did not name it; a resume
    that names another store writes there."""
    from tests.conftest import command_env, installed_command

    def run(*words):
        return subprocess.run([installed_command(), "run", "sweep.yaml", "--name", "s", "--num-cpus", "1", *words],
                              cwd=user_folder, env=command_env(), capture_output=True, text=True, timeout=600)

    done = run("--tracking-uri", "sqlite:///records.db")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    again = run()  # the same --name without --resume: not a second sweep over the first
    assert again.returncode == 2, again.stdout + again.stderr
    assert again.stderr.strip().splitlines() == [
        f"error: sweep {user_folder / 'orchestrator_results' / 's'} already exists; continue it with --resume, "
        "or start a new sweep with another --name"
    ]
    refused = run("--resume", "--set", "workload.params.hidden=16")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"error: --resume: the config differs from the one {user_folder / 'orchestrator_results' / 's'} was started "
        "with in workload.params.hidden (8 -> 16); resume with the same config, start a new sweep (another "
        "--name), or pass --allow-config-change"
    ]
    allowed = run("--resume", "--set", "workload.params.hidden=16", "--allow-config-change")
    assert allowed.returncode == 0, (allowed.stdout + allowed.stderr)[-3000:]
    assert "--allow-config-change): workload.params.hidden (8 -> 16)" in allowed.stdout
    store = f"sqlite:///{user_folder / 'records.db'}"
    last = allowed.stdout.strip().splitlines()[-1]
    assert last.startswith(f"MLflow: {store} (experiment 'tiny'); see `"), last
    assert last.endswith(f" report s --tracking-uri {store}`"), last
    assert not (user_folder / "mlflow.db").exists()

    # A resume that names another store (a server that moved) writes there, and says so.
    moved = run("--resume", "--set", "workload.params.hidden=16", "--tracking-uri", "sqlite:///moved.db")
    assert moved.returncode == 0, (moved.stdout + moved.stderr)[-3000:]
    elsewhere = f"sqlite:///{user_folder / 'moved.db'}"
    assert f"MLflow: this resume writes to {elsewhere} (--tracking-uri); the sweep so far is in {store}" in moved.stdout
    import mlflow

    assert mlflow.MlflowClient(elsewhere).get_experiment_by_name("tiny") is not None  # the restored callback's writes
