"""The host-memory plan for the nodes a sweep runs on (``orchestrator/node_memory.py``): how many
trial processes a node runs at once, and ``run`` cutting the loader settings, or refusing, before
any trial starts, through the installed command from a folder outside the repository."""

from __future__ import annotations

import re
import subprocess

import mlflow
import pytest

from orchestrator.config import DataLoading, parse_spec
from orchestrator.node_memory import NodeMemory, cluster_nodes, processes_at_once, tightest_plan
from orchestrator.tracking.callback import HOST_MEMORY_TAG
from orchestrator.tracking.runs import ROLE_TAG
from tests.conftest import command_env, installed_command
from trainables.footprint import DataFootprint

MiB = 1 << 20


def _spec(**resources):
    return parse_spec({"experiment": "nodes", "workload": "mlp", "search_space": {"lr": 0.1}, "effective_batch_size": 32, "stop": {"epochs": 1},
                       "resources": resources,
                       "data": {"num_workers": 4}})


def test_a_node_runs_as_many_trial_processes_as_it_holds_bundles_of_a_trial():
    assert processes_at_once(_spec(cpu=2), {"CPU": 16, "GPU": 0}) == 8
    assert processes_at_once(_spec(cpu=2, gpu=1), {"CPU": 16, "GPU": 4}) == 4
    assert processes_at_once(_spec(cpu=4), {"CPU": 2, "GPU": 0}) == 1
    # A data-parallel trial's ranks are bundles too: 8 CPUs hold 4 ranks of 2 trials, not 4 trials of 2 ranks each.
    assert processes_at_once(_spec(cpu=2, workers=2), {"CPU": 8, "GPU": 0}) == 4
    # A sweep of one trial never runs more than its own processes.
    assert processes_at_once(_spec(cpu=1), {"CPU": 16, "GPU": 0}, trials=1) == 1
    assert processes_at_once(_spec(cpu=1, workers=2), {"CPU": 16, "GPU": 0}, trials=1) == 2


def test_a_cluster_s_nodes_are_planned_with_the_memory_ray_gave_them_and_the_tightest_one_decides():
    nodes = [{"CPU": 8.0, "memory": 64e9, "node:10.0.0.1": 1.0, "node:__internal_head__": 1.0},
             {"CPU": 8.0, "memory": 2e9, "node:10.0.0.2": 1.0},
             {"CPU": 8.0, "node:10.0.0.3": 1.0}]  # no memory known: not planned
    found = cluster_nodes(nodes, host_memory=None)
    assert [(n.name, n.available_bytes) for n in found] == [("node 10.0.0.1", 64 * 10**9), ("node 10.0.0.2", 2 * 10**9)]
    assert [n.available_bytes for n in cluster_nodes(nodes, host_memory=2 * MiB)] == [2 * MiB] * 3

    footprint = DataFootprint(tensor_bytes=100 * MiB, array_bytes=0, copied_bytes=100 * MiB, batch_bytes=MiB, state_bytes=10 * MiB)
    node, plan = tightest_plan(_spec(cpu=2), footprint, found, pinned=False)
    # 4 trials at once on each; 4 workers hold 100 + 5 x 100 + 8 + 10 = 618 MiB a trial: 2.4 GiB of the small node's 1.9,
    # which holds 4 x 412 MiB with 2 workers (prefetching 1 batch).
    assert node.name == "node 10.0.0.2" and plan.data == DataLoading(num_workers=2, prefetch_factor=1)
    assert plan.changes == ("data.num_workers 4->2", "data.prefetch_factor 2->1")
    too_small = [NodeMemory("node 10.0.0.9", {"CPU": 8.0}, 100 * MiB), *found]
    node, plan = tightest_plan(_spec(cpu=2), footprint, too_small, pinned=False)
    assert node.name == "node 10.0.0.9" and plan.refusal
    assert tightest_plan(_spec(cpu=2), footprint, [NodeMemory("head", {"CPU": 1.0}, MiB)], pinned=False) is None


# -- through the installed command -------------------------------------------------------------

# The README's WideNet with its training set as Python objects (each loader worker copies them)
# that writes down how many workers loaded it.
HEAVY = """\
import dataclasses
import os

import torch
from torch.utils.data import Dataset, get_worker_info

from my_models.wide import WideNet

MARKS = "workers"


class Rows(Dataset):
    def __init__(self, n):
        self.rows = [([float(i % 7)] * 20, i % 2) for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        info = get_worker_info()
        if info is not None:
            with open(f"{MARKS}-{os.getpid()}", "w") as f:
                f.write(str(info.num_workers))
        x, y = self.rows[index]
        return torch.tensor(x), y


@dataclasses.dataclass
class HeavyWideNet(WideNet):
    def train_data(self):
        return Rows(4096)
"""

SWEEP = """\
experiment: heavy
workload: {name: my_models.heavy:HeavyWideNet, params: {hidden: 64}}
search_space:
  lr: {grid: [0.01, 0.001]}
effective_batch_size: 128
stop: {epochs: 1}
data: {num_workers: 2}
resources: {cpu: 1, gpu: 0}
"""


def _run(folder, host_memory: str) -> subprocess.CompletedProcess:
    return subprocess.run([installed_command(), "run", "heavy.yaml", "--num-cpus", "2", "--host-memory", host_memory],
                          cwd=folder, env=command_env(), capture_output=True, text=True, timeout=600)


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


@pytest.mark.integration
def test_run_cuts_the_loader_workers_to_what_the_node_holds_or_refuses_before_any_trial(own_model_project):
    """Two trials at once on two CPUs. With too little memory for even no workers: one line and exit
    2, before Ray starts; with room for one worker each but not two: one line per setting cut, and
    the trials load with one worker."""
    folder = own_model_project.folder
    (folder / "my_models" / "heavy.py").write_text(HEAVY.replace('"workers"', repr(str(folder / "workers"))))
    (folder / "heavy.yaml").write_text(SWEEP)

    refused = _run(folder, "1MiB")
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr and "Ray" not in refused.stdout, refused.stdout + refused.stderr
    [line] = refused.stderr.strip().splitlines()
    need = re.search(r"^error: host memory: this machine: 2 trial\(s\) at once need ([\d.]+ \w+) of host memory even "
                     r"loading in their own processes, and the node has 1\.0 MiB available; .*--host-memory SIZE$", line)
    assert need, line
    assert not list(folder.glob("workers-*"))

    # Loading in their own processes the two need `alone`, nearly all of it the rows; each worker
    # holds another copy of them: one worker each needs about 2 x `alone`, two need 3 x.
    alone = _bytes(need.group(1))
    cut = _run(folder, f"{int(alone * 2.4)}B")
    said = cut.stdout + cut.stderr
    assert cut.returncode == 0, said[-3000:]
    lines = re.findall(r"^host memory: .*$", cut.stdout, re.M)
    assert [line.split(",")[0] for line in lines] == ["host memory: data.num_workers 2->1",
                                                      "host memory: data.prefetch_factor 2->1"], lines
    assert all("so that the 2 trial process(es) this machine runs at once fit in its " in line for line in lines), lines
    seen = {p.read_text() for p in folder.glob("workers-*")}
    assert seen == {"1"}, seen
    # MLflow's sweep run keeps the config as written (params) and says what was cut (a tag).
    client = mlflow.MlflowClient(f"sqlite:///{folder}/mlflow.db")
    [sweep] = client.search_runs([client.get_experiment_by_name("heavy").experiment_id], f"tags.`{ROLE_TAG}` = 'sweep'")
    assert sweep.data.params["data.num_workers"] == "2"
    assert sweep.data.tags[HOST_MEMORY_TAG].splitlines() == [line.removeprefix("host memory: ") for line in lines]


@pytest.mark.integration
@pytest.mark.usefixtures("local_ray")
def test_on_a_running_ray_each_node_is_planned_with_its_memory_and_a_refusal_leaves_nothing_behind(tmp_path):
    """A driver joining a Ray that runs already plans for its nodes (here the one node of the
    embedded Ray this module started: 2 CPUs, so 2 trial processes) once connected, before any
    trial: a refusal names the node, and the sweep's folder goes again."""
    from orchestrator.errors import UserError
    from orchestrator.runner import run_sweep

    spec = parse_spec({"experiment": "nodes", "workload": "mlp", "search_space": {"lr": {"grid": [0.1, 0.01]}},
                       "effective_batch_size": 32, "stop": {"epochs": 1}, "data": {"num_workers": 2},
                       "memory": {"estimator": "none"}})
    with pytest.raises(UserError) as refused:
        run_sweep(spec, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", storage_path=str(tmp_path / "results"),
                  host_memory="64KiB")
    assert re.match(r"host memory: node [\d.]+: 2 trial\(s\) at once need .* and the node has 64\.0 KiB available", str(refused.value)), \
        str(refused.value)
    assert not list(tmp_path.glob("results/*"))  # no sweep folder (nor the storage folder the run made)
