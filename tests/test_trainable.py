"""Trials on a real local Ray that run out of memory on an emulated small GPU, and survive
holding one attempt at a time; trials whose worker dies mid-epoch and resume from a mid-epoch
checkpoint; trials whose failure is not about memory, which are not retried beyond
``max_failures``; and what a finished trial leaves behind."""

import glob
import os
import tempfile

import mlflow
import pytest
import torch

from orchestrator.config import parse_spec
from orchestrator.runner import run_sweep

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("local_ray")]


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


def trial_dirs(outcome):
    return [p for p in glob.glob(os.path.join(outcome.experiment_path, "train_trial_*")) if os.path.isdir(p)]


def final_weights(outcome):
    (trial_dir,) = trial_dirs(outcome)
    last = sorted(glob.glob(os.path.join(trial_dir, "checkpoint_*")))[-1]
    return torch.load(os.path.join(last, "state.pt"), weights_only=False)


def reports(outcome):
    """Every result each trial reported, in order (Tune's progress.csv of its trial folder)."""
    import csv

    return [list(csv.DictReader(open(os.path.join(d, "progress.csv")))) for d in trial_dirs(outcome)]


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
    # aux_start_epoch counts as the workload's set_epoch does, from 0; events count from 1.
    assert {e["epoch"] for e in events} == {3} and {e["phase"] for e in events} == {"train"}
    assert state_a["plan"]["micro_batch"] < 128 and state_a["plan"]["effective_batch"] == 128
    # Planned for its worst stage from the start: the module switching on at epoch 2 never OOMs.
    assert row_b.oom_retries == 0 and state_b["plan"]["micro_batch"] < 128
    # Verified on the device (memory.verify): each stage's train phase over its first steps, the
    # eval phase at its first evaluation; the plan it settled on measured within its limit.
    checks = state_b["plan_checks"]
    assert {"train", "eval", "train@epoch3"} <= {c["phase"] for c in checks}
    settled = [c for c in checks if c["phase"] == "train@epoch3"][-1]
    assert settled["plan"] == settled["new_plan"] and settled["measured_bytes"] <= settled["limit_bytes"]
    assert settled["plan"].startswith(f"{state_b['plan']['micro_batch']} x ")
    for name, tensor in state_a["trainer"]["model"].items():
        torch.testing.assert_close(tensor, state_b["trainer"]["model"][name], rtol=1e-4, atol=1e-5)
    assert state_a["trainer"]["progress"]["epoch"] == state_b["trainer"]["progress"]["epoch"] == 3


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
    """The events are in MLflow too (``oom_events.json``, as a trial that survived has it), and in
    the report, although the trial gave up before any report could carry them."""
    from orchestrator.report import load_sweep

    outcome = sweep(tmp_path, {"name": "cnn", "params": {"width": 48}},
                    {"device": "emulated", "capacity": "8MiB", "estimator": "none", "max_oom_retries": 1}, epochs=1)
    (row,) = outcome.rows
    assert not outcome.ok and row.status == "ERROR"
    assert "memory.max_oom_retries=1 reached" in row.note
    assert row.epochs == 0 and row.final_metric is None

    assert row.oom_retries == 1  # the final table counts the OOM it survived before giving up

    (trial,) = load_sweep(f"sqlite:///{tmp_path}/mlflow.db").trials
    assert [e["action"] for e in trial.oom_events] == ["micro-batch 128->64 (accumulation 1->2)", "gave up"], trial.oom_events
    assert trial.oom_retries == 1 and trial.status == "FAILED"


def test_a_trial_whose_estimate_fell_short_is_still_compared_with_a_prediction_after_its_oom(tmp_path):
    """The OOM's reduction is predicted from the same estimate at its smaller batches: the report
    still has the trial's predicted peak and error (the one trial where they matter)."""
    from orchestrator.report import load_sweep

    outcome = sweep(tmp_path, {"name": "tests.workloads:HiddenScratchWorkload", "params": {"width": 64, "scratch": 8192}},
                    {"device": "emulated", "capacity": "4MiB", "estimator": "trace", "max_oom_retries": 4}, epochs=1)
    (row,) = outcome.rows
    assert outcome.ok and row.oom_retries >= 1
    state = final_weights(outcome)
    first, *_ = state["oom_events"]
    assert first["micro_batch"] == 128 and first["predicted_peak_bytes"] > 0  # the first plan's estimate
    plan = state["plan"]
    assert plan["micro_batch"] < 128 and plan["reductions"] == len(state["oom_events"])
    assert plan["predicted_peak_bytes"] and set(plan["predicted_phases"]) == {"train", "eval"}

    (trial,) = load_sweep(f"sqlite:///{tmp_path}/mlflow.db").trials
    predicted, measured, error = trial.peak()
    assert predicted == plan["predicted_peak_bytes"] and measured > predicted and error > 0


def test_a_worker_that_dies_recovering_from_an_oom_is_restarted_by_tune_with_a_smaller_plan(tmp_path):
    outcome = sweep(tmp_path, {"name": "tests.workloads:DiesOnOomWorkload", "params": {"width": 48}},
                    {"device": "emulated", "capacity": "8MiB", "estimator": "none", "max_oom_retries": 4}, epochs=1)
    assert outcome.ok, outcome.rows
    state = final_weights(outcome)
    # Each training OOM was written down before the recovery killed the worker; that evidence made
    # Tune's restart apply one more reduction. An OOM in backward (outside the workload's loss) is
    # recovered in-process like the eval OOM.
    train_events = [e for e in state["oom_events"] if e["phase"] == "train"]
    assert state["applied_shrinks"] >= 1 and state["plan"]["micro_batch"] < 128
    assert 128 // state["plan"]["micro_batch"] == 2 ** (state["applied_shrinks"] + len(train_events))
    assert state["plan"]["effective_batch"] == 128 and state["trainer"]["progress"]["epoch"] == 1
    # The eval OOM (batch 128 needs 6 MiB) was an ordinary exception: shrunk in-process.
    assert any(e["phase"] == "eval" for e in state["oom_events"]) and state["plan"]["eval_batch"] < 128
    (row,) = outcome.rows
    assert row.oom_retries == state["applied_shrinks"] + len(state["oom_events"])  # the deaths count too
    (trial_dir,) = trial_dirs(outcome)
    assert not os.path.exists(os.path.join(trial_dir, "oom_before_death.json"))  # each death took its own


@pytest.mark.parametrize("max_failures,attempts", [(0, 1), (1, 2)])
def test_a_bug_is_not_retried_beyond_max_failures(tmp_path, max_failures, attempts):
    log = tmp_path / "attempts.txt"
    outcome = sweep(tmp_path, {"name": "tests.workloads:BuggyWorkload", "params": {"attempts_file": str(log)}},
                    {"device": "cpu", "estimator": "none", "max_oom_retries": 3}, epochs=1, max_failures=max_failures)
    (row,) = outcome.rows
    assert not outcome.ok and row.status == "ERROR"
    assert log.read_text().count("attempt") == attempts  # not 1 + max_oom_retries
    assert row.note.startswith("ValueError: mat1 and mat2 shapes cannot be multiplied")


HEAVY_EVAL = {"name": "tests.workloads:HeavyEvalWorkload", "params": {"in_features": 2048, "width": 256, "views": 8, "depth": 1}}


def test_the_recovery_releases_the_failed_attempt_before_building_the_next(tmp_path):
    """An eval OOM at the end of epoch 1, whose last checkpoint is from step 8. Weights, AdamW
    state and the checkpoint being loaded take most of the card: a recovery that kept the failed
    attempt while building the next and loading that checkpoint would run out of memory again."""
    from orchestrator.memory import estimate
    from tests.workloads import HeavyEvalWorkload

    train, evaluate = estimate(HeavyEvalWorkload(**HEAVY_EVAL["params"]), "trace", target="emulated").phases
    capacity = (evaluate.allocated_at(64) + evaluate.allocated_at(128)) // 2  # eval batch 128 does not fit, 64 does
    assert train.allocated_at(128) < capacity < 2 * (train.params + train.grads + train.optimizer)
    outcome = sweep(tmp_path, HEAVY_EVAL, {"device": "emulated", "capacity": capacity, "estimator": "none"}, epochs=2,
                    checkpoint={"every": {"steps": 8}})  # 16 steps per epoch
    assert outcome.ok, outcome.rows
    state = final_weights(outcome)
    # The event counts from 1: the first eval batch, after step 16, in epoch 1.
    assert state["plan"]["eval_batch"] == 64
    assert [(e["phase"], e["epoch"], e["step"], e["eval_batch_number"]) for e in state["oom_events"]] == [("eval", 1, 16, 1)]
    (results,) = reports(outcome)
    peaks = {int(r["step"]): int(float(r["peak_allocated_bytes"])) for r in results}
    assert list(peaks) == [8, 16, 24, 32]
    # The report of step 16 covers the recovery (release the failed attempt, build the next, load
    # the checkpoint of step 8, train to 16, evaluate at 64): no higher than step 32's, which only
    # trained and evaluated at 64.
    assert peaks[16] <= peaks[32] <= capacity


def test_a_worker_that_dies_mid_epoch_resumes_from_its_mid_epoch_checkpoint(tmp_path):
    calls = tmp_path / "calls.txt"
    workload = {"name": "tests.workloads:DiesOnceWorkload",
                "params": {"calls_file": str(calls), "die_at_call": 13, "width": 16}}  # during step 13
    outcome = sweep(tmp_path, workload, {"device": "cpu", "estimator": "none"}, epochs=2,
                    checkpoint={"every": {"steps": 5}}, max_failures=1)
    assert outcome.ok, outcome.rows
    state = final_weights(outcome)
    assert state["trainer"]["progress"] == {"epoch": 2, "step_in_epoch": 0, "step": 32}  # 2048 samples / 128
    # Nothing says the worker died of memory (no OOM event, no memory monitor): the restart kept
    # the plan, one micro-batch of 128 per step, and counts no OOM.
    assert (state["plan"]["micro_batch"], state["plan"]["accum_steps"], state["applied_shrinks"]) == (128, 1, 0)
    assert outcome.rows[0].oom_retries == 0
    # The restart went back to the checkpoint of step 10: steps 11 and 12 and step 13 (during which
    # the worker died) ran twice; nothing before step 10 did.
    assert calls.read_text().count("call") == 13 + (32 - 10)


def test_a_sweep_tuned_on_a_declared_metric_with_asha(tmp_path):
    outcome = sweep(tmp_path, {"name": "tests.workloads:ScoredWorkload", "params": {"width": 16}},
                    {"device": "cpu"}, search_space={"lr": {"grid": [0.01, 0.003, 0.0003, 0.0001]}}, epochs=3,
                    metric="eval_accuracy", mode="max", scheduler={"type": "asha", "grace_period": 1})
    assert outcome.ok, outcome.rows
    assert all(row.final_metric is not None and 0 <= row.final_metric <= 1 for row in outcome.rows)
    assert any(row.epochs < 3 for row in outcome.rows)  # ASHA stopped some early: finished all the same
    best = max(outcome.rows, key=lambda r: r.final_metric)
    assert best.epochs == 3
    # Which ones ASHA stopped: the rows and MLflow's trial runs say so, and only of those.
    stopped = {row.name for row in outcome.rows if row.epochs < 3}
    assert {row.name for row in outcome.rows if row.stopped_early} == stopped
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("oom_test").experiment_id])
    tagged = {r.data.tags["trial_id"]: r.data.tags.get("stopped_early") for r in runs if "trial_id" in r.data.tags}
    assert {t for t, tag in tagged.items() if tag} == stopped
    assert all(tagged[t].startswith("stopped early by ASHA after ") and tagged[t].endswith("/3 epochs") for t in stopped)


def test_a_finished_or_failed_trial_leaves_no_scratch_and_tune_keeps_the_newest_checkpoints(tmp_path):
    outcome = sweep(tmp_path / "ok", {"name": "mlp", "params": {"width": 16}}, {"device": "cpu"}, epochs=3,
                    checkpoint={"keep": 1})
    log = tmp_path / "attempts.txt"
    failed = sweep(tmp_path / "bug", {"name": "tests.workloads:BuggyWorkload", "params": {"attempts_file": str(log)}},
                   {"device": "cpu", "estimator": "none"}, epochs=1)
    assert outcome.ok and not failed.ok
    (trial_dir,) = trial_dirs(outcome)
    assert len(glob.glob(os.path.join(trial_dir, "checkpoint_*"))) == 1
    trial_ids = [row.name for row in outcome.rows + failed.rows]
    leftovers = [p for t in trial_ids for p in glob.glob(os.path.join(tempfile.gettempdir(), f"orchestrator-{t}-*"))]
    assert leftovers == []


def test_a_reused_worker_plans_and_measures_each_trial_as_a_fresh_one_would(tmp_path):
    """One trial at a time (each takes both CPUs): a finished trial's worker runs the next one,
    even after an OOM it recovered from, and every trial plans, measures and trains as it does
    with ``reuse: false``, where each trial has a worker of its own."""
    def trials(outcome):
        last = {rows[-1]["trial_id"]: rows[-1] for rows in reports(outcome)}
        keys = ("micro_batch", "oom_retries", "peak_allocated_bytes", "train_loss")
        return [int(last[t]["pid"]) for t in sorted(last)], [tuple(last[t][k] for k in keys) for t in sorted(last)]

    staged = {**STAGED, "params": {**STAGED["params"], "aux_width": 8}}
    memory = {**SMALL_GPU, "estimator": "none"}
    search_space = {"aux_width": {"grid": [4096, 8, 16]}}  # 4096 runs out of memory at epoch 2 and recovers
    reused_pids, reused = trials(sweep(tmp_path / "reused", staged, memory, search_space=search_space, resources={"cpu": 2}))
    fresh_pids, fresh = trials(sweep(tmp_path / "fresh", staged, memory, search_space=search_space, resources={"cpu": 2},
                                     reuse=False))
    assert len(set(reused_pids)) == 1 and len(set(fresh_pids)) == 3
    assert int(reused[0][1]) >= 1 and reused == fresh


def test_an_oom_replay_steps_a_plateau_scheduler_once_per_evaluation(tmp_path):
    """Evaluations every step, checkpoints every 2: the OOM at step 4 (the first heavy one) resumes
    from step 2's checkpoint with half the micro-batch and evaluates step 3 again. The scheduler
    in the last checkpoint stepped once per evaluation of the finished trial, and the learning
    rate fell as in a trial that never ran out of memory (``test_loop`` has the uninterrupted one)."""
    workload = {"name": "tests.workloads:PlateauWorkload", "params": {"samples": 384, "views": 4}}
    outcome = sweep(tmp_path, workload, {"device": "emulated", "capacity": "150KB", "estimator": "none"},
                    search_space={"lr": 0.25}, epochs=2, eval_every={"steps": 1}, checkpoint={"every": {"steps": 2}})
    assert outcome.ok, outcome.rows
    state = final_weights(outcome)
    assert [(e["phase"], e["step"]) for e in state["oom_events"]] == [("train", 4)]
    assert state["plan"]["micro_batch"] == 64
    scheduler = state["trainer"]["scheduler"]
    assert scheduler["last_epoch"] == 6 and scheduler["_last_lr"] == [0.015625]
    (rows,) = reports(outcome)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 3, 4, 5, 6]
    assert [float(r["learning_rate"]) for r in rows] == [0.25, 0.25, 0.25, 0.25, 0.25, 0.0625, 0.015625]
