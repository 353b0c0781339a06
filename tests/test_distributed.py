"""Data-parallel trials of two CPU ranks (gloo) on a real local Ray: an OOM on one rank only is
recovered by the whole group in step, with the weights of a group planned small from the start;
a rank whose process is killed takes the trial back to its last checkpoint; ranks see disjoint
slices of every step."""

import contextlib
import glob
import multiprocessing
import os
import signal
import tempfile

import pytest
import torch
from ports import free_port

from orchestrator.config import parse_spec
from orchestrator.runner import run_sweep
from trainables.data import Shard, StepCut, StepSampler, eval_slice
from trainables.distributed import GroupOutOfMemory, RankGroup, failed_rank

#: Far below a hang: the gloo collective timeout is 10 minutes, a Tune retry loop forever.
TRIAL_TIMEOUT_S = 240

#: SGD: its update is linear in the gradient, so 256 x 1 vs 128 x 2 stays at float noise.
MLP = {"name": "mlp", "params": {"width": 128, "depth": 1, "in_features": 2048, "optimizer": "sgd",
                                 "train_samples": 2048, "eval_samples": 256}}


@contextlib.contextmanager
def within(seconds: int):
    """Fail the test (instead of hanging it) when the sweep is not done in ``seconds``."""
    def hung(signum, frame):
        raise TimeoutError(f"the sweep did not finish in {seconds} s: a group hangs")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def sweep(tmp_path, workload, memory, **extra):
    raw = {
        "experiment": "ddp_test", "workload": workload, "search_space": {"lr": 0.05},
        "effective_batch_size": 512, "stop": {"epochs": 2}, "resources": {"cpu": 1, "workers": 2},
        "memory": memory,
    }
    raw.update(extra)
    with within(TRIAL_TIMEOUT_S):
        return run_sweep(parse_spec(raw), tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", storage_path=str(tmp_path / "results"))


def final_state(outcome):
    (trial,) = [p for p in glob.glob(os.path.join(outcome.experiment_path, "train_trial_*")) if os.path.isdir(p)]
    last = sorted(glob.glob(os.path.join(trial, "checkpoint_*")))[-1]
    return torch.load(os.path.join(last, "state.pt"), weights_only=False)


def test_each_rank_takes_a_disjoint_slice_of_every_step_and_together_the_whole_step():
    whole = list(StepSampler(100, StepCut(24, 24), seed=3))
    ranks = [list(StepSampler(100, StepCut(8, 4), seed=3, shard=Shard(r, 3))) for r in range(3)]
    for step, indices in enumerate(whole):  # micro-batches of 4: two per rank per step
        shares = [sum(rank[2 * step : 2 * step + 2], []) for rank in ranks]
        assert sum(shares, []) == indices
    slices = [eval_slice(100, Shard(r, 3)) for r in range(3)]
    assert slices == [(0, 33), (33, 66), (66, 100)]  # every eval sample once, near-equal shares


def _rank(rank: int, address: str, results) -> None:
    """One rank of a two-process gloo group (no Ray): an OOM on rank 1 only, then a gradient sum
    through a bucket smaller than one parameter."""
    from orchestrator.device import CpuDevice

    group = RankGroup(rank, 2, address, CpuDevice())
    try:
        failure = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB") if rank == 1 else None
        try:
            group.agree(failure, "train", 7)
            results.put((rank, "no error"))
        except GroupOutOfMemory as exc:
            results.put((rank, str(exc), failed_rank(exc)))
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
        for p in model.parameters():
            p.grad = torch.full_like(p, float(rank + 1))
        group.sum_gradients(model, torch.empty(4))  # 15 + 3 + 6 + 2 elements through 4 at a time
        results.put((rank, [p.grad.tolist() for p in model.parameters()]))
    finally:
        group.close()


def test_every_rank_learns_of_one_ranks_oom_and_gradients_sum_through_a_small_bucket():
    address = f"tcp://127.0.0.1:{free_port()}"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, address, results)) for r in range(2)]
    for process in ranks:
        process.start()
    got = [results.get(timeout=120) for _ in range(4)]
    for process in ranks:
        process.join(timeout=60)
        assert process.exitcode == 0
    agreed = sorted(r for r in got if len(r) == 3)
    message = "rank 1 ran out of memory in train step 8: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB"
    assert agreed == [(0, message, 1), (1, message, 1)]
    sums = [r[1] for r in got if len(r) == 2]
    expected = [[[3.0] * 5] * 3, [3.0] * 3, [[3.0] * 3] * 2, [3.0] * 2]  # 1 + 2 everywhere
    assert sums == [expected, expected]


@pytest.mark.integration
@pytest.mark.usefixtures("local_ray")
def test_a_rank_holds_a_trials_state_and_its_first_checkpoint_saves_it():
    """A rank (``RankRun``) is set up where a trial is, so it has every piece of a trial's state:
    a rank that listed them by hand once lacked one, its first checkpoint raised, and the group
    hung. A group of one rank, built as ``RankActor`` builds its rank, trains to its first
    checkpoint here."""
    from orchestrator.space import trial_configs
    from orchestrator.trial.group import RankRun

    spec = parse_spec({"experiment": "ddp_test", "workload": MLP, "search_space": {"lr": 0.05},
                       "effective_batch_size": 512, "stop": {"epochs": 2}, "resources": {"cpu": 1, "workers": 2},
                       "memory": {"device": "cpu", "estimator": "none"}})
    rank = RankRun(trial_configs(spec)[0], spec, "trial", f"tcp://127.0.0.1:{free_port()}", 0, 1, None)
    try:
        rank.plan = rank._plan_from_estimates(rank._profiles())  # rank 0 sends it in a group of more
        trainer = rank._new_trainer()
        milestone = next(m for m in trainer.run() if m.checkpoint)
        rank._report(trainer, milestone)
        saved = rank.checkpoints.load(map_location="cpu")
    finally:
        rank.group.close()
        rank.checkpoints.remove()
    assert saved["plan"] == rank.plan.to_dict() and saved["trainer"]["progress"]["step"] == milestone.progress.step
    assert (saved["oom_events"], saved["host_memory_events"], saved["moves"], saved["plan_checks"]) == ([], [], [], [])
    assert saved["node_id"] == rank.node.node_id and rank.metrics is None and rank.evidence_folder is None


@pytest.mark.integration
@pytest.mark.usefixtures("local_ray")
def test_an_oom_on_rank_1_only_is_recovered_by_the_group_with_the_weights_of_a_small_plan(tmp_path):
    # Rank 1's device holds its 256 samples of a step as 64 x 4 (4.77 MB at its peak, 5.82 MB with the
    # exchange's 1.05 MB bucket), not 128 x 2 (5.32 MB) or 256 x 1 (5.39 MB, from the second step
    # on, with SGD's momentum); rank 0's holds anything.
    small_rank_1 = {"device": "emulated", "capacity": ["64MiB", "5.72MiB"], "max_oom_retries": 3}
    surprised = sweep(tmp_path / "a", MLP, {**small_rank_1, "estimator": "none"})
    planned = sweep(tmp_path / "b", MLP, {**small_rank_1, "estimator": "trace"})
    assert surprised.ok and planned.ok, (surprised.rows, planned.rows)
    state_a, state_b = final_state(surprised), final_state(planned)
    events = state_a["oom_events"]
    assert [(e["rank"], e["phase"]) for e in events] == [(1, "train"), (1, "train")]
    assert [e["action"] for e in events] == ["micro-batch 256->128 (accumulation 1->2)", "micro-batch 128->64 (accumulation 2->4)"]
    plan_a, plan_b = state_a["plan"], state_b["plan"]
    assert (plan_a["micro_batch"], plan_a["accum_steps"], plan_a["ranks"], plan_a["effective_batch"]) == (64, 4, 2, 512)
    assert plan_b["micro_batch"] < 128 and (plan_b["ranks"], plan_b["effective_batch"]) == (2, 512)
    assert plan_b["rank_budgets"] == (64 * 2**20, int(5.72 * 2**20)) and plan_b["budget_bytes"] == int(5.72 * 2**20)
    assert plan_b["exchange_bytes"] == 2048 * 128 * 4 + 128 * 4 + 128 * 8 * 4 + 8 * 4  # every gradient: one bucket
    assert all(e["bytes_allocated"] <= int(5.72 * 2**20) for e in events)  # rank 1's device, not rank 0's
    assert planned.rows[0].oom_retries == 0 and surprised.rows[0].oom_retries == 2
    assert surprised.rows[0].plan == "64 x 4 x 2 ranks"  # the summary table's cell
    for name, tensor in state_a["trainer"]["model"].items():
        torch.testing.assert_close(tensor, state_b["trainer"]["model"][name], rtol=1e-4, atol=1e-5)
    assert state_a["trainer"]["progress"] == state_b["trainer"]["progress"] == {"epoch": 2, "step_in_epoch": 0, "step": 8}


@pytest.mark.integration
@pytest.mark.usefixtures("local_ray")
def test_a_group_out_of_oom_retries_fails_on_every_rank_and_leaves_no_scratch(tmp_path):
    """256 x 1, then 128 x 2 run out on rank 1's 5 MiB (see above) and one retry is allowed: the
    trial fails, and each rank removed its scratch folder before rank 0 ended the group (a failed
    trial has no later attempt that would)."""
    outcome = sweep(tmp_path, MLP, {"device": "emulated", "capacity": ["64MiB", "5MiB"], "max_oom_retries": 1,
                                    "estimator": "none"})
    (row,) = outcome.rows
    assert not outcome.ok and "OomRetriesExhausted" in row.note, row.note
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"orchestrator-{row.name}-*")) == []


@pytest.mark.integration
@pytest.mark.usefixtures("local_ray")
def test_a_group_whose_rank_1_process_dies_resumes_from_its_last_checkpoint(tmp_path):
    calls = tmp_path / "calls"
    workload = {"name": "tests.workloads:RankDiesOnceWorkload",
                "params": {**MLP["params"], "calls_file": str(calls), "die_at_call": 6}}  # during step 6 of 8
    outcome = sweep(tmp_path, workload, {"device": "cpu", "estimator": "none"}, checkpoint={"every": {"steps": 2}},
                    max_failures=1)
    assert outcome.ok, outcome.rows
    state = final_state(outcome)
    assert state["trainer"]["progress"] == {"epoch": 2, "step_in_epoch": 0, "step": 8}  # 2048 samples / 512
    # Nothing says the rank died of memory: the restart kept the plan, one micro-batch of 256 per rank.
    assert (state["plan"]["micro_batch"], state["plan"]["ranks"], state["applied_shrinks"]) == (256, 2, 0)
    assert outcome.rows[0].oom_retries == 0
    # The restart went back to the checkpoint of step 4: step 5 and step 6 (during which rank 1
    # died) ran twice on rank 1; nothing before step 4 did.
    assert (tmp_path / "calls.rank1").read_text().count("call") == 6 + (8 - 4)
    assert (tmp_path / "calls.rank0").read_text().count("call") == 6 + (8 - 4)


@pytest.mark.integration
@pytest.mark.usefixtures("local_ray")
def test_a_rank_that_dies_recovering_from_an_oom_restarts_the_group_with_a_smaller_plan(tmp_path):
    workload = {"name": "tests.workloads:RankDiesOnOomWorkload", "params": MLP["params"]}
    outcome = sweep(tmp_path, workload, {"device": "emulated", "capacity": ["64MiB", "5.72MiB"], "estimator": "none",
                                         "max_oom_retries": 3})
    assert outcome.ok, outcome.rows
    state = final_state(outcome)
    # Rank 1 ran out at 256 x 1 and died; the restarted group (new rank actors) ran out at 128 x 2
    # and rank 1 died again; Tune's second restart runs 64 x 4, which fits. Rank 0 wrote each OOM
    # down before the recovery, which is what made each death a memory death.
    assert (state["plan"]["micro_batch"], state["plan"]["accum_steps"], state["applied_shrinks"]) == (64, 4, 2)
    assert outcome.rows[0].oom_retries == 2
    assert state["trainer"]["progress"] == {"epoch": 2, "step_in_epoch": 0, "step": 8}


@pytest.mark.integration
@pytest.mark.usefixtures("local_ray")
def test_an_eval_oom_on_rank_1_only_halves_the_groups_eval_batch(tmp_path):
    heavy_eval = {"name": "tests.workloads:HeavyEvalWorkload", "params": {"width": 64, "train_samples": 1024, "eval_samples": 512}}
    outcome = sweep(tmp_path, heavy_eval, {"device": "emulated", "capacity": ["64MiB", "1.5MiB"], "estimator": "none",
                                           "max_oom_retries": 4}, effective_batch_size=256)
    assert outcome.ok, outcome.rows
    state = final_state(outcome)
    events = state["oom_events"]
    assert events and {(e["rank"], e["phase"], e["micro_batch"]) for e in events} == {(1, "eval", 128)}
    assert state["plan"]["micro_batch"] == 128 and state["plan"]["eval_batch"] == 128 // 2 ** len(events)
    assert state["trainer"]["progress"]["step"] == 8  # 1024 samples / 256, 2 epochs


@pytest.mark.integration
@pytest.mark.usefixtures("local_ray")
def test_a_bug_on_rank_1_only_fails_the_group_at_once_naming_the_rank(tmp_path):
    outcome = sweep(tmp_path, {"name": "tests.workloads:RankBuggyWorkload", "params": {"width": 16, "train_samples": 1024}},
                    {"device": "cpu", "estimator": "none"})
    (row,) = outcome.rows
    assert not outcome.ok and row.status == "ERROR"
    assert "rank 1 failed in setup: ValueError: no such layer on rank 1" in row.note, row.note
    # Every rank removed its scratch folder: a failed trial has no later attempt that would.
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"orchestrator-{row.name}-*")) == []


@pytest.mark.integration
@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("nan_on_rank, last_loss", [(-1, r"\d\.\d+"), (1, "none")], ids=["every rank", "rank 1 only"])
def test_a_nan_loss_ends_the_group_together_at_the_first_bad_step(tmp_path, nan_on_rank, last_loss):
    """The ranks agree at the next milestone, so none waits for another in a collective; the
    group's loss is the ranks' shares summed, known where every rank turned bad at the same step."""
    import re

    outcome = sweep(tmp_path, {"name": "tests.workloads:NanLossWorkload",
                               "params": {"width": 16, "train_samples": 1024, "nan_at_step": 3, "nan_on_rank": nan_on_rank}},
                    {"device": "cpu", "estimator": "none"})
    (row,) = outcome.rows
    assert outcome.ok and row.status == "DIVERGED", row
    assert re.fullmatch(rf"loss not finite at step 3 \(epoch 2\); last finite loss {last_loss}; not retried \(on_nan: stop\)",
                        row.note), row.note


LOSES_LOADER_WORKER = {"name": "tests.workloads:RankLosesLoaderWorkerWorkload", "params": {**MLP["params"], "at": 300}}


@pytest.fixture(scope="module")
def never_lost_loader_worker(local_ray, tmp_path_factory):
    """The final state of the loader-worker sweep below where no rank loses a worker (``on_rank``
    5 of 2): the reference of both ways to lose one, run once for the module."""
    folder = tmp_path_factory.mktemp("never_lost")
    workload = {**LOSES_LOADER_WORKER, "params": {**LOSES_LOADER_WORKER["params"], "on_rank": 5}}
    whole = sweep(folder, workload, {"device": "cpu", "estimator": "none"}, checkpoint={"every": {"steps": 1}},
                  data={"num_workers": 2})
    assert whole.ok, whole.rows
    return final_state(whole)


@pytest.mark.integration
@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("how", ["rlimit", "kill"])
def test_a_loader_worker_lost_on_rank_1_takes_the_group_back_with_fewer_workers_recorded_once(
        tmp_path, how, never_lost_loader_worker):
    """Rank 1's worker is lost in epoch 1 (a real MemoryError under RLIMIT_AS, or a SIGKILL): the
    whole group goes back to its last checkpoint with one worker per rank instead of two, finishes,
    and rank 0 records the event once; the weights are those of a group whose worker was never lost."""
    marker = tmp_path / "lost"
    workload = {**LOSES_LOADER_WORKER, "params": {**LOSES_LOADER_WORKER["params"], "how": how, "marker": str(marker)}}
    lossy = sweep(tmp_path / "a", workload, {"device": "cpu", "estimator": "none"}, checkpoint={"every": {"steps": 1}},
                  data={"num_workers": 2})  # 1024 samples per rank, lost at the 300th
    assert lossy.ok, lossy.rows
    assert marker.exists()
    state = final_state(lossy)
    [event] = state["host_memory_events"]
    assert (event["phase"], event["epoch"], event["num_workers"], event["action"]) == ("train", 1, 2, "data.num_workers 2->1")
    lost = "Caught MemoryError in DataLoader worker" if how == "rlimit" else "DataLoader worker"
    assert event["message"].startswith("rank 1: ") and lost in event["message"], event
    assert state["trainer"]["progress"] == {"epoch": 2, "step_in_epoch": 0, "step": 8}

    whole = never_lost_loader_worker
    assert "host_memory_events" in whole and not whole["host_memory_events"]
    for name, tensor in state["trainer"]["model"].items():
        torch.testing.assert_close(tensor, whole["trainer"]["model"][name])
