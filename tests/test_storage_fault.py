"""A storage that refuses a checkpoint loses nothing (``orchestrator/storage_fault.py``, with
``orchestrator/trial/storage.py`` in the trial): a short outage is waited out, a long one stops
the sweep as Ctrl-C does, every trial ``INTERRUPTED``, and the printed ``--resume`` finishes it
once the storage is back.

The faults are real: the sweep's storage is a bind mount (or a small tmpfs) that the test makes
read-only, fills, or unmounts mid-sweep, through the installed command from a folder outside the
repository. Mounting needs root (CAP_SYS_ADMIN); without it those tests skip, saying so.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.outcome import recording
from orchestrator.storage_fault import StopOnStorageFault
from tests.conftest import command_env, rows_trained
from tests.test_cli import PACED, STEP_SWEEP, _run_steps, _sweep_run_statuses, _trial_histories, unpaced


def test_the_first_storage_fault_stops_the_sweep_as_ctrl_c_does():
    """Tune's SIGINT handler of the moment runs once, and the record says why the sweep stopped."""
    calls = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        stopper = StopOnStorageFault()
        trial = type("Trial", (), {"trial_id": "t0", "path": "/s/cut/t0"})()
        with recording() as record:
            stopper.on_trial_result(1, [], trial, {"step": 20})
            assert calls == [] and record.stop_reason is None
            stopper.on_trial_result(2, [], trial, {"storage_fault": "[Errno 28] No space left on device (tried 5 times over 15 s)"})
            stopper.on_trial_result(3, [], trial, {"storage_fault": "again"})
        assert calls == [signal.SIGINT]
        assert record.stop_reason == "the storage did not take trial t0's checkpoint: [Errno 28] No space left on device (tried 5 times over 15 s)"
    finally:
        signal.signal(signal.SIGINT, before)


# -- through the installed command, on a storage that fails for real ---------------------------


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


class Storage:
    """The sweep's storage folder ``path``: a bind mount of ``real``, or (``full``) a small tmpfs."""

    def __init__(self, folder: Path, kind: str):
        self.kind, self.real, self.path = kind, folder / "real", folder / "store"
        self.real.mkdir()
        self.path.mkdir()
        try:
            if kind == "full":
                _mount("-t", "tmpfs", "-o", "size=64m", "tmpfs", str(self.path))
            else:
                _mount("--bind", str(self.real), str(self.path))
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"needs a mount (root with CAP_SYS_ADMIN) to make the storage fail for real: {exc}")

    def fail(self) -> None:
        if self.kind == "full":
            with open(self.path / "filler", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                except OSError:
                    pass
            return
        subprocess.run(["umount", "-l", str(self.path)], check=True)  # the lazy way: Tune holds files open in it
        if self.kind == "read-only":  # a new mount of the same folder, read-only
            _mount("--bind", str(self.real), str(self.path))
            _mount("-o", "remount,bind,ro", str(self.path))

    def come_back(self) -> None:
        if self.kind == "full":
            (self.path / "filler").unlink()
            return
        if self.kind == "read-only":
            subprocess.run(["umount", "-l", str(self.path)], check=True)
        _mount("--bind", str(self.real), str(self.path))

    def remove(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@pytest.fixture
def storage_sweep(own_model_project, request):
    """The step-cadence sweep of tests/test_cli.py (checkpoints every 20 steps of ~80 ms) and
    its storage, of the kind the test's parameter names."""
    folder = own_model_project.folder
    (folder / "my_models" / "paced.py").write_text(PACED.replace('"0.015"', '"0.08"'))
    (folder / "steps.yaml").write_text(STEP_SWEEP)
    storage = Storage(folder, request.param)
    try:
        yield folder, storage
    finally:
        storage.remove()


def _with_storage(storage: Storage, name: str, resume: bool = False) -> list[str]:
    command = _run_steps(name, resume=resume)
    return command[:3] + ["--storage-path", str(storage.path)] + command[3:]


def _sweep_through_an_outage(folder: Path, storage: Storage, outage_s: float) -> subprocess.CompletedProcess:
    """Run the sweep; once both trials have a checkpoint, fail the storage for ``outage_s``, or
    until the sweep has ended if that comes first (a sweep that stopped takes nothing more)."""
    command = _with_storage(storage, "cut")
    sweep = subprocess.Popen(command, cwd=folder, env=command_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while sweep.poll() is None and time.monotonic() < deadline:
            if len({os.path.dirname(c) for c in glob.glob(f"{storage.path}/cut/*/checkpoint_*")}) == 2:
                break
            time.sleep(0.2)
        assert sweep.poll() is None, "the sweep ended before every trial had a checkpoint"
        storage.fail()
        back_at = time.monotonic() + outage_s
        while sweep.poll() is None and time.monotonic() < back_at:
            time.sleep(0.2)
        storage.come_back()
        out, _ = sweep.communicate(timeout=400)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
            sweep.wait()
    return subprocess.CompletedProcess(command, sweep.returncode, out, "")


@pytest.mark.integration
@pytest.mark.parametrize("storage_sweep", ["read-only"], indirect=True)
def test_a_short_storage_outage_is_waited_out(storage_sweep):
    """A few seconds of a read-only storage: the checkpoint reports are tried again until it
    takes them, and the sweep finishes as if nothing happened."""
    folder, storage = storage_sweep
    proc = _sweep_through_an_outage(folder, storage, outage_s=3)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "2/2 trials finished" in proc.stdout and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert "the storage did not take a checkpoint" in proc.stdout  # the retry, said
    assert rows_trained(proc.stdout, "150/150 steps") == 2


@pytest.mark.integration
@pytest.mark.parametrize("storage_sweep", ["read-only", "full", "unmounted"], indirect=True)
def test_a_storage_that_stays_away_stops_the_sweep_and_resume_finishes_it(storage_sweep):
    """The storage refuses for longer than the retries last (15 s): the console names the path
    the checkpoint went to, the sweep stops as Ctrl-C stops it (the table, every trial
    INTERRUPTED, none failed, the resume command, exit 1, no traceback), and once the storage
    is back the printed command finishes every trial, each step's report in MLflow once."""
    folder, storage = storage_sweep
    proc = _sweep_through_an_outage(folder, storage, outage_s=25)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "ERROR:" not in out, out[-3000:]
    [stopped] = re.findall(r"^\w+ checkpoint not stored: (.*)$", out, re.M)
    assert "stopping the sweep" in stopped and "(tried 5 times over 15 s)" in stopped
    assert f"{storage.path}/cut/" in stopped  # the trial's folder, where the refusal names no file
    assert "0/2 trials finished" in out and out.count("INTERRUPTED") >= 2, out[-3000:]
    assert re.search(r"^Stopped: the storage did not take trial \w+'s checkpoint", out, re.M)
    [printed] = re.findall(r"^Interrupted trials continue from their last checkpoints with: (.*)$", out, re.M)
    assert shlex.split(printed)[1:] == _with_storage(storage, "cut", resume=True)[1:]
    assert {status for status, _ in _trial_histories(folder, "cut").values()} == {"KILLED"}

    # The rest of the trials unpaced: nothing interrupts the resumed sweep.
    proc = subprocess.run(shlex.split(printed), cwd=folder, env=unpaced(), capture_output=True, text=True, timeout=600)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert "Traceback" not in said and "2/2 trials finished" in proc.stdout, said[-3000:]
    assert rows_trained(proc.stdout, "150/150 steps") == 2
    for hidden, (status, history) in _trial_histories(folder, "cut").items():
        assert status == "FINISHED", hidden
        steps = [step for step, _ in history["step"]]
        assert steps == sorted(set(steps)) and steps[-1] == 150, (hidden, steps)  # each report once, to the end
    assert _sweep_run_statuses(folder, "cut") == ["FINISHED"]  # no second (FAILED) run of the sweep
