"""orchestrator.trial.checkpoint: an attempt's scratch folder and newest checkpoint, and the
folders that killed attempts left on a node."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from orchestrator.trial.checkpoint import OWNER_LOCK, LocalCheckpoints, remove_abandoned

#: An attempt in a process of its own: makes its scratch folder, saves a checkpoint, says where,
#: and waits to be killed.
ATTEMPT = textwrap.dedent("""
    import sys, time
    from orchestrator.trial.checkpoint import LocalCheckpoints
    checkpoints = LocalCheckpoints(sys.argv[1])
    checkpoints.save({"step": 7})
    print(checkpoints.scratch, flush=True)
    time.sleep(600)
""")


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """The temp folder of this process and of those the test starts, where scratch folders go."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    monkeypatch.setenv("TMPDIR", str(root))
    return root


def start_attempt(trial: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-c", ATTEMPT, trial], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    return process, process.stdout.readline().strip()


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()
    process.stdout.close()


def test_the_newest_checkpoint_replaces_the_one_before_and_the_folder_goes_with_the_attempt(temp_root):
    checkpoints = LocalCheckpoints("trial_1")
    first = checkpoints.save({"step": 1})
    second = checkpoints.save({"step": 2, "weights": torch.ones(3)})
    assert not os.path.exists(first)
    assert checkpoints.load(map_location="cpu")["step"] == 2
    assert os.path.dirname(second) == checkpoints.scratch
    assert os.path.basename(checkpoints.scratch).startswith("orchestrator-trial_1-")
    checkpoints.remove()
    assert os.listdir(temp_root) == []


def test_a_checkpoint_that_fails_to_write_leaves_the_one_before_as_the_newest(temp_root):
    checkpoints = LocalCheckpoints("trial_1")
    kept = checkpoints.save({"step": 1})

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        checkpoints.save({"step": 2, "bad": Unpicklable()})
    assert checkpoints.newest == kept
    assert sorted(os.listdir(checkpoints.scratch)) == sorted([OWNER_LOCK, os.path.basename(kept)])  # no partial one
    assert checkpoints.load(map_location="cpu") == {"step": 1}
    checkpoints.remove()


def test_a_killed_attempts_folder_is_removed_by_the_next_attempt_on_the_node_of_any_trial(temp_root):
    """A live attempt's folder is never taken, whichever trial starts beside it; once its process
    is killed (no ``finally`` runs), the next attempt to start, of another trial, removes it."""
    alive, alive_folder = start_attempt("trial_a")
    killed, killed_folder = start_attempt("trial_b")
    try:
        assert os.path.isdir(alive_folder) and os.path.isdir(killed_folder)
        kill(killed)
        assert os.path.isdir(killed_folder)  # nothing ran to remove it

        another = LocalCheckpoints("trial_c")
        assert not os.path.exists(killed_folder)
        assert os.path.isdir(alive_folder) and os.listdir(alive_folder) != []  # its process still holds it
        remove_abandoned(str(temp_root))
        assert os.path.isdir(another.scratch)  # this process's own folder is held too
    finally:
        kill(alive)
    remove_abandoned(str(temp_root))
    assert sorted(os.listdir(temp_root)) == [os.path.basename(another.scratch)]
    another.remove()
    assert os.listdir(temp_root) == []
