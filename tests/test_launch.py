"""The launcher contract (``orchestrator/launch/``): every backend gets the pre-flight ``run``
makes, so a sweep ``run`` refuses in one line is refused in the same line by ``run --address``
and ``submit`` before anything reaches a cluster; and a new backend is one class plus one
registration line, as the toy one here shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
from ports import free_port

from orchestrator.cli import main
from orchestrator.config import load_spec
from orchestrator.errors import UserError
from orchestrator.launch import LAUNCHERS, Launcher, get_launcher, launch, register
from orchestrator.run_request import RunRequest
from orchestrator.runner import estimate_before_start
from tests.conftest import ROOT, command_env, installed_command

SWEEP = """
experiment: launch
workload: {name: mlp, params: {depth: 1}}
search_space:
  lr: 0.01
  width: {grid: [16, 32]}
effective_batch_size: 64
stop: {epochs: 1}
resources: {cpu: 1}
"""


class ShellLauncher(Launcher):
    """A toy backend: runs the request's command line in a shell, with this Python."""

    name: ClassVar[str] = "shell"

    @classmethod
    def from_args(cls, args) -> ShellLauncher:
        return cls()

    def submit(self, request: RunRequest, spec) -> int:
        return subprocess.run(["bash", "-c", request.command((sys.executable, "-m", "orchestrator"))],
                              env=command_env(), check=False).returncode


register(ShellLauncher)


@pytest.fixture
def sweep_file(tmp_path, monkeypatch):
    """The sweep in the working directory (a Ray Job uploads it from there), which is also where
    results would go."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweep.yaml").write_text(SWEEP)
    return "sweep.yaml"


def commands(sweep: str) -> dict[str, list[str]]:
    """The same sweep through each launcher of the command line. No dashboard answers at the
    address and ``--dry-run`` submits nothing: whatever the pre-flight passes stops there."""
    return {
        "run": ["run", sweep],
        "run --address": ["run", sweep, "--address", f"http://127.0.0.1:{free_port()}"],
        "submit": ["submit", sweep, "--cpus-per-node", "2", "--dry-run"],
    }


def refusals(capsys, sweep: str, *flags: str, only=("run", "run --address", "submit")) -> dict[str, str]:
    said = {}
    for launcher, argv in commands(sweep).items():
        if launcher in only:
            assert main([*argv, *flags]) == 2, launcher
            said[launcher] = capsys.readouterr().err
    return said


def test_every_launcher_is_registered_under_its_name():
    for name in ("local", "ray-job", "slurm", "shell"):
        assert get_launcher(name).name == name
    assert set(LAUNCHERS) >= {"local", "ray-job", "slurm"}


@pytest.mark.parametrize("flags, message", [
    (["--set", "resources.cpu=-1"], "error: resources.cpu: "),
    (["--set", "workload.params.train_samples=0"], "error: workload mlp (width=16): train_data has 0 samples"),
    (["--set", "workload.name=tests.workloads:BrokenCollateWorkload"],
     "error: workload tests.workloads:BrokenCollateWorkload (width=16): collate() of two train_data samples failed"),
    (["--set", "workload.name=tests.workloads:GroupedMLPWorkload", "--set", "search_space.width=12"],
     "error: workload tests.workloads:GroupedMLPWorkload (width=12): build_model() failed"),
], ids=["config", "empty data", "collate", "model"])
def test_a_sweep_run_refuses_is_refused_in_the_same_line_by_every_launcher(sweep_file, tmp_path, capsys, flags, message):
    said = refusals(capsys, sweep_file, *flags)
    assert said["run"].startswith(message) and said["run"].count("\n") == 1, said
    assert said["run --address"] == said["run"] == said["submit"]
    assert not (tmp_path / "orchestrator_results").exists()


@pytest.mark.parametrize("flags, message, only", [
    (["--tracking-uri", ""], "error: --tracking-uri: expected a non-empty string, got ''\n",
     ("run", "run --address", "submit")),
    (["--allow-config-change"], "error: --allow-config-change: only with --resume (a new sweep has no config to "
     "differ from)\n", ("run", "run --address")),
], ids=["empty tracking uri", "allow a change to nothing"])
def test_a_flag_that_would_be_quietly_ignored_is_refused_by_every_launcher(sweep_file, tmp_path, capsys, flags,
                                                                            message, only):
    said = refusals(capsys, sweep_file, *flags, only=only)
    assert set(said.values()) == {message}, said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]


def test_a_sweep_name_that_is_a_path_is_refused_before_a_job_is_sent(sweep_file, capsys):
    said = refusals(capsys, sweep_file, "--name", "../elsewhere", only=("run", "run --address"))  # submit names its own
    assert said["run"] == said["run --address"]
    assert said["run"].startswith("error: --name: expected a name, not a path") and said["run"].count("\n") == 1


@pytest.mark.parametrize("flags, said", [
    (["--storage-path", "s3://bucket/sweeps"], "error: --storage-path: expected a folder, not a URI, got 's3://bucket/sweeps'"),
    (["--set", "storage_path=gs://bucket/sweeps"], "error: storage_path: expected a folder, not a URI, got 'gs://bucket/sweeps'"),
], ids=["flag", "key"])
def test_a_storage_uri_is_refused_by_every_launcher_before_anything_is_written(sweep_file, tmp_path, capsys, flags, said):
    """Tune would take it; the sweep's own state (its claim, whole copies of Tune's state, unsent
    MLflow writes) is file I/O, which made it a local folder named ``s3:``."""
    refused = refusals(capsys, sweep_file, *flags)
    assert refused["run"] == refused["run --address"] == refused["submit"]
    assert refused["run"].startswith(said) and "s3fs, gcsfuse or blobfuse2" in refused["run"]
    assert refused["run"].count("\n") == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]


def test_a_model_whose_step_fails_is_refused_before_a_job_is_sent(sweep_file, capsys):
    """``run`` refuses it with its estimate's line (made while its Ray starts); the other
    launchers make the same estimate before sending anything."""
    flags = ["--set", "workload.name=tests.workloads:LossFailsWorkload"]
    with pytest.raises(UserError) as err:
        estimate_before_start(load_spec(sweep_file, flags[1::2]))
    assert "the loss is broken" in str(err.value)
    said = refusals(capsys, sweep_file, *flags, only=("run --address", "submit"))
    assert said == {"run --address": f"error: {err.value}\n", "submit": f"error: {err.value}\n"}


@pytest.mark.parametrize("flags, message", [
    (["--num-cpus", "0"], "error: --num-cpus: expected 1 or more, got 0\n"),
    (["--num-gpus", "-1"], "error: --num-gpus: expected 0 or more, got -1\n"),
    # Not this machine's (TEST-NET-1): Ray would try 50 ports on it for a minute, then end the sweep in a traceback.
    (["--dashboard", "--dashboard-host", "192.0.2.1"], "error: --dashboard-host: expected an address of this machine "
     "(or 0.0.0.0 for all of them), got '192.0.2.1' (Cannot assign requested address)\n"),
], ids=["cpus", "gpus", "dashboard host"])
def test_the_embedded_rays_flags_are_checked_before_anything_starts(sweep_file, tmp_path, capsys, flags, message):
    import ray

    assert main(["run", sweep_file, *flags]) == 2
    assert capsys.readouterr() == ("", message)
    assert not ray.is_initialized() and not (tmp_path / "orchestrator_results").exists()


@pytest.mark.parametrize("flags", [["--num-cpus", "8"], ["--num-gpus", "0"], ["--dashboard"]])
def test_the_embedded_rays_flags_are_refused_where_the_sweep_joins_a_cluster(sweep_file, tmp_path, capsys, flags):
    """They sized the Ray this machine would start: joining a cluster, they were silently dropped
    (Ray's own ``ray.init(address=..., num_cpus=...)`` refuses them too)."""
    import ray

    assert main(["run", sweep_file, "--ray-address", "127.0.0.1:6379", *flags]) == 2
    assert capsys.readouterr() == ("", f"error: {flags[0]}: only for the embedded local Ray; with --ray-address the "
                                       "trials get the cluster's resources and dashboard (what its `ray start` gave them)\n")
    assert not ray.is_initialized() and not (tmp_path / "orchestrator_results").exists()


def test_a_sweep_that_passes_reaches_the_backend(sweep_file, capsys):
    assert main(commands(sweep_file)["run --address"]) == 2
    assert "no Ray dashboard answers there" in capsys.readouterr().err
    assert main(commands(sweep_file)["submit"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("#!/bin/bash")  # the script alone: what the pre-flight says goes to stderr
    assert "Estimated the memory of 2 distinct trial configuration(s)" in err


def test_a_sweep_stopped_at_once_prints_the_resume_command_of_its_own_folder(sweep_file, capsys, monkeypatch):
    """A second Ctrl-C while the sweep runs: the resume command names the sweep's folder, as the
    graceful stop's does; without it, ``--resume`` takes the experiment's newest sweep, which may
    be another one started since."""
    import orchestrator.launch.local as local
    from orchestrator.runner import StoppedAtOnce

    def stopped(*args, **kwargs):
        raise StoppedAtOnce("launch_20261206-011532_2")

    monkeypatch.setattr(local, "run_sweep", stopped)
    assert main(["run", sweep_file, "--num-cpus", "2"]) == 130
    said = capsys.readouterr().err.strip().splitlines()
    [line] = [line for line in said if line.startswith("Interrupted. Continue the sweep with: ")]
    assert line.endswith(" run sweep.yaml --num-cpus 2 --name launch_20261206-011532_2 --resume"), said


def test_the_installed_command_refuses_alike_from_the_users_folder(own_model_project):
    """The README's own model, with a batch larger than its data, through each launcher with the
    installed command, from the folder that holds ``my_models/``."""
    said = {}
    for launcher, argv in commands(own_model_project.config).items():
        run = subprocess.run(
            [installed_command(), *argv, "--set", "effective_batch_size=8192"],
            cwd=own_model_project.folder, env=command_env(), capture_output=True, text=True, timeout=300,
        )
        assert run.returncode == 2, run.stderr
        said[launcher] = run.stderr
    assert said["run"].startswith("error: workload my_models.wide:WideNet (hidden=256): train_data has 4096 samples, "
                                  "fewer than one optimizer step (effective_batch_size 8192)"), said
    assert said["run --address"] == said["run"] == said["submit"]


def test_the_toy_launcher_refuses_what_run_refuses(sweep_file, tmp_path):
    request = RunRequest(sweep_file, overrides=("workload.params.eval_samples=0",))
    with pytest.raises(UserError, match="eval_data has no samples"):
        launch(get_launcher("shell")(), request)


@pytest.mark.integration
def test_a_registered_toy_launcher_runs_a_real_sweep(tmp_path):
    """One trial of the demo sweep through the toy launcher: its shell runs the rendered command."""
    request = RunRequest(
        str(ROOT / "configs" / "demo_cpu.yaml"),
        overrides=("search_space.workload=mlp", "search_space.lr=0.01", "search_space.width=16", "stop.epochs=1"),
        storage_path=str(tmp_path / "results"), tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", num_cpus=1,
        name="toy",
    )
    assert launch(get_launcher("shell")(), request) == 0
    assert list(Path(tmp_path / "results" / "toy").glob("*/result.json"))
