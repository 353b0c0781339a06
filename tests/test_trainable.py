"""Trials on a real local Ray that run out of memory on an emulated small GPU, and survive;
and trials whose failure is not about memory, which are not retried beyond ``max_failures``."""

import pytest
import ray
import torch

from orchestrator.config import parse_spec
from orchestrator.runner import run_sweep

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def local_ray(tmp_path_factory):
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield
    ray.shutdown()


def sweep(tmp_path, workload, memory, search_space=None, epochs=3, **extra):
    raw = {
        "experiment": "oom_test",
        "workload": workload,
        "search_space": search_space or {"lr": 0.01},
        "effective_batch_size": 128,
        "stop": {"epochs": epochs},
        "resources": {"cpu": 1},
        "memory": memory,
        **extra,
    }
    outcome = run_sweep(parse_spec(raw), tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", storage_path=str(tmp_path / "results"))
    return outcome


def final_weights(outcome):
    import glob
    import os

    (trial_dir,) = [p for p in glob.glob(os.path.join(outcome.experiment_path, "train_trial_*")) if os.path.isdir(p)]
    last = sorted(glob.glob(os.path.join(trial_dir, "checkpoint_*")))[-1]
    return torch.load(os.path.join(last, "state.pt"), weights_only=False)


# SGD: its update is linear in the gradient, so summation order (128 x 1 vs 32 x 4) stays at
# float noise. Adam divides by sqrt(v), which turns the noise of near-zero gradients into
# lr-sized steps for a few elements, whatever the accumulation mechanism.
STAGED = {"name": "staged_mlp", "params": {"width": 48, "aux_width": 4096, "aux_start_epoch": 2, "optimizer": "sgd"}}
SMALL_GPU = {"device": "emulated", "capacity": "9MiB", "max_oom_retries": 4}


def test_an_oom_at_the_activation_epoch_is_survived_with_the_same_final_weights(tmp_path):
    surprised = sweep(tmp_path / "a", STAGED, {**SMALL_GPU, "estimator": "none"})
    planned = sweep(tmp_path / "b", STAGED, {**SMALL_GPU, "estimator": "trace"})

    assert surprised.ok and planned.ok
    (row_a,), (row_b,) = surprised.rows, planned.rows
    state_a, state_b = final_weights(surprised), final_weights(planned)
    events = state_a["oom_events"]
    assert row_a.oom_retries == len(events) >= 1
    assert {e["epoch"] for e in events} == {2} and {e["phase"] for e in events} == {"train"}
    assert state_a["plan"]["micro_batch"] < 128 and state_a["plan"]["effective_batch"] == 128
    # Planned for its worst stage from the start: the module switching on at epoch 2 never OOMs.
    assert row_b.oom_retries == 0 and state_b["plan"]["micro_batch"] < 128
    for name, tensor in state_a["trainer"]["model"].items():
        torch.testing.assert_close(tensor, state_b["trainer"]["model"][name], rtol=1e-4, atol=1e-5)
    assert state_a["trainer"]["epoch"] == state_b["trainer"]["epoch"] == 3


def test_an_eval_oom_shrinks_only_the_eval_batch(tmp_path):
    outcome = sweep(
        tmp_path, {"name": "tests.workloads:HeavyEvalWorkload", "params": {"width": 64, "views": 64}},
        {"device": "emulated", "capacity": "4MiB", "estimator": "none", "max_oom_retries": 4}, epochs=2,
    )
    assert outcome.ok
    state = final_weights(outcome)
    events = state["oom_events"]
    assert events and {e["phase"] for e in events} == {"eval"}
    assert state["plan"]["micro_batch"] == 128 and state["plan"]["accum_steps"] == 1
    assert state["plan"]["eval_batch"] < 128


def test_retries_are_bounded_and_the_events_are_in_the_error(tmp_path):
    outcome = sweep(tmp_path, {"name": "cnn", "params": {"width": 48}},
                    {"device": "emulated", "capacity": "8MiB", "estimator": "none", "max_oom_retries": 1}, epochs=1)
    (row,) = outcome.rows
    assert not outcome.ok and row.status == "ERROR"
    assert "memory.max_oom_retries=1 reached" in row.note
    assert row.epochs == 0 and row.final_loss is None


def test_a_worker_killed_by_an_oom_is_restarted_by_tune_with_a_smaller_plan(tmp_path):
    outcome = sweep(tmp_path, {"name": "tests.workloads:DiesOnOomWorkload", "params": {"width": 48}},
                    {"device": "emulated", "capacity": "8MiB", "estimator": "none", "max_oom_retries": 4}, epochs=1)
    assert outcome.ok, outcome.rows
    state = final_weights(outcome)
    # 128 -> 16 took three halvings: each forward-pass OOM killed the worker and Tune's restart
    # applied the shrink; an OOM in backward (outside the workload's loss) was shrunk in-process.
    train_events = [e for e in state["oom_events"] if e["phase"] == "train"]
    assert state["applied_shrinks"] >= 1 and state["applied_shrinks"] + len(train_events) == 3
    assert state["plan"]["micro_batch"] == 16 and state["plan"]["effective_batch"] == 128
    assert state["trainer"]["epoch"] == 1
    # The eval OOM (batch 128 needs 6 MiB) was an ordinary exception: shrunk in-process.
    assert any(e["phase"] == "eval" for e in state["oom_events"]) and state["plan"]["eval_batch"] < 128


@pytest.mark.parametrize("max_failures,attempts", [(0, 1), (1, 2)])
def test_a_bug_is_not_retried_beyond_max_failures(tmp_path, max_failures, attempts):
    log = tmp_path / "attempts.txt"
    outcome = sweep(tmp_path, {"name": "tests.workloads:BuggyWorkload", "params": {"attempts_file": str(log)}},
                    {"device": "cpu", "estimator": "none", "max_oom_retries": 3}, epochs=1, max_failures=max_failures)
    (row,) = outcome.rows
    assert not outcome.ok and row.status == "ERROR"
    assert log.read_text().count("attempt") == attempts  # not 1 + max_oom_retries
    assert row.note.startswith("NotRetriedError: ValueError: mat1 and mat2 shapes cannot be multiplied")
