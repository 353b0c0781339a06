"""The one ``run`` command line: what the resume hint, a Ray Job's entrypoint and a SLURM job's
driver line are rendered from."""

from __future__ import annotations

import shlex

from orchestrator.cli import build_parser
from orchestrator.run_request import Expanded, RunRequest


def test_a_parsed_run_command_line_renders_back_to_itself():
    argv = ["run", "sweep file.yaml", "--set", "search_space.width={grid: [16, 32]}", "--storage-path", "/r",
            "--tracking-uri", "http://mlflow:5000", "--ray-address", "10.0.0.1:6379", "--num-cpus", "2",
            "--num-gpus", "0.5", "--host-memory", "64GiB", "--offline-tracking", "--name", "exp_1", "--resume"]
    request = RunRequest.from_args(build_parser().parse_args(argv))
    assert request.arguments() == argv
    assert shlex.split(request.command(("python", "-m", "orchestrator"))) == ["python", "-m", "orchestrator", *argv]
    assert RunRequest.from_args(build_parser().parse_args(shlex.split(request.command(())))) == request


def test_flags_left_at_their_defaults_are_left_out():
    assert RunRequest("sweep.yaml").arguments() == ["run", "sweep.yaml"]
    # `submit` has no --name, --resume or --ray-address: its request keeps their defaults.
    request = RunRequest.from_args(build_parser().parse_args(["submit", "sweep.yaml", "--set", "stop.epochs=1"]))
    assert request == RunRequest("sweep.yaml", overrides=("stop.epochs=1",))


def test_verbosity_travels_with_the_command():
    """A Ray Job's driver, or a resumed sweep, prints what the user asked this one to print."""
    assert RunRequest("sweep.yaml", verbose=True, resume=True).arguments() == ["run", "sweep.yaml", "--verbose", "--resume"]


def test_values_the_shell_fills_in_are_written_as_they_are():
    request = RunRequest(Expanded('"$CONFIG"'), overrides=("a=b c",), tracking_uri=Expanded('"$TRACKING_URI"'))
    assert request.command((Expanded('"$PYTHON"'), "-u", "-m", "orchestrator")) == (
        '"$PYTHON" -u -m orchestrator run "$CONFIG" --set \'a=b c\' --tracking-uri "$TRACKING_URI"')


def test_by_default_the_command_starts_as_the_user_started_this_one(monkeypatch):
    import sys

    monkeypatch.setattr(sys, "argv", ["/opt/sweeps/.venv/bin/orchestrator", "run", "sweep.yaml"])
    assert RunRequest("sweep.yaml", resume=True).command() == "/opt/sweeps/.venv/bin/orchestrator run sweep.yaml --resume"
