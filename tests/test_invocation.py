"""The words that start this command again, as the user started it (``orchestrator.invocation``)."""

import sys
from pathlib import Path

import pytest

import orchestrator
from orchestrator.invocation import command_prefix, tool

MAIN = str(Path(orchestrator.__file__).with_name("__main__.py"))


@pytest.fixture
def script(tmp_path):
    """An ``orchestrator`` console script in a venv's bin folder of its own."""
    path = tmp_path / "venv" / "bin" / "orchestrator"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_a_script_not_on_path_is_given_as_typed(script, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert command_prefix([str(script), "run"]) == [str(script)]
    monkeypatch.chdir(script.parent.parent.parent)
    assert command_prefix(["venv/bin/orchestrator", "run"]) == ["venv/bin/orchestrator"]  # relative, as typed


def test_the_bare_name_where_path_finds_the_same_script(script, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin")
    assert command_prefix([str(script), "run"]) == ["orchestrator"]  # an activated venv
    other = tmp_path / "other" / "orchestrator"
    other.parent.mkdir()
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    assert command_prefix([str(other), "run"]) == [str(other)]  # PATH's orchestrator is another one


def test_python_dash_m_keeps_the_interpreter_as_typed():
    argv, orig = [MAIN, "run"], [".venv/bin/python", "-u", "-m", "orchestrator", "run"]
    assert command_prefix(argv, orig) == [".venv/bin/python", "-m", "orchestrator"]
    assert command_prefix(argv, ["python", "-m", "orchestrator", "run"]) == ["python", "-m", "orchestrator"]


def test_called_from_python_it_is_this_interpreter_with_dash_m():
    assert command_prefix(["/x/bin/pytest", "tests"], ["/x/bin/python", "/x/bin/pytest"]) == [
        sys.executable, "-m", "orchestrator"]


def test_ray_is_named_as_the_user_can_run_it(monkeypatch):
    ray = Path(sys.executable).parent / "ray"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert tool("ray") == str(ray)
    monkeypatch.setenv("PATH", f"{ray.parent}:/usr/bin")
    assert tool("ray") == "ray"
