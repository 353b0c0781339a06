"""A DataLoader worker lost to host memory is an event, and the trial goes on from its last
checkpoint with fewer workers, to the losses it would have had (``orchestrator/trial/host_memory.py``).

The losses are real: a worker SIGKILLed mid-epoch (what the kernel's OOM killer does), and a
worker whose address space is bounded (``RLIMIT_AS``) so that loading its data really fails for
memory; each through the installed command from a folder outside the repository.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from orchestrator.config import DataLoading
from orchestrator.contract import HostMemoryEvent
from orchestrator.trial.host_memory import fewer_workers, host_memory_failure
from orchestrator.trial_report import TrialReport
from tests.conftest import command_env, installed_command


def test_a_lost_worker_is_told_from_other_failures():
    assert host_memory_failure(RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")) == \
        "DataLoader worker (pid(s) 4242) exited unexpectedly"
    assert host_memory_failure(RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")) == \
        "DataLoader worker (pid 4242) is killed by signal: Killed"
    assert host_memory_failure(MemoryError("Caught MemoryError in DataLoader worker process 1.\nOriginal Traceback ...")) == \
        "Caught MemoryError in DataLoader worker process 1"
    assert host_memory_failure(MemoryError()) is None  # the trial's own: a CPU device's OOM
    assert host_memory_failure(RuntimeError("CUDA out of memory")) is None
    assert host_memory_failure(ValueError("DataLoader worker (pid 1) exited unexpectedly")) is None


def test_a_connection_a_killed_worker_cut_is_a_lost_worker_where_the_loader_raised_it():
    """A worker killed while the trial takes a batch from it can surface as the batch's
    connection reset; raised anywhere else, a reset is not the loader's."""
    from torch.utils.data import DataLoader, Dataset

    class Cut(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            raise ConnectionResetError(104, "Connection reset by peer")

    try:
        next(iter(DataLoader(Cut(), batch_size=2)))  # in the trial's process: raised through dataloader.py
    except ConnectionResetError as exc:
        assert host_memory_failure(exc) == ("a DataLoader worker's connection was cut "
                                            "(ConnectionResetError: [Errno 104] Connection reset by peer)")
    assert host_memory_failure(ConnectionResetError(104, "Connection reset by peer")) is None


def test_each_loss_halves_the_workers_down_to_loading_in_the_trial_s_own_process():
    data = DataLoading(num_workers=4, prefetch_factor=4, persistent_workers=True)
    seen = []
    while data is not None:
        seen.append(data.num_workers)
        data = fewer_workers(data)
    assert seen == [4, 2, 1, 0]
    assert fewer_workers(DataLoading(num_workers=1, prefetch_factor=4, persistent_workers=True)) == DataLoading()


def test_the_event_travels_in_a_report_and_reads_as_one_line():
    event = HostMemoryEvent("train", 2, 45, 2, "DataLoader worker (pid(s) 4242) exited unexpectedly", "data.num_workers 2->1")
    [back] = TrialReport.from_result(TrialReport(host_memory_events=(event,)).to_metrics()).host_memory_events
    assert back == event
    assert event.describe() == ("host memory: a DataLoader worker was lost in train step 45 (epoch 2) (DataLoader worker "
                                "(pid(s) 4242) exited unexpectedly): resumed from its last checkpoint with data.num_workers 2->1")


# -- through the installed command -------------------------------------------------------------

# The README's WideNet whose training set, in a DataLoader worker, fails once (a marker file
# says it did) after FETCHES samples: it SIGKILLs its own worker, or bounds its address space
# near what it holds and then needs more.
LOSSY = """\
import dataclasses
import os
import resource
import signal

from torch.utils.data import Dataset, get_worker_info

from my_models.wide import WideNet

FETCHES = 1500
MARKER = "lost-a-worker"


class Lossy(Dataset):
    def __init__(self, inner, how, marker):
        self.inner, self.how, self.marker, self.fetched = inner, how, marker, 0

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        if get_worker_info() is not None and self.how and not os.path.exists(self.marker):
            self.fetched += 1
            if self.fetched == FETCHES:
                open(self.marker, "w").close()
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                with open("/proc/self/status") as status:
                    size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
                resource.setrlimit(resource.RLIMIT_AS, (size + (16 << 20), resource.RLIM_INFINITY))
                bytearray(256 << 20)  # the data this sample needs: more than the bound leaves
        return self.inner[index]


@dataclasses.dataclass
class LossyWideNet(WideNet):
    how: str = ""

    def train_data(self):
        return Lossy(super().train_data(), self.how, MARKER)
"""

SWEEP = """\
experiment: lossy
workload: {name: my_models.lossy:LossyWideNet, params: {hidden: 256}}
search_space:
  how: {grid: [HOW]}
effective_batch_size: 128
stop: {epochs: 3}
checkpoint: {every: {steps: 5}}
data: {num_workers: 2}
resources: {cpu: 1, gpu: 0}
"""


def _sweep(folder, how: str) -> subprocess.CompletedProcess:
    (folder / "lossy.yaml").write_text(SWEEP.replace("HOW", repr(how)))
    return subprocess.run([installed_command(), "run", "lossy.yaml", "--num-cpus", "2"], cwd=folder, env=command_env(),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.integration
@pytest.mark.parametrize("how", ["kill", "rlimit"])
def test_a_lost_loader_worker_is_a_host_memory_event_and_the_trial_ends_as_it_would_have(own_model_project, how):
    """One worker lost mid-epoch 1 (FETCHES samples into its share): the console says so in one
    line and MLflow's record of the trial the same, the trial goes back to its last checkpoint
    with one worker instead of two and finishes; its loss is the one of a sweep whose worker was
    never lost (same batches, same order)."""
    folder = own_model_project.folder
    (folder / "my_models" / "lossy.py").write_text(LOSSY.replace('"lost-a-worker"', repr(str(folder / "lost-a-worker"))))
    proc = _sweep(folder, how)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    [line] = re.findall(r"^\w+ host memory: .*$", proc.stdout, re.M)
    # A killed worker reads as torch's "exited unexpectedly" (or "killed by signal"), or, when the
    # trial was taking a batch from it, as that batch's connection cut: which, is the kernel's timing.
    lost = ("exited unexpectedly", "killed by signal", "connection was cut") if how == "kill" else \
        ("Caught MemoryError in DataLoader worker process",)
    assert re.search(r"a DataLoader worker was lost in train step \d+ \(epoch 1\)", line), line
    assert any(words in line for words in lost), line
    assert line.endswith("resumed from its last checkpoint with data.num_workers 2->1"), line
    assert (folder / "lost-a-worker").exists()

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{folder}/mlflow.db")
    [trial] = client.search_runs([client.get_experiment_by_name("lossy").experiment_id],
                                 "tags.`orchestrator.role` = 'trial'")
    assert trial.info.status == "FINISHED" and trial.data.tags["host_memory_events"] == line.split(" ", 1)[1]

    whole = _sweep(folder, "")  # the same trial, its workers never lost
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert "host memory" not in whole.stdout

    def final(out):
        [row] = [line for line in out.splitlines() if "TERMINATED" in line]
        return row.split()[row.split().index("ep") + 1]  # eval_loss, after "3/3 ep"

    assert final(proc.stdout) == final(whole.stdout)
