"""``scripts/test.sh``, the README's and CI's test command: it says which system packages it
installs and why before installing any, and ``ORCHESTRATOR_NO_SYSTEM_PACKAGES=1`` installs none.

Each run collects one small test module only; an ``apt-get`` first on PATH records any call
instead of installing.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest
from system_packages import NO_SYSTEM_PACKAGES

from tests.conftest import ROOT

NOTICE = "test.sh: the integration tests use system packages"


@pytest.fixture
def apt_get(tmp_path):
    """A recording ``apt-get``; returns the file its calls go to."""
    calls = tmp_path / "apt-get.calls"
    script = tmp_path / "bin" / "apt-get"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\necho "apt-get $*" >> {calls}\n')
    script.chmod(0o755)
    return calls


def run_test_sh(apt_get, **env: str) -> subprocess.CompletedProcess:
    path = f"{apt_get.parent / 'bin'}{os.pathsep}{os.environ['PATH']}"
    pytest_args = ["--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_units.py"]  # writes nothing
    return subprocess.run(["bash", "scripts/test.sh", *pytest_args], cwd=ROOT,
                          env={**os.environ, "PATH": path, **env}, capture_output=True, text=True, timeout=300)


def test_with_the_variable_nothing_is_installed_and_it_says_so(apt_get):
    proc = run_test_sh(apt_get, **{NO_SYSTEM_PACKAGES: "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{NO_SYSTEM_PACKAGES}=1: installing no system packages" in proc.stdout
    assert NOTICE not in proc.stdout and not re.search("^install_(slurm|browser|postgres): ", proc.stdout, re.M)
    assert not apt_get.exists()
    assert "tests/test_units.py::" in proc.stdout  # and the tests asked for were collected


def test_without_it_the_packages_and_their_reasons_come_first(apt_get):
    proc = run_test_sh(apt_get, **{NO_SYSTEM_PACKAGES: ""})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    notice = proc.stdout.index(NOTICE)
    for installer in ("install_slurm", "install_browser", "install_postgres"):
        said = [m.start() for m in re.finditer(f"^{installer}: ", proc.stdout, re.M)]
        assert said and min(said) > notice, proc.stdout  # each installer reports, after the notice


def test_the_notice_names_what_each_installer_installs():
    """The notice's package list is the packages each installer hands ``apt_install``."""
    script = (ROOT / "scripts" / "test.sh").read_text()
    notice = script[script.index("<<'NOTICE'\n"):script.index("\nNOTICE\n")].splitlines()[1:]
    for installer in ("install_slurm.sh", "install_browser.sh", "install_postgres.sh"):
        [words] = [line.split() for line in notice if f"scripts/{installer}" in line.split()]
        named = words[:words.index(f"scripts/{installer}")]
        [call] = [line for line in (ROOT / "scripts" / installer).read_text().splitlines()
                  if line.startswith("apt_install ")]
        installs = shlex.split(call)[4:]  # apt_install LABEL WHO_SKIPS PRESENT PACKAGE...
        assert named == installs, (installer, named, installs)
