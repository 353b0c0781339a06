"""The installed ``orchestrator`` command, run as a user runs it: the README's own-model example
from the folder that holds ``my_models/``, and the one line a broken user package gets.

Every command here is the console script ``pip install`` wrote (not ``python -m``, which puts
the working directory on Python's path by itself) in a subprocess whose working directory is
a temporary folder outside the repository, with no PYTHONPATH.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import command_env, installed_command

NO_PACKAGE = ("error: workload.name: workload 'my_models.wide:WideNet': cannot import module 'my_models.wide' "
              "(No module named 'my_models')")


def run(command: list[str], cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=command_env(), capture_output=True, text=True, timeout=timeout)


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
