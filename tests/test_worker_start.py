"""Forked DataLoader workers watched until they run Python (``trainables/worker_start.py``), with
a real child that blocks after the fork as one does on a lock another thread held."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

# The first child forked blocks before the DataLoader's code runs in it, forever: the state a
# child is in when it needs a lock that a thread of its parent held at the fork.
STUCK_FIRST_CHILD = textwrap.dedent("""
    import json, os, sys, time
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from trainables import worker_start

    stuck = sys.argv[1]
    def block_the_first_child():
        try:
            os.close(os.open(stuck, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        time.sleep(3600)
    os.register_at_fork(after_in_child=block_the_first_child)

    class Draws(TensorDataset):  # a sample and a random draw made in the worker, from the seed it was given
        def __getitem__(self, i):
            return super().__getitem__(i)[0], torch.rand(())

    def epoch(iterator):
        return [(int(i), float(r)) for batch, draws in iterator for i, r in zip(batch, draws)]

    def loader():
        return DataLoader(Draws(torch.arange(64.0)), batch_size=8, num_workers=2, persistent_workers=True,
                          worker_init_fn=worker_start.WorkerStarts(2), generator=torch.Generator().manual_seed(5))

    attempts = int(sys.argv[2])
    worker_start.START_ATTEMPTS = attempts
    restarted = loader()
    started = time.monotonic()
    try:
        iterator = worker_start.start(restarted, timeout_s=2)
    except worker_start.WorkersDidNotStart as exc:
        print(json.dumps({"error": str(exc)}))
        sys.exit(0)
    waited = time.monotonic() - started
    first = epoch(iterator)
    again = epoch(worker_start.start(restarted, timeout_s=2))
    clean = loader()
    print(json.dumps({"first": first, "again": again, "clean": epoch(worker_start.start(clean)),
                      "clean_again": epoch(worker_start.start(clean)), "waited": waited}))
""")


def _run(tmp_path, attempts: int) -> dict:
    import json

    proc = subprocess.run([sys.executable, "-c", STUCK_FIRST_CHILD, str(tmp_path / "stuck"), str(attempts)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_worker_that_never_runs_python_is_killed_and_the_loader_started_again_from_the_same_seeds(tmp_path):
    result = _run(tmp_path, attempts=3)
    assert result["waited"] >= 2  # one timeout, then workers that started
    assert [i for i, _ in result["first"]] == [i for i, _ in result["again"]] == list(range(64))  # every sample once
    # The workers' random draws are those of a loader whose workers started at once, epoch by epoch.
    assert (result["first"], result["again"]) == (result["clean"], result["clean_again"])
    _assert_no_child_left(tmp_path)


def test_workers_that_never_start_end_in_one_line_that_names_the_setting(tmp_path):
    result = _run(tmp_path, attempts=1)
    assert result == {"error": "1 DataLoader worker(s) forked from the trial's process did not start in 2 s, 1 times: "
                               "set data.multiprocessing_context: forkserver"}
    _assert_no_child_left(tmp_path)


def _assert_no_child_left(tmp_path) -> None:
    """The blocked child was SIGKILLed: nothing still runs the script."""
    pgrep = subprocess.run(["pgrep", "-f", str(tmp_path / "stuck")], capture_output=True, text=True)
    assert pgrep.stdout == "", pgrep.stdout


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_that_do_not_fork_are_not_watched(method):
    from orchestrator.config import DataLoading
    from trainables.data import StepCut, train_loader
    from trainables.mlp import MLPWorkload

    workload = MLPWorkload()
    loader, _ = train_loader(workload, workload.train_data(), StepCut(64, 64), seed=0,
                             settings=DataLoading(num_workers=1, multiprocessing_context=method), on_gpu=False)
    assert loader.worker_init_fn is None
