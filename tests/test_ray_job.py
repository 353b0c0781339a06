"""``orchestrator run CONFIG --address URL``: the sweep as a Ray Job on a running cluster.

The request is checked without Ray; the integration tests submit sweeps to a real
``ray start --head`` with token auth, through the CLI as a user would: the README's own-model
example with the installed command from its own folder, and the demo sweeps from the repository.
"""

from __future__ import annotations

import asyncio
import gc
import os
import shlex
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import requests
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.cli import build_parser, main
from orchestrator.config import load_spec
from orchestrator.errors import UserError
from orchestrator.invocation import shell_command
from orchestrator.launch.ray_job import (
    JobCommands,
    build_job_request,
    connect,
    follow,
    interrupted_submission,
    new_submission_id,
    results_notes,
)
from orchestrator.run_request import RunRequest
from tests.conftest import command_env, installed_command, interrupted_at, trial_results

ROOT = Path(__file__).resolve().parent.parent
DEMO = "configs/demo_cpu.yaml"
# Two trials of the demo sweep, two epochs each.
SMALL_CUT = ["--set", "search_space.workload=mlp", "--set", "search_space.lr=0.01",
             "--set", "search_space.width={grid: [16, 32]}", "--set", "stop.epochs=2"]


def request_for(argv: list[str], cwd: Path = ROOT):
    args = build_parser().parse_args(["run", *argv])
    request = RunRequest.from_args(args)
    return build_job_request(request, load_spec(args.config, args.overrides), cwd), request


# -- the request, without Ray ------------------------------------------------------------------


def test_job_runs_the_same_command_without_address(monkeypatch):
    monkeypatch.chdir(ROOT)
    request, _ = request_for([DEMO, "--address", "http://127.0.0.1:8265", *SMALL_CUT,
                              "--tracking-uri", "sqlite:////data/mlflow.db", "--name", "demo_cpu_20261124-101010",
                              "--resume"])
    assert request.entrypoint == (
        "python -m orchestrator run configs/demo_cpu.yaml --set search_space.workload=mlp "
        "--set search_space.lr=0.01 --set 'search_space.width={grid: [16, 32]}' --set stop.epochs=2 "
        "--tracking-uri sqlite:////data/mlflow.db --name demo_cpu_20261124-101010 --resume"
    )
    assert request.runtime_env["working_dir"] == str(ROOT)
    assert "/orchestrator_results" in request.runtime_env["excludes"]  # earlier results stay home
    assert request.metadata["job_name"] == "orchestrator demo_cpu"


def test_the_commands_the_jobs_driver_prints_are_the_users_and_go_back_to_the_cluster(monkeypatch):
    """In the job, the driver runs as ``python -m orchestrator`` without ``--address``: the resume
    and report commands it prints start as the user ran ``run --address`` and resume there."""
    from orchestrator.invocation import command_prefix
    from orchestrator.runner import resume_command

    monkeypatch.chdir(ROOT)
    args = build_parser().parse_args(["run", DEMO, "--address", "http://head:8265"])
    request = RunRequest.from_args(args)
    job = build_job_request(request, load_spec(args.config), ROOT, "http://head:8265")
    user = command_prefix()
    for name, value in job.runtime_env["env_vars"].items():  # what the job's driver has
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["/tmp/ray/session/runtime_resources/orchestrator/__main__.py"])
    words = shlex.split(resume_command(request, "demo_cpu_1"))
    assert words == [*user, "run", DEMO, "--address", "http://head:8265", "--name", "demo_cpu_1", "--resume"]
    assert shlex.split(shell_command("report", "demo_cpu_1"))[:len(user) + 1] == [*user, "report"]


def test_the_jobs_outcome_is_one_whole_line():
    """Ray's message of a failed job repeats its log tail after a colon: the line ended on it."""
    from orchestrator.launch.ray_job import outcome_line

    failed = ("Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\n"
              "2/3 trials finished\n")
    assert outcome_line("raysubmit_x", "FAILED", failed) == "Job raysubmit_x FAILED: Job entrypoint command failed with exit code 1"
    assert outcome_line("raysubmit_x", "SUCCEEDED", "") == "Job raysubmit_x SUCCEEDED"


def test_config_outside_the_working_dir_is_refused(tmp_path, monkeypatch):
    config = tmp_path / "mine.yaml"
    config.write_text((ROOT / DEMO).read_text())
    monkeypatch.chdir(ROOT)
    with pytest.raises(UserError, match="outside it; run from the project folder"):
        request_for([str(config), "--address", "http://127.0.0.1:8265"])


def test_relative_results_locations_are_pointed_out(monkeypatch):
    monkeypatch.chdir(ROOT)
    _, args = request_for([DEMO, "--address", "http://x:8265"])
    spec = load_spec(args.config)
    assert [n.split()[0] for n in results_notes(args, spec)] == ["Tune", "MLflow"]
    _, args = request_for([DEMO, "--address", "http://x:8265", "--storage-path", "/shared/results",
                           "--tracking-uri", "http://mlflow:5000"])
    assert results_notes(args, spec) == []


def test_address_must_be_the_dashboard_url(tmp_path):
    """A GCS address given as --address is one line, exit 2, before the sweep is checked or its
    memory estimated (which take seconds): the installed command from a folder of the user's."""
    (tmp_path / "sweep.yaml").write_text((ROOT / DEMO).read_text())
    done = subprocess.run([installed_command(), "run", "sweep.yaml", "--address", "127.0.0.1:6379"], cwd=tmp_path,
                          env=command_env(), capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("error: --address 127.0.0.1:6379: expected the dashboard's URL, e.g. http://127.0.0.1:8265 "
                           "(to run the driver here against a cluster's HOST:PORT, use --ray-address)\n")


def test_no_dashboard_at_the_address_is_a_user_error():
    with pytest.raises(UserError, match="no Ray dashboard answers there"):
        connect(f"http://127.0.0.1:{free_port()}")


def test_an_address_where_no_dashboard_answers_is_one_line_and_no_notes(tmp_path):
    """After the pre-flight every launcher makes (its estimate's line), and before the notes on
    where the results would go: the one line the mistake needs."""
    run = cli("run", DEMO, "--address", f"http://127.0.0.1:{free_port()}")
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 2, out
    assert "no Ray dashboard answers there" in out.strip().splitlines()[-1] and "note:" not in out, out


def test_flags_of_the_embedded_ray_are_refused(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(["run", DEMO, "--address", "http://127.0.0.1:8265", "--num-cpus", "2"]) == 2
    assert "--num-cpus: only for a sweep run here" in capsys.readouterr().err


# -- following the logs, without Ray -----------------------------------------------------------


async def chunks(*texts: str):
    for text in texts:
        yield text


def test_a_submission_id_has_rays_own_form():
    ids = {new_submission_id() for _ in range(100)}
    assert len(ids) == 100
    for submission_id in ids:
        assert submission_id.startswith("raysubmit_") and len(submission_id) == len("raysubmit_") + 16
        assert submission_id[len("raysubmit_"):].isalnum() and not set("IlOo0") & set(submission_id[len("raysubmit_"):])


async def interrupted_after(text: str):
    yield text
    os.kill(os.getpid(), signal.SIGINT)
    await asyncio.sleep(60)
    yield "never printed"


async def cancelled_before_the_first_chunk():
    """What a Ctrl-C leaves when it lands while ``asyncio.run`` installs its handler: a cancelled task."""
    asyncio.current_task().cancel()
    await asyncio.sleep(0)
    yield "never printed"


def test_following_prints_every_chunk_until_the_logs_end(capsys):
    assert follow(chunks("epoch 1\n", "epoch 2\n")) is True
    assert capsys.readouterr().out == "epoch 1\nepoch 2\n"


def test_ctrl_c_while_following_stops_following(default_sigint, capsys):
    assert follow(interrupted_after("epoch 1\n")) is False
    assert capsys.readouterr().out == "epoch 1\n"


def test_a_ctrl_c_as_following_starts_stops_following_too():
    assert follow(cancelled_before_the_first_chunk()) is False


class CtrlCBeforeTheLoop(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self):
        raise KeyboardInterrupt


def test_a_ctrl_c_before_the_loop_starts_stops_following_without_a_warning():
    """Seen with a real cluster: the Ctrl-C landed inside ``asyncio.run`` before it started the
    printing, and Python warned 'coroutine ... was never awaited' under the command's own lines."""
    asyncio.set_event_loop_policy(CtrlCBeforeTheLoop())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert follow(chunks("never printed")) is False
            gc.collect()
    finally:
        asyncio.set_event_loop_policy(None)
    assert not [warning for warning in caught if "never awaited" in str(warning.message)]


# -- against a real cluster --------------------------------------------------------------------


def cli(*argv: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """``python -m orchestrator ...`` from the project root, as a user runs it."""
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *argv], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", **(env or {})},
        **popen,
    )


def job_client(head):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(head.dashboard_url, headers=head.headers)


def wait_terminal(client, submission_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (status := client.get_job_status(submission_id)).is_terminal():
        assert time.monotonic() < deadline, f"job {submission_id} still {status} after {timeout} s"
        time.sleep(1)
    return status


def submission_id_in(output: str) -> str:
    return next(line.split()[2].rstrip(":") for line in output.splitlines() if line.startswith("Submitted job "))


@pytest.mark.integration
def test_without_the_token_the_cli_says_where_to_put_it(ray_head, tmp_path):
    """No token on the client: refused with a pointer to Ray's token sources. A wrong token: 'rejected'."""
    (tmp_path / "home").mkdir()
    run = cli("run", DEMO, "--address", ray_head.dashboard_url, env={"HOME": str(tmp_path / "home")})
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 2, out
    assert "needs a token and none was found" in out and "~/.ray/auth_token" in out
    assert "note:" not in out, out  # the refusal, not where results would go first
    run = cli("run", DEMO, "--address", ray_head.dashboard_url, env={"RAY_AUTH_TOKEN": "0" * 32})
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 2 and "rejected our token" in out, out
    assert "note:" not in out, out


@pytest.mark.integration
def test_the_readmes_own_model_as_a_job(ray_head, own_model_project, tmp_path):
    """The README's own-model sweep (two trials, one epoch) submitted with the installed command
    from the folder that holds ``my_models/``, with no PYTHONPATH: the job uploads that folder
    and its workers import the user's package from it."""
    started = time.monotonic()
    run = subprocess.Popen(
        own_model_project.command("run") + [
            "--address", ray_head.dashboard_url, "--set", "stop.epochs=1",
            "--storage-path", str(tmp_path / "results"), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"],
        cwd=own_model_project.folder, env=command_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    out, _ = run.communicate(timeout=400)
    print(out[-4000:])
    print(f"job CLI took {time.monotonic() - started:.0f} s")
    assert run.returncode == 0, out[-4000:]
    submission_id = submission_id_in(out)
    assert f"Ray dashboard: {ray_head.dashboard_url}/#/jobs/{submission_id}" in out
    assert "ray get-auth-token" in out
    assert f"Job {submission_id} SUCCEEDED" in out
    assert "2/2 trials finished" in out
    assert "dashboard_sdk.py" not in out and "packaging.py" not in out  # Ray's job client says what we said

    client = job_client(ray_head)
    info = client.get_job_info(submission_id)
    assert info.status == "SUCCEEDED"
    assert info.metadata["job_name"] == "orchestrator wide"
    assert info.entrypoint == "python -m orchestrator run wide.yaml --set stop.epochs=1 " \
        f"--storage-path {tmp_path}/results --tracking-uri sqlite:///{tmp_path}/mlflow.db"
    assert (tmp_path / "mlflow.db").exists()  # the paths we passed reached the runner

    # Both trials' gauges reach the node's Prometheus endpoint with the values Tune recorded last.
    assert ray_head.session_metrics_port() == ray_head.metrics_export_port
    final = {lines[-1]["trial_id"]: lines[-1] for lines in trial_results(f"{tmp_path}/results/wide_*/*/result.json").values()}
    assert len(final) == 2
    expected = {}
    for trial_id, result in final.items():
        expected[("ray_orchestrator_planned_peak_bytes", trial_id, None)] = result["predicted_peak_bytes"]
        expected[("ray_orchestrator_measured_peak_bytes", trial_id, "allocated")] = result["peak_allocated_bytes"]
        expected[("ray_orchestrator_micro_batch", trial_id, None)] = result["micro_batch"]
        expected[("ray_orchestrator_eval_batch", trial_id, None)] = result["eval_batch"]

    def ours(samples) -> dict:
        return {(name, s.labels["trial_id"], s.labels.get("kind")): s.value for name, s in samples
                if s.labels.get("experiment") == "wide" and s.labels.get("workload") == "my_models.wide:WideNet"}

    seen = ours(scrape_until(ray_head, lambda samples: ours(samples).keys() >= expected.keys()))
    assert {key: seen.get(key) for key in expected} == expected


def scrape_until(head, predicate, timeout: float = 60) -> list:
    """Prometheus samples of our metrics, re-scraped until ``predicate(samples)`` (Ray exports every few s)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [(family.name, sample) for family in text_string_to_metric_families(head.scrape())
                 if family.name.startswith("ray_orchestrator_") for sample in family.samples]
        if predicate(found) or time.monotonic() > deadline:
            return found
        time.sleep(2)


@pytest.mark.integration
def test_a_cluster_whose_python_lacks_the_orchestrator_says_which_python_and_what_to_do(ray_temp_dir, tmp_path):
    """A job runs the `python` on the PATH of the cluster's `ray start`; a head started outside
    the venv (the usual slip) gives the job a Python without the orchestrator, and Ray's log said
    only `No module named orchestrator`."""
    from ray_cluster import start_head

    bare = tmp_path / "bin"  # a Python without the orchestrator, where the head's jobs look for `python`
    bare.mkdir()
    base_python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    (bare / "python").symlink_to(base_python)
    head = start_head(ray_temp_dir("bare"), num_cpus=1, path=f"{bare}{os.pathsep}/usr/bin{os.pathsep}/bin")
    try:
        user = tmp_path / "user"  # a user's folder: the uploaded working_dir holds no orchestrator either
        user.mkdir()
        (user / "sweep.yaml").write_text((ROOT / "configs" / "demo_cpu.yaml").read_text())
        done = subprocess.run([installed_command(), "run", "sweep.yaml", "--address", head.dashboard_url], cwd=user,
                              env=command_env(), capture_output=True, text=True, timeout=300, check=False)
    finally:
        head.stop()
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{bare / 'python'}: No module named orchestrator" in done.stdout
    assert done.stdout.splitlines()[-1] == (
        f"hint: the cluster runs jobs with {bare / 'python'}, the `python` on the PATH of its `ray start`, and the "
        "orchestrator is not installed there: install it into that Python, or start the cluster from the environment "
        "that has it (`source .venv/bin/activate && ray start --head ...`)")


@pytest.mark.integration
def test_oom_retries_are_counted_on_the_prometheus_endpoint(ray_head, tmp_path):
    """The OOM demo's large CNN runs out of its emulated 8 MiB, shrinks and finishes: every retry
    is on the head's endpoint once the job has ended.

    The trial is ~3 s and its OOMs come in its first epoch, well under one export interval (10 s)
    before its worker ends with the job: counted there, they were exported only when a timer
    happened to fall between the two (one CI run in many lost them). The driver counts them and
    holds its exit until they are out."""
    run = cli("run", "configs/demo_oom_cpu.yaml", "--address", ray_head.dashboard_url,
              "--set", "search_space.workload=cnn", "--set", "workload.params={}", "--set", "search_space.width=48",
              "--storage-path", str(tmp_path / "results"), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db")
    out, _ = run.communicate(timeout=400)
    assert run.returncode == 0, out[-4000:]
    assert "Waiting" in out and "for Ray to export the last OOM counts" in out
    [retried] = [lines[-1]["oom_retries"] for lines in trial_results(f"{tmp_path}/results/*/*/result.json").values()]

    def retries(samples):
        return [s for name, s in samples if name == "ray_orchestrator_oom_retries"
                and s.name.endswith("_total") and s.labels.get("experiment") == "demo_oom_cpu"]

    counted = retries(scrape_until(ray_head, retries, timeout=10))
    print([(s.labels["trial_id"], s.labels["phase"], s.value) for s in counted])
    assert retried >= 1 and sum(s.value for s in counted) == retried
    assert {s.labels["phase"] for s in counted} <= {"train", "eval"} and {s.labels["workload"] for s in counted} == {"cnn"}
    assert {s.labels["workload"] for s in counted} == {"cnn"}


@pytest.mark.integration
def test_ctrl_c_stops_following_not_the_job(ray_head, tmp_path):
    run = cli("run", DEMO, "--address", ray_head.dashboard_url, *SMALL_CUT,
              "--storage-path", str(tmp_path / "results"), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db")
    _, out = interrupted_at(run, "Following its logs")
    assert run.returncode == 130, out
    submission_id = submission_id_in(out)
    assert f"Job {submission_id} keeps running" in out
    assert f"RAY_AUTH_MODE=token ray job stop {submission_id} --address {ray_head.dashboard_url}" in out

    client = job_client(ray_head)
    assert client.get_job_status(submission_id) in ("PENDING", "RUNNING")
    client.stop_job(submission_id)
    assert wait_terminal(client, submission_id) == "STOPPED"


@pytest.mark.integration
def test_dashboard_answers_401_without_the_token(ray_head):
    """Auth stays on: the API refuses anonymous requests; the page itself loads to ask for the token."""
    assert requests.get(f"{ray_head.dashboard_url}/api/jobs/", timeout=10).status_code == 401
    assert requests.get(f"{ray_head.dashboard_url}/api/jobs/", headers=ray_head.headers, timeout=10).ok
    mode = requests.get(f"{ray_head.dashboard_url}/api/authentication_mode", timeout=10).json()
    assert mode == {"authentication_mode": "token"}


@pytest.mark.integration
def test_ctrl_c_while_uploading_says_nothing_was_submitted(ray_head, tmp_path):
    """A Ctrl-C while the working directory is packed and uploaded (80 MB that does not compress:
    seconds here) leaves no job, and the command says so instead of leaving the user to guess."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "sweep.yaml").write_text((ROOT / DEMO).read_text())
    (project / "weights.bin").write_bytes(os.urandom(80 * 2**20))
    run = subprocess.Popen([installed_command(), "run", "sweep.yaml", "--address", ray_head.dashboard_url, *SMALL_CUT],
                           cwd=project, env=command_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    uploading, out = interrupted_at(run, "Uploading ")
    assert run.returncode == 130, out
    submission_id = uploading.split()[-1].rstrip(".")
    assert f"Interrupted before the cluster took the job: nothing was submitted ({submission_id} is not" in out, out
    assert "Traceback" not in out and "Submitted job" not in out
    assert out.count("Uploading ") == 1, out  # a Ctrl-C as the line was written once left it to be written again
    assert submission_id not in {job.submission_id for job in job_client(ray_head).list_jobs()}


@pytest.mark.integration
def test_a_job_the_cluster_refuses_is_one_line(ray_head, tmp_path, monkeypatch, capsys):
    """Ray's job client raises for any request the dashboard refuses (a job agent that is down:
    500); here a submission id the cluster already has (400): one line naming the address and the
    cluster's reason, exit 2, no traceback."""
    taken = new_submission_id()
    client = job_client(ray_head)
    client.submit_job(entrypoint="python -c pass", submission_id=taken)
    monkeypatch.setattr("orchestrator.launch.ray_job.new_submission_id", lambda: taken)
    (tmp_path / "sweep.yaml").write_text((ROOT / DEMO).read_text())
    monkeypatch.chdir(tmp_path)
    assert main(["run", "sweep.yaml", "--address", ray_head.dashboard_url, *SMALL_CUT]) == 2
    said = capsys.readouterr().err.splitlines()[-1]  # after the pre-flight's estimate line
    assert said.startswith(f"error: --address {ray_head.dashboard_url}: the cluster did not take the job: "
                           "Request failed with status code "), said
    assert taken in said and "Traceback" not in said, said  # the cluster's reason, not its traceback's first line
    wait_terminal(client, taken)


@pytest.mark.integration
def test_a_job_the_cluster_took_before_the_ctrl_c_is_said_to_run_on(ray_head):
    """The other side of a Ctrl-C during ``submit_job``: the cluster took the job and only its reply
    was cut short. Asked by the id chosen before submitting, the job is found and its commands printed."""
    client = job_client(ray_head)
    commands = JobCommands(ray_head.dashboard_url, new_submission_id(), needs_token=True)
    client.submit_job(entrypoint="python -c pass", submission_id=commands.submission_id)
    said = interrupted_submission(client, commands)
    assert said.startswith(f"Interrupted, but the cluster had taken the job. Job {commands.submission_id} keeps running")
    assert f"job stop {commands.submission_id} --address {ray_head.dashboard_url}" in said
    assert said.count("RAY_AUTH_MODE=token ") == 2  # follow and stop, each with the token Ray's CLI needs told
    wait_terminal(client, commands.submission_id)
