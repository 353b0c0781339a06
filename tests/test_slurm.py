"""``orchestrator submit``: the rendered sbatch script, the script's run-time logic, and a real SLURM.

Three layers, cheapest first:

- the script's text, rendered for 1 node without GPUs and for N nodes with GPUs: directives,
  the Ray head and worker lines, ports, requeue/signal, no ``auto`` address, dashboard host;
- the script *run* by bash against fake ``srun``/``scontrol``/``ray``/``mlflow``/``python``
  that record their arguments: which commands it really issues for a 3-node allocation, that
  the driver's exit status comes back, that USR1 leads to a requeue and the next attempt
  resumes, and that everything it started is stopped;
- a real single-node SLURM (munged, slurmctld, slurmd started here, see ``slurm_cluster.py``)
  running a real two-trial sweep of the README's own model, submitted with the installed command
  from the user's folder, with a real Ray cluster and MLflow server, then a sweep that
  is stopped near its "time limit", requeued and resumed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import requests
import yaml

from orchestrator.cli import build_parser, main
from orchestrator.config import load_spec
from orchestrator.errors import UserError
from orchestrator.launch.slurm import (
    DEFAULT_TEMPLATE, PORT_BLOCK_SIZE, PORT_BLOCKS, PORT_MIN, expected_dashboard_port, parse_time_limit, plan_job, render,
    shared_tracking_uri,
)
from slurm_cluster import LocalSlurm, SlurmStartError
from tests.conftest import command_env, installed_command, trial_results

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "configs" / "demo_cpu.yaml"


def submit_args(*flags: str):
    return build_parser().parse_args(["submit", str(DEMO), *flags])


def rendered(tmp_path, *flags: str) -> str:
    args = submit_args(*flags)
    job = plan_job(args, load_spec(args.config, args.overrides), cwd=str(tmp_path))
    return render(job)


def directives(script: str) -> dict[str, str]:
    found = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH "):].partition("=")
            found[key] = value
    return found


def command_lines(script: str, pattern: str) -> list[str]:
    """Logical lines (backslash continuations joined) that contain ``pattern``."""
    joined = re.sub(r"\\\n\s*", " ", script)
    return [line.strip() for line in joined.splitlines() if pattern in line and not line.lstrip().startswith("#")]


# -- the rendered text ----------------------------------------------------------------------


def test_one_node_cpu_script(tmp_path):
    script = rendered(tmp_path, "--cpus-per-node", "2", "--time", "00:30:00", "--set", "stop.epochs=1")
    d = directives(script)
    assert d["--nodes"] == "1" and d["--ntasks-per-node"] == "1" and d["--cpus-per-task"] == "2"
    assert "--gres" not in d and "--partition" not in d
    assert d["--time"] == "00:30:00"
    assert "--requeue" in d and d["--open-mode"] == "append"
    assert d["--signal"] == "B:USR1@300"  # the batch shell is told 5 minutes before the limit
    assert d["--output"] == f"{tmp_path}/slurm_logs/orch-demo_cpu-%j.out"
    assert "NUM_NODES=1" in script and "GPUS_PER_NODE=0" in script
    [driver] = command_lines(script, "-m orchestrator run")
    assert driver.count('"$CONFIG" --set stop.epochs=1 ') == 2  # the first attempt's command and the resumed one's
    assert "{{" not in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_n_node_gpu_script(tmp_path):
    script = rendered(tmp_path, "--nodes", "4", "--gpus-per-node", "4", "--partition", "gpu", "--time", "04:00:00",
                      "--account", "proj1", "--mem", "64G")
    d = directives(script)
    assert d["--nodes"] == "4" and d["--gres"] == "gpu:4"
    assert d["--cpus-per-task"] == "4"  # one trial's CPUs (resources.cpu: 1) per GPU
    assert (d["--partition"], d["--account"], d["--mem"]) == ("gpu", "proj1", "64G")
    assert "NUM_NODES=4" in script and "GPUS_PER_NODE=4" in script

    [head] = command_lines(script, "start --head")
    assert head.startswith("srun --nodes=1 --ntasks=1 --overlap -w \"$HEAD_NODE\"")
    for part in ('--block', '--node-ip-address="$HEAD_IP"', '--port="$GCS_PORT"', '--dashboard-host="$HEAD_IP"',
                 '--dashboard-port="$DASHBOARD_PORT"', '--temp-dir="$RAY_TMP"', '--num-gpus="$GPUS_PER_NODE"',
                 '"${SRUN_GRES[@]}"', '$(node_ports 0)', '--ray-client-server-port=', '--node-name="$HEAD_NODE"',
                 """--system-config='{"prestart_worker_first_driver": false}'"""):  # as `run`'s own Ray
        assert part in head, part
    [worker] = command_lines(script, 'start --block --address=')
    assert worker.startswith('srun --nodes=1 --ntasks=1 -w "$node"')
    assert '--address="$RAY_ADDRESS_HEAD"' in worker and '"${SRUN_GRES[@]}"' in worker
    assert '$(node_ports "$i")' in worker and '--node-name="$node"' in worker
    assert 'for (( i = 1; i < NUM_NODES; i++ )); do' in script  # every node but the head gets a worker
    assert 'SRUN_GRES=(--gres="gpu:$GPUS_PER_NODE")' in script
    for port in ("node-manager-port", "object-manager-port", "min-worker-port", "max-worker-port",
                 "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
                 "metrics-export-port"):
        assert f"--{port}=" in script, port


def test_script_never_uses_auto_address_and_binds_dashboard_and_mlflow_narrowly(tmp_path):
    script = rendered(tmp_path, "--nodes", "2", "--gpus-per-node", "1")
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"""address[= ]*["']?auto""", code)
    assert "0.0.0.0" not in script
    assert "unset RAY_ADDRESS" in script
    [driver] = command_lines(script, "-m orchestrator run")
    assert '--ray-address "$RAY_ADDRESS_HEAD"' in driver and '--tracking-uri "$TRACKING_URI"' in driver
    assert 'RAY_ADDRESS_HEAD="$HEAD_IP:$GCS_PORT"' in script
    [mlflow] = command_lines(script, '"$MLFLOW" server')
    assert "--host 127.0.0.1" in mlflow and "--app-name basic-auth" in mlflow  # loopback, and credentials
    assert "--workers 1" in mlflow and 'sqlite:///$JOB_DIR/mlflow.db' in mlflow
    assert "export RAY_AUTH_MODE=token" in script and "ray stop" not in script


def test_tracking_server_from_config_or_flag(tmp_path):
    script = rendered(tmp_path, "--cpus-per-node", "2", "--tracking-uri", "http://mlflow.internal:5000")
    assert "TRACKING_URI=http://mlflow.internal:5000" in script
    assert shared_tracking_uri("sqlite:///mlflow.db") is None  # a local file: the job starts a server
    assert shared_tracking_uri("./mlruns") is None and shared_tracking_uri("file:///x") is None
    assert shared_tracking_uri("postgresql://db/mlflow") == "postgresql://db/mlflow"


@pytest.mark.parametrize("text, seconds", [
    ("30", 1800), ("10:30", 630), ("04:00:00", 14400), ("1-00", 86400), ("2-01:30", 178200), ("1-00:00:10", 86410),
])
def test_time_limits(text, seconds):
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("flags, message", [
    (["--cpus-per-node", "2", "--time", "4h"], "--time: expected"),
    ([], "--cpus-per-node: needed for a CPU-only job"),
    (["--cpus-per-node", "2", "--nodes", "0"], "--nodes: expected at least 1"),
    (["--cpus-per-node", "2", "--partition", "gpu; rm -rf /"], "--partition: unexpected characters"),
    (["--cpus-per-node", "2", "--mem", "lots"], "--mem: expected SLURM's memory per node, a whole number with K, M "
     "(the default), G or T, such as 64G, got 'lots'"),
    (["--gpus-per-node", "0", "--cpus-per-node", "2", "--set", "resources.gpu=1"], "--gpus-per-node: the sweep's trials need GPUs"),
    (["--cpus-per-node", "1", "--set", "resources.cpu=2"], "fewer than one trial needs"),
    (["--gpus-per-node", "1", "--set", "resources.gpu=2"], "--gpus-per-node: 1 is fewer than one trial needs"),
    (["--gpus-per-node", "2", "--nodes", "2", "--set", "resources={workers: 8, gpu: 1}"],
     "--nodes/--gpus-per-node: a trial needs 8 workers (resources.workers) of GPU 1, CPU 1, and 2 node(s) hold 4; "
     "ask for --nodes 4 or set resources.workers: 4"),
])
def test_bad_flags_are_one_line_errors(flags, message):
    args = submit_args(*flags)
    with pytest.raises(UserError, match=re.escape(message)):
        plan_job(args, load_spec(args.config, args.overrides))


@pytest.mark.parametrize("folder, kind", [("logs dir", "whitespace"), ("logs%x", "'%'"), ("it's", '"\'"'),
                                          ('"quoted"', "'\"'")], ids=["space", "pattern", "quote", "double quote"])
def test_a_path_an_sbatch_line_would_change_is_refused(folder, kind):
    """sbatch splits an #SBATCH line at spaces, strips its quotes and reads % in --output as a file
    name pattern (%x: the job's name): the job would write elsewhere than the path says."""
    args = submit_args("--cpus-per-node", "2", "--log-dir", f"/tmp/{folder}")
    with pytest.raises(UserError) as refused:
        plan_job(args, load_spec(args.config, args.overrides))
    assert str(refused.value) == f"--log-dir: {'/tmp/' + folder!r} contains {kind}, which #SBATCH lines can't carry as written"


def test_a_data_parallel_trial_may_spread_its_workers_over_the_nodes():
    args = submit_args("--gpus-per-node", "2", "--nodes", "2", "--set", "resources={workers: 4, gpu: 1}")
    assert plan_job(args, load_spec(args.config, args.overrides)).nodes == 2


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["submit", str(DEMO), "--cpus-per-node", "2", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("#!/bin/bash") and "#SBATCH --nodes=1" in out
    assert "dry run: nothing written or submitted" in err
    assert list(tmp_path.iterdir()) == []


def test_submit_without_sbatch_is_a_user_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["submit", str(DEMO), "--cpus-per-node", "2"]) == 2
    assert "sbatch not found" in capsys.readouterr().err


def sbatch_on_path(tmp_path, monkeypatch, body: str) -> None:
    """An ``sbatch`` first on PATH that runs the shell lines ``body``, in ``tmp_path/bin``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\n{body}")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_submit_writes_the_job_folder_and_calls_sbatch(tmp_path, capsys, monkeypatch):
    """With a fake sbatch: the config is copied (later edits don't reach the job), the script is
    kept next to it, and the output names the job id, the log and the tunnel line."""
    sbatch_on_path(tmp_path, monkeypatch, f"echo \"$@\" > {tmp_path}/sbatch.args\necho '77;cluster'\n")
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "sweep.yaml"
    config.write_text(DEMO.read_text())

    assert main(["submit", str(config), "--cpus-per-node", "2", "--storage-path", "store"]) == 0
    out = capsys.readouterr().out
    config.write_text("edited after submit\n")
    [job_dir] = (tmp_path / "store" / "slurm").iterdir()
    assert (job_dir / "config.yaml").read_text() == DEMO.read_text()
    assert (tmp_path / "sbatch.args").read_text().split() == ["--parsable", str(job_dir / "job.sbatch")]
    assert (tmp_path / "slurm_logs").is_dir()  # SLURM does not create the log folder itself
    assert "Submitted SLURM job 77" in out and f"{tmp_path}/slurm_logs/orch-demo_cpu-77.out" in out
    assert f"ssh -N -L 8265:<head node>:{expected_dashboard_port('77')} " in out


def test_a_job_sbatch_refuses_leaves_its_script_and_no_empty_log_folder(tmp_path, capsys, monkeypatch):
    """sbatch's refusal (a partition that does not exist) is one line naming the script, which
    stays for the user to read; the log folder made for the job is taken back."""
    sbatch_on_path(tmp_path, monkeypatch, "echo 'sbatch: error: Batch job submission failed: "
                                          "Invalid partition name specified' >&2\nexit 1\n")
    monkeypatch.chdir(tmp_path)

    assert main(["submit", str(DEMO), "--cpus-per-node", "2", "--partition", "nosuch", "--storage-path", "store"]) == 2
    err = capsys.readouterr().err
    [job_dir] = (tmp_path / "store" / "slurm").iterdir()
    assert err.endswith(f"\nerror: sbatch refused the job: sbatch: error: Batch job submission failed: Invalid "
                        f"partition name specified (script: {job_dir / 'job.sbatch'})\n")
    assert (job_dir / "job.sbatch").is_file()
    assert not (tmp_path / "slurm_logs").exists()


def test_a_site_template_replaces_the_default(tmp_path, capsys):
    site = tmp_path / "site.tmpl"
    site.write_text("#!/bin/bash\n{{sbatch_directives}}\n#SBATCH --qos=high\nmodule load cuda\nNODES={{nodes}}\n")
    assert main(["submit", str(DEMO), "--cpus-per-node", "2", "--template", str(site), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --qos=high" in out and "module load cuda" in out and "NODES=1" in out
    site.write_text("{{no_such_thing}}\n")
    assert main(["submit", str(DEMO), "--cpus-per-node", "2", "--template", str(site), "--dry-run"]) == 2
    assert "unknown placeholder {{no_such_thing}}" in capsys.readouterr().err


# -- the script run by bash against recording fakes -----------------------------------------

FAKE_SRUN = """
import os, sys
record("srun")
args = sys.argv[1:]
while args and args[0].startswith("-"):  # srun's own options; -w takes a value
    args = args[2:] if args[0] == "-w" else args[1:]
os.execvp(args[0], args)
"""
FAKE_SCONTROL = """
import os, sys
record("scontrol")
if sys.argv[1:3] == ["show", "hostnames"]:
    print("\\n".join(os.environ["FAKE_NODES"].split()))
elif sys.argv[1:3] == ["show", "node"]:
    # Each node its own address (the first is the head's, 127.0.0.1), as on separate machines.
    index = os.environ["FAKE_NODES"].split().index(sys.argv[3]) if sys.argv[3] in os.environ["FAKE_NODES"].split() else 0
    print(f"NodeName={sys.argv[3]} Arch=x86_64\\n   NodeAddr=127.0.0.{index + 1} NodeHostName={sys.argv[3]}")
"""
LISTEN = """
def listen(port):
    import socket, time
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", int(port)))
    s.listen()
    time.sleep(120)
"""
FAKE_RAY = LISTEN + """
import os, sys, time
record("ray")
if sys.argv[1] == "get-auth-token":  # as Ray 2.60 does: mkdir and open() with the umask it is given
    path = os.path.join(os.environ["HOME"], ".ray", "auth_token")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write("fake-token")
    print(open(path).read(), end="")
elif "--head" in sys.argv:
    if os.environ.get("FAKE_HEAD_FAILS"):
        sys.exit(1)
    listen(next(a.split("=")[1] for a in sys.argv if a.startswith("--port=")))
else:
    time.sleep(120)
"""
FAKE_MLFLOW = LISTEN + """
import sys
record("mlflow")
listen(sys.argv[sys.argv.index("--port") + 1])
"""
FAKE_PYTHON = """
import os, signal, sys, time
if sys.argv[1] == "-":  # the wait-for-nodes snippet: until every worker's `ray start` ran
    import json
    sys.stdin.read()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(os.environ["FAKE_DIR"] + "/calls.jsonl") as f:
            calls = [json.loads(line) for line in f]
        # Only ray's own records: srun's record of the same command line runs before ray does.
        joined = sum(c["tool"] == "ray" and c["argv"][:2] == ["start", "--block"] for c in calls)
        if joined >= int(sys.argv[3]) - 1:
            break
        time.sleep(0.1)
    print(f"Ray cluster: {joined + 1}/{sys.argv[3]} nodes (fake)")
    sys.exit(0)
record("python")
if os.environ.get("FAKE_DRIVER") == "wait_for_usr1":
    # Like Tune: stop and save; the status is the driver's to choose (0 here, to show the
    # script requeues a stopped sweep whatever the driver says).
    signal.signal(signal.SIGUSR1, lambda *_: sys.exit(int(os.environ.get("FAKE_DRIVER_RC", "0"))))
    open(os.environ["FAKE_DIR"] + "/driver.started", "w").close()
    time.sleep(60)
sys.exit(int(os.environ.get("FAKE_DRIVER_RC", "0")))
"""
RECORD = """
import json, os, sys
def record(tool):
    keep = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS", "MLFLOW_AUTH_CONFIG_PATH",
                                           "MLFLOW_FLASK_SERVER_SECRET_KEY", "MLFLOW_TRACKING_USERNAME",
                                           "MLFLOW_TRACKING_PASSWORD")}
    with open(os.environ["FAKE_DIR"] + "/calls.jsonl", "a") as f:
        f.write(json.dumps({"tool": tool, "argv": sys.argv[1:], "env": keep, "pid": os.getpid()}) + "\\n")
"""


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """A bin/ of fake SLURM, Ray, MLflow and Python executables that record how they were called;
    and port blocks for the job where nothing listens now (``quiet_port_blocks``)."""
    monkeypatch.setenv("ORCHESTRATOR_PORT_MIN", str(quiet_port_blocks(2)))
    monkeypatch.setenv("ORCHESTRATOR_PORT_BLOCKS", "2")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("ray", FAKE_RAY),
                       ("mlflow", FAKE_MLFLOW), ("python", FAKE_PYTHON)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{RECORD}\n{textwrap.dedent(body)}")
        path.chmod(0o755)
    return bin_dir


def quiet_port_blocks(count: int) -> int:
    """The first of ``count`` neighbouring 500-port blocks in which nothing listens on any port the
    job script checks. With the default blocks a job's first choice depends on what else runs on
    the machine (a block the script finds busy moves the job to the next, as it should), and a
    test that checks `submit`'s prediction of the port must not depend on that."""

    def listens(port: int) -> bool:
        with socket.socket() as probe:
            probe.settimeout(0.2)
            return probe.connect_ex(("127.0.0.1", port)) == 0

    size = PORT_BLOCK_SIZE
    for base in range(PORT_MIN, 32768 - size * count, size):
        checked = [p for b in range(base, base + size * count, size)
                   for p in [*range(b, b + 10), *range(b + 100, b + size, 25)]]
        if not any(listens(port) for port in checked):
            return base
    raise RuntimeError("no quiet block of ports below 32768 on this machine")


def run_fake_job(tmp_path, fakes, nodes: list[str], script: str, *, driver_rc=0, driver=None, job_id="4242",
                 on_start=None, extra_env=None) -> tuple[int, list[dict], str]:
    env = {
        **os.environ,
        "PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}",
        "FAKE_DIR": str(tmp_path), "FAKE_NODES": " ".join(nodes), "FAKE_DRIVER_RC": str(driver_rc),
        "FAKE_DRIVER": driver or "",
        "SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": ",".join(nodes), "SLURM_SUBMIT_HOST": "login1", "USER": "alice",
        "ORCHESTRATOR_PYTHON": str(fakes / "python"), "ORCHESTRATOR_RAY": str(fakes / "ray"),
        "ORCHESTRATOR_MLFLOW": str(fakes / "mlflow"), "ORCHESTRATOR_RAY_TMP_ROOT": str(tmp_path / "rt"),
        "RAY_ADDRESS": "auto",  # inherited from the submitting shell: the script must drop it
        "HOME": str(tmp_path / "home"),
        **(extra_env or {}),
    }
    env.pop("RAY_AUTH_TOKEN", None)
    (tmp_path / "rt").mkdir(exist_ok=True)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    calls_file = tmp_path / "calls.jsonl"
    calls_file.unlink(missing_ok=True)
    process = subprocess.Popen(["bash", str(path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if on_start:
        on_start(process)
    out, _ = process.communicate(timeout=120)
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()]
    return process.returncode, calls, out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_three_node_run_issues_head_and_worker_commands(tmp_path, fakes):
    storage = tmp_path / "store"
    script = rendered(tmp_path, "--nodes", "3", "--gpus-per-node", "2", "--storage-path", str(storage),
                      "--set", "stop.epochs=1")
    rc, calls, out = run_fake_job(tmp_path, fakes, ["n1", "n2", "n3"], script, driver_rc=0)
    assert rc == 0, out
    assert f":{expected_dashboard_port('4242')} alice@login1" in out  # what `submit` predicted

    sruns = [c["argv"] for c in calls if c["tool"] == "srun"]
    ray_starts = [c for c in calls if c["tool"] == "ray" and c["argv"][0] == "start"]
    [head] = [c["argv"] for c in ray_starts if "--head" in c["argv"]]
    workers = [c["argv"] for c in ray_starts if "--head" not in c["argv"]]
    opt = lambda argv, name: next(a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}="))

    gcs = int(opt(head, "port"))
    assert 10000 <= gcs < 32768 and gcs % 500 == 0  # a per-job block below the ephemeral range
    assert opt(head, "node-ip-address") == "127.0.0.1" and opt(head, "dashboard-host") == "127.0.0.1"
    assert int(opt(head, "dashboard-port")) == gcs + 4 and opt(head, "num-gpus") == "2" and opt(head, "num-cpus") == "2"
    assert "--block" in head and re.fullmatch(rf"{tmp_path}/rt/ray-4242-\w{{6}}", opt(head, "temp-dir"))

    assert len(workers) == 2
    for worker in workers:
        assert "--block" in worker and opt(worker, "address") == f"127.0.0.1:{gcs}"
        assert opt(worker, "node-manager-port") == opt(head, "node-manager-port")  # the job's block on every node
        assert opt(worker, "temp-dir") == opt(head, "temp-dir")
        assert opt(worker, "node-name") in ("n2", "n3")  # the table names nodes as SLURM does
        assert opt(worker, "min-worker-port") == str(gcs + 100) and opt(worker, "max-worker-port") == str(gcs + 499)
    starts = [argv for argv in sruns if "start" in argv]
    assert sorted(argv[argv.index("-w") + 1] for argv in starts) == ["n1", "n2", "n3"]
    assert all("--gres=gpu:2" in argv and "--cpus-per-task=2" in argv for argv in starts)

    for c in calls:
        if c["tool"] in ("ray", "python") and c["argv"][0] != "get-auth-token":
            assert c["env"]["RAY_AUTH_MODE"] == "token" and c["env"]["RAY_AUTH_TOKEN"] == "fake-token"
            assert c["env"]["RAY_ADDRESS"] is None

    # MLflow: on the head's loopback (not its cluster address), behind this job's credentials.
    [mlflow_call] = [c for c in calls if c["tool"] == "mlflow"]
    mlflow = mlflow_call["argv"]
    assert mlflow[mlflow.index("--host") + 1] == "127.0.0.1" and mlflow[mlflow.index("--port") + 1] == str(gcs + 9)
    assert mlflow[mlflow.index("--app-name") + 1] == "basic-auth"
    job_dir = Path(re.search(r"^JOB_DIR=(.*)$", script, re.M).group(1))
    auth = job_dir / "mlflow_auth.ini"
    assert mlflow_call["env"]["MLFLOW_AUTH_CONFIG_PATH"] == str(auth)
    assert stat.S_IMODE(auth.stat().st_mode) == 0o600 and stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    settings = dict(line.split(" = ", 1) for line in auth.read_text().splitlines() if " = " in line)
    assert settings["default_permission"] == "NO_PERMISSIONS" and len(settings["admin_password"]) == 64
    assert mlflow_call["env"]["MLFLOW_FLASK_SERVER_SECRET_KEY"] == settings["flask_secret_key"] != settings["admin_password"]
    [driver_call] = [c for c in calls if c["tool"] == "python"]
    assert driver_call["env"]["MLFLOW_TRACKING_USERNAME"] == settings["admin_username"] == "orchestrator"
    assert driver_call["env"]["MLFLOW_TRACKING_PASSWORD"] == settings["admin_password"]
    assert settings["admin_password"] not in out  # never printed
    assert driver_call["argv"] == ["-u", "-m", "orchestrator", "run", f"{job_dir}/config.yaml", "--set", "stop.epochs=1",
                                   "--storage-path", str(storage), "--tracking-uri", f"http://127.0.0.1:{gcs + 9}",
                                   "--ray-address", f"127.0.0.1:{gcs}", "--name", job_dir.name]
    # Ray's token: created under the script's umask, private to its owner.
    token = tmp_path / "home" / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    # Teardown: the workers' temp dirs are removed on their nodes; nothing we started is left.
    assert any("rm" in argv and "--exclude=n1" in argv for argv in sruns)
    assert not [c["pid"] for c in calls if c["tool"] in ("ray", "mlflow") and pid_alive(c["pid"])]
    assert list((tmp_path / "rt").iterdir()) == []  # the head's temp dir is gone
    assert f"ssh -N -L 8265:127.0.0.1:{gcs + 4} alice@login1" in out
    assert f"ssh -N -L 5000:127.0.0.1:{gcs + 9} -J alice@login1 alice@n1" in out


def test_one_node_run_has_no_workers_and_returns_the_driver_status(tmp_path, fakes):
    script = rendered(tmp_path, "--cpus-per-node", "2", "--storage-path", str(tmp_path / "store"))
    rc, calls, out = run_fake_job(tmp_path, fakes, ["n1"], script, driver_rc=3)
    assert rc == 3, out
    assert [c["argv"][0] for c in calls if c["tool"] == "ray"] == ["get-auth-token", "start"]
    assert "driver exited with status 3" in out
    assert not [c for c in calls if c["tool"] == "scontrol" and c["argv"][0] == "requeue"]


def test_python_predicts_ports_from_the_templates_blocks():
    template = DEFAULT_TEMPLATE.read_text()
    assert f"PORT_MIN=${{ORCHESTRATOR_PORT_MIN:-{PORT_MIN}}}" in template
    assert f"PORT_BLOCKS=${{ORCHESTRATOR_PORT_BLOCKS:-{PORT_BLOCKS}}}" in template
    assert f"PORT_BLOCK_SIZE={PORT_BLOCK_SIZE}" in template


def test_a_busy_port_block_moves_the_job_to_the_next(tmp_path, fakes):
    """Something else on the head node listens in the job's first block (another job, another
    Ray): the job takes the next block, and its log says which, since `submit` predicted the first."""
    first = expected_dashboard_port("4242") - 4
    script = rendered(tmp_path, "--cpus-per-node", "2", "--storage-path", str(tmp_path / "store"))
    with socket.socket() as other:
        other.bind(("127.0.0.1", first + 100))  # a Ray worker port of the block
        other.listen()
        rc, calls, out = run_fake_job(tmp_path, fakes, ["n1"], script)
    assert rc == 0, out
    [head] = [c["argv"] for c in calls if c["tool"] == "ray" and c["argv"][0] == "start"]
    assert f"--port={first + 500}" in head
    assert f"ports {first + 500}-{first + 999}" in out


def test_a_head_that_dies_fails_the_job_at_once(tmp_path, fakes):
    script = rendered(tmp_path, "--cpus-per-node", "2", "--storage-path", str(tmp_path / "store"))
    started = time.monotonic()
    rc, calls, out = run_fake_job(tmp_path, fakes, ["n1"], script, extra_env={"FAKE_HEAD_FAILS": "1"})
    assert rc == 1 and "the Ray head (log: " in out and "exited before listening" in out, out
    assert time.monotonic() - started < 30  # not the 180 s head timeout
    assert not [c for c in calls if c["tool"] == "python"]  # no driver
    assert not [c["pid"] for c in calls if c["tool"] == "mlflow" and pid_alive(c["pid"])]


def test_usr1_stops_the_driver_requeues_and_the_next_attempt_resumes(tmp_path, fakes):
    script = rendered(tmp_path, "--cpus-per-node", "2", "--storage-path", str(tmp_path / "store"))

    def usr1_when_driver_runs(process):
        deadline = time.monotonic() + 60
        while not (tmp_path / "driver.started").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        process.send_signal(signal.SIGUSR1)  # what SLURM sends the batch shell before the time limit

    rc, calls, out = run_fake_job(tmp_path, fakes, ["n1"], script, driver="wait_for_usr1", on_start=usr1_when_driver_runs)
    assert "time limit near" in out and "requeueing job 4242" in out, out
    assert ["requeue", "4242"] in [c["argv"] for c in calls if c["tool"] == "scontrol"]
    [driver] = [c["argv"] for c in calls if c["tool"] == "python"]
    assert "--resume" not in driver
    assert not [c["pid"] for c in calls if c["tool"] in ("ray", "mlflow") and pid_alive(c["pid"])]

    rc, calls, out = run_fake_job(tmp_path, fakes, ["n1"], script, driver_rc=0)  # the requeued attempt
    [driver] = [c["argv"] for c in calls if c["tool"] == "python"]
    assert rc == 0 and driver[-1] == "--resume" and "attempt 2" in out


# -- a real SLURM ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from _local_slurm(tmp_path_factory, nodes=1, what="a local SLURM")


@pytest.fixture(scope="module")
def slurm_two_nodes(tmp_path_factory):
    """Two SLURM nodes on this host: two slurmd (node1, node2), each with its own port, spool and
    2 CPUs (Debian's slurm-wlm is built with MULTIPLE_SLURMD)."""
    yield from _local_slurm(tmp_path_factory, nodes=2, what="a local two-node SLURM")


def _local_slurm(tmp_path_factory, nodes: int, what: str):
    """A started LocalSlurm of ``nodes`` nodes with 2 CPUs each, stopped after the module; skips
    with the reason where SLURM is not installed or does not start here."""
    reason = LocalSlurm.unavailable()
    if reason:
        pytest.skip(reason)
    cluster = LocalSlurm(tmp_path_factory.mktemp(f"slurm{nodes}"), cpus=2, nodes=nodes)
    try:
        cluster.start()
    except (SlurmStartError, OSError, subprocess.CalledProcessError) as exc:
        cluster.stop()
        pytest.skip(f"{what} could not start here: {exc}")
    yield cluster
    cluster.stop()


def orchestrator_submit(cluster: LocalSlurm, workdir: Path, *flags: str, command: list[str] | None = None,
                        ) -> tuple[str, Path]:
    """``orchestrator submit`` as a user runs it (``python -m orchestrator submit`` unless
    ``command`` says otherwise); returns the job id and the job folder."""
    result = subprocess.run(
        (command or [sys.executable, "-m", "orchestrator", "submit"]) + list(flags), cwd=workdir,
        env=cluster.env(command_env()), capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"Submitted SLURM job (\d+)", result.stdout).group(1)
    job_dir = Path(re.search(r"job folder: (\S+)", result.stdout).group(1))
    return job_id, job_dir


def job_state(cluster: LocalSlurm, job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=cluster.env(), capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for(predicate, timeout: float, what: str, cluster: LocalSlurm, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    log_text = log.read_text() if log.exists() else "(no job log)"
    pytest.fail(f"timed out waiting for {what}\n--- job log\n{log_text[-6000:]}\n--- slurm\n{cluster.logs(10)}")


def trial_runs(tracking_uri: str, experiment: str):
    """The sweep's trial runs: from the job's MLflow server while it runs, from its SQLite file after."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, "the sweep's MLflow experiment is missing"
    return client.search_runs([exp.experiment_id], "tags.`orchestrator.role` = 'trial'")


def processes_left(job_id: str, job_dir: Path) -> list[str]:
    """Processes still running from this job: Ray's name its temp dir, the MLflow server its store."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"/ray-{job_id}-" in line or str(job_dir) in line]


def small_sweep(workdir: Path, epochs: int, train_samples: list[int], reuse: bool = True) -> Path:
    """The demo's MLP, one trial per training-set size (the sizes set how long each trial runs)."""
    config = yaml.safe_load(DEMO.read_text())
    config["reuse"] = reuse
    config["experiment"] = f"slurm_e{epochs}_t{len(train_samples)}"
    config["search_space"] = {"workload": "mlp", "lr": 0.01, "width": 16, "train_samples": {"grid": train_samples}}
    config["stop"]["epochs"] = epochs
    path = workdir / f"{config['experiment']}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.integration
def test_submit_runs_the_readmes_own_model_on_slurm(slurm, own_model_project, tmp_path):
    """The README's own-model sweep (two trials, one epoch) submitted with the installed command
    from the folder that holds ``my_models/``, with no PYTHONPATH: the job runs there, on a Ray
    cluster inside a real SLURM job with (fake) GPUs from gres, and its workers import the package."""
    gpus = ["--gpus-per-node", "2"] if slurm.has_gpus else []
    started = time.monotonic()
    job_id, job_dir = orchestrator_submit(
        slurm, own_model_project.folder, "--set", "stop.epochs=1", "--cpus-per-node", "2", *gpus,
        "--time", "00:15:00", "--storage-path", str(tmp_path / "store"), "--log-dir", str(tmp_path / "logs"),
        command=[installed_command(), "submit", own_model_project.config],
    )
    log = tmp_path / "logs" / f"orch-wide-{job_id}.out"
    state = wait_for(lambda: (s := job_state(slurm, job_id)).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED",
                     "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") and s, 600, "the job to end", slurm, log)
    elapsed = time.monotonic() - started
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", text[-6000:]
    assert "2/2 trials finished" in text
    # What it prints to read the sweep afterwards names the job's store, not its server (gone now).
    store = f"sqlite:///{job_dir}/mlflow.db"
    assert f"MLflow: {store} (experiment 'wide')" in text and f"--tracking-uri {store}`" in text, text[-3000:]
    assert "View run" not in text  # MLflow's own links to the server
    if slurm.has_gpus:
        assert re.search(r"Ray: 1 node\(s\), 2 CPUs, 2 GPUs", text), text[-3000:]  # gres -> ray start --num-gpus
    assert "ssh -N -L 8265:" in text

    runs = trial_runs(f"sqlite:///{job_dir}/mlflow.db", "wide")
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    assert sorted(int(r.data.params["config.hidden"]) for r in runs) == [256, 1024]
    assert processes_left(job_id, job_dir) == []
    print(f"SLURM sweep: 2 trials in {elapsed:.0f} s from submit to end")


def slow_sbatch(folder: Path, submits_first: bool) -> Path:
    """A folder holding ``sbatch``: the real one, made slow (a busy controller's seconds) before it
    submits or after, so that a Ctrl-C lands in that window; it touches ``folder/waiting`` then."""
    real = subprocess.run(["sh", "-c", "command -v sbatch"], capture_output=True, text=True, check=True).stdout.strip()
    waiting = folder / "waiting"
    script = (f'out=$("{real}" "$@") || exit $?\ntouch "{waiting}"\nsleep 60\necho "$out"\n' if submits_first
              else f'touch "{waiting}"\nsleep 60\nexec "{real}" "$@"\n')
    (folder / "bin").mkdir()
    wrapper = folder / "bin" / "sbatch"
    wrapper.write_text("#!/bin/sh\n" + script)
    wrapper.chmod(0o755)
    return folder / "bin"


@pytest.mark.integration
@pytest.mark.parametrize("submitted", [False, True], ids=["before-slurm-took-it", "after"])
def test_ctrl_c_during_sbatch_says_whether_slurm_took_the_job(slurm, tmp_path, submitted):
    """A Ctrl-C at the terminal reaches ``sbatch`` as well as the command: the job may or may not
    be queued. SLURM is asked: a queued job gets the usual lines (its id, logs, how to stop it),
    none means nothing was submitted and its job folder is removed."""
    config = small_sweep(tmp_path, epochs=1, train_samples=[2048])
    env = slurm.env(command_env())
    env["PATH"] = f"{slow_sbatch(tmp_path, submitted)}{os.pathsep}{env['PATH']}"
    run = subprocess.Popen(
        [installed_command(), "submit", str(config), "--cpus-per-node", "2", "--time", "00:15:00",
         "--storage-path", str(tmp_path / "store"), "--log-dir", str(tmp_path / "logs")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    job_id = None
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "waiting").exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "waiting").exists(), run.communicate()
        os.killpg(run.pid, signal.SIGINT)  # as the terminal does: the whole foreground group
        out, err = run.communicate(timeout=120)
        found = re.search(r"Submitted SLURM job (\d+)", out)
        job_id = found and found.group(1)
        assert run.returncode == 130, out + err
        assert "Traceback" not in err, err
        ours = subprocess.run(["squeue", "--noheader", "--format=%i %o"], env=slurm.env(), capture_output=True,
                              text=True, check=True).stdout
        if submitted:
            assert out.startswith("Interrupted, but SLURM had taken the job:\nSubmitted SLURM job "), out + err
            assert f"scancel --batch --signal=TERM {job_id}" in out
            assert job_id in ours.split()
            assert (tmp_path / "store" / "slurm").exists()
        else:
            assert out.startswith("Interrupted before SLURM took the job: nothing was submitted"), out + err
            assert "job.sbatch" not in ours
            assert list((tmp_path / "store" / "slurm").iterdir()) == []  # its job folder went too
    finally:
        if run.poll() is None:
            run.kill()
        if job_id:
            subprocess.run(["scancel", job_id], env=slurm.env(), check=False)


def signal_time_limit_and_wait_for_the_requeued_end(slurm, job_id: str, log: Path) -> dict:
    """USR1 to the batch step (what ``--signal`` sends before the time limit), then the requeued
    attempt run to its end; the job's final state."""
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm.env(), check=True)
    wait_for(lambda: int(job_state(slurm, job_id).get("Restarts", "0")) >= 1, 300, "the requeue", slurm, log)
    # SLURM holds a requeued job back ~2 minutes (BeginTime); a test need not wait for that, but it
    # must not start the job in the second its last attempt was killed: slurmd compares the new
    # credential's time with the revocation's to the second and refuses it ("credential revoked").
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+3"], env=slurm.env(), check=True)
    return wait_for(lambda: (s := job_state(slurm, job_id)).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED",
                    "TIMEOUT") and s, 600, "the resumed job to end", slurm, log)


@pytest.mark.integration
def test_time_limit_requeues_and_resumes_only_unfinished_trials(slurm, tmp_path):
    """USR1 (what --signal sends before the limit) mid-sweep: stop, requeue, resume, finish the rest.

    Three trials on two CPUs: a short one and a long one run first; the signal comes once the
    short one has finished, while the long ones still have many seconds to go (64x the data), so
    the resumed attempt has both finished and unfinished trials however fast the machine is. (At
    8x, once the suite's trials ran at nice 0, both long ones finished in the ~2 s the signal took.)
    """
    config = small_sweep(tmp_path, epochs=4, train_samples=[2048, 131072, 131072 + 64])
    job_id, job_dir = orchestrator_submit(
        slurm, tmp_path, str(config), "--cpus-per-node", "2", "--time", "00:15:00",
        "--storage-path", str(tmp_path / "store"), "--log-dir", str(tmp_path / "logs"),
    )
    log = tmp_path / "logs" / f"orch-{config.stem}-{job_id}.out"

    def trials_finished() -> int | None:
        """Trials the live view reported finished in the job log (the driver prints unbuffered), while the job runs."""
        if job_state(slurm, job_id).get("JobState") != "RUNNING" or not log.exists():
            return None
        return log.read_text().count(" finished: 4/4 epochs")

    # The job's MLflow server answers its own credentials only (slurm/README.md).
    wait_for(lambda: (job_dir / "cluster.env").exists(), 400, "the job's cluster", slurm, log)
    found = dict(line.split("=", 1) for line in (job_dir / "cluster.env").read_text().split())
    settings = dict(line.split(" = ", 1) for line in Path(found["MLFLOW_AUTH_CONFIG"]).read_text().splitlines()
                    if " = " in line)
    search = f"{found['MLFLOW_TRACKING_URI']}/api/2.0/mlflow/experiments/search?max_results=1"
    assert requests.get(search, timeout=30).status_code == 401
    assert requests.get(search, auth=(settings["admin_username"], settings["admin_password"]), timeout=30).ok

    wait_for(lambda: 0 < (trials_finished() or 0) < 3, 400, "a first trial to finish", slurm, log)
    state = signal_time_limit_and_wait_for_the_requeued_end(slurm, job_id, log)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", text[-6000:]
    assert "time limit near" in text and "attempt 2" in text and "Resuming " in text
    # The interrupted attempt names the command that continues the sweep: this script again, not its
    # driver's command line (the job's Ray and MLflow server); the resume writes where it did.
    assert f"Interrupted trials continue from their last checkpoints with: sbatch {job_dir}/job.sbatch" in text, text[-6000:]
    assert "this resume writes to" not in text
    # Each trial completed exactly once across both attempts: the resumed one ran only the rest.
    assert text.count(" finished: 4/4 epochs") == 3
    assert " finished: 4/4 epochs" in text[text.index("attempt 2"):]
    # The requeued attempt's Ray gave the node a new id; the node is the same, so no trial moved.
    assert not re.search(r"moved \S+->", text[text.index("attempt 2"):]), text[-3000:]
    runs = trial_runs(f"sqlite:///{job_dir}/mlflow.db", config.stem)
    assert len(runs) == 3 and {r.info.status for r in runs} == {"FINISHED"}, [(r.info.run_name, r.info.status) for r in runs]
    assert processes_left(job_id, job_dir) == []


@pytest.mark.integration
def test_the_printed_stop_command_stops_the_sweep_and_tears_the_job_down_in_order(slurm, tmp_path):
    """``scancel --batch --signal=TERM`` (what ``submit`` prints): the batch shell alone gets it, stops
    the driver, which prints its table and the line that continues the sweep, then the job's Ray
    and MLflow server. A plain ``scancel`` signals every process of the job at once, the Ray head too,
    and kills them all after KillWait: the job's log ended mid-stop, and Ray's temp dir stayed."""
    config = small_sweep(tmp_path, epochs=40, train_samples=[16384, 16384 + 64])
    job_id, job_dir = orchestrator_submit(
        slurm, tmp_path, str(config), "--cpus-per-node", "2", "--time", "00:15:00",
        "--storage-path", str(tmp_path / "store"), "--log-dir", str(tmp_path / "logs"),
    )
    log = tmp_path / "logs" / f"orch-{config.stem}-{job_id}.out"
    wait_for(lambda: log.exists() and log.read_text().count(" plan: ") == 2, 400, "both trials to train", slurm, log)
    subprocess.run(["scancel", "--batch", "--signal=TERM", job_id], env=slurm.env(), check=True)
    state = wait_for(lambda: (s := job_state(slurm, job_id)).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED")
                     and s, 300, "the job to end", slurm, log)
    text = log.read_text()
    assert "SIGTERM: stopping the sweep" in text and "INTERRUPTED" in text, text[-6000:]
    assert f"Interrupted trials continue from their last checkpoints with: sbatch {job_dir}/job.sbatch" in text
    assert text.rstrip().endswith("torn down"), text[-3000:]
    assert state["JobState"] == "FAILED"  # the driver's exit 1: its sweep did not finish
    assert processes_left(job_id, job_dir) == []


@pytest.mark.integration
def test_time_limit_requeue_resumes_a_sweep_that_checkpoints_between_evaluations(slurm, tmp_path):
    """USR1 once both trials have a checkpoint of their own cadence (every 40 steps, evaluations
    every 100): the requeued attempt resumes them, their checkpoint-only reports lacking the
    metric as before, and the job completes with each report in MLflow once (it used to fail
    Tune's strict metric check on the first such report, and the job ended FAILED). Submitted with
    the installed command, so the job's driver is that command too."""
    config = small_sweep(tmp_path, epochs=20, train_samples=[16384, 16384 + 64])
    sweep = yaml.safe_load(config.read_text())
    sweep.update(stop={"steps": 3000}, eval_every={"steps": 100}, checkpoint={"every": {"steps": 40}})
    config.write_text(yaml.safe_dump(sweep))
    job_id, job_dir = orchestrator_submit(
        slurm, tmp_path, str(config), "--cpus-per-node", "2", "--time", "00:15:00",
        "--storage-path", str(tmp_path / "store"), "--log-dir", str(tmp_path / "logs"),
        command=[installed_command(), "submit"],
    )
    log = tmp_path / "logs" / f"orch-{config.stem}-{job_id}.out"
    trials = tmp_path / "store" / job_dir.name

    def both_checkpointed() -> bool:
        folders = [p for p in trials.glob("train_trial_*") if p.is_dir()]
        return len(folders) == 2 and all(any(p.glob("checkpoint_*")) for p in folders)

    wait_for(both_checkpointed, 400, "both trials' first checkpoints", slurm, log)
    state = signal_time_limit_and_wait_for_the_requeued_end(slurm, job_id, log)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", text[-6000:]
    resumed = text[text.index("attempt 2"):]
    assert "Resuming " in resumed and "2/2 trials finished" in resumed, text[-6000:]
    assert "Traceback" not in resumed and "did not include the specified metric" not in text, text[-6000:]
    runs = trial_runs(f"sqlite:///{job_dir}/mlflow.db", config.stem)
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{job_dir}/mlflow.db")
    for run in runs:
        steps = [int(m.step) for m in client.get_metric_history(run.info.run_id, "step")]
        assert sorted(steps) == sorted(set(steps)) and max(steps) == 3000, steps
    assert processes_left(job_id, job_dir) == []


@pytest.mark.integration
def test_submit_runs_on_two_slurm_nodes(slurm_two_nodes, tmp_path, monkeypatch):
    """A sweep of four one-CPU trials submitted to two SLURM nodes of two CPUs: the Ray head on
    node1 and a worker on node2 (each its own slurmd, on its own ports), trials on both, the
    table naming the node of each. Submitted from a shell that keeps a one-machine Ray on the
    loopback (as `orchestrator run` does in its own process), which the job must not inherit."""
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    slurm = slurm_two_nodes
    workdir = tmp_path / "work"
    workdir.mkdir()
    # Each trial in a worker of its own (`reuse: false`): Tune asks for the four placements at once
    # and two must go to node2. With reuse, a trial that ends on node1 before node2's workers have
    # imported torch takes the next trial, and Tune cancels the worker starting on node2 for it
    # (TuneController._maybe_reuse_cached_actor): on a busy two-core machine all four ran on node1.
    config = small_sweep(workdir, epochs=1, train_samples=[4000, 4001, 4002, 4003], reuse=False)
    job_id, job_dir = orchestrator_submit(
        slurm, workdir, str(config), "--nodes", "2", "--cpus-per-node", "2", "--time", "00:15:00",
        "--storage-path", str(tmp_path / "store"), "--log-dir", str(tmp_path / "logs"),
    )
    log = tmp_path / "logs" / f"orch-{config.stem}-{job_id}.out"
    state = wait_for(lambda: (s := job_state(slurm, job_id)).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED",
                     "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") and s, 600, "the job to end", slurm, log)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", text[-6000:]
    assert state["NodeList"] == "node[1-2]"
    assert "Ray cluster: 2/2 nodes, CPU 4" in text
    assert "4/4 trials finished" in text
    finals = [lines[-1] for lines in trial_results(f"{tmp_path}/store/{config.stem}*/*/result.json").values()]
    assert len(finals) == 4 and {r["node_name"] for r in finals} == {"node1", "node2"}
    table = text[text.index("trial  "):]
    assert table.splitlines()[0].split()[:2] == ["trial", "node"] and "node2" in table
    assert processes_left(job_id, job_dir) == []
