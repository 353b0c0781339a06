"""The typed report a trial sends the driver: what Tune gets is what the driver reads back."""

from __future__ import annotations

import json

from orchestrator.contract import Move, OomEvent, PlanCheck
from orchestrator.trial_report import TUNE_RESULT_KEYS, RankPeak, TrialReport

PLAN = {"micro_batch": 16, "accum_steps": 4, "refusal": None}
EVENT = OomEvent("train", 1, 3, 32, 64, 2048, 4096, 8192, "CUDA out of memory", "micro-batch 32->16", rank=1)
MOVE = Move("node-b", "node-c", 2, "node node-b lost")
CHECK = PlanCheck("train", 1, 2, 1000, 1250, 2000, "8 x 8 (eval 64, fp32)", "12 x 6 (eval 64, fp32)")

REPORT = TrialReport(
    epoch=2, step=40, training_done=True, train_loss=0.5, measurements={"eval_loss": 0.7, "eval_accuracy": 0.9},
    learning_rate=2.5e-4, steps_per_second=12.5, samples_per_second=800.0,
    plan=PLAN, micro_batch=16, accum_steps=4, effective_batch=64, eval_batch=64, activation_checkpointing=False,
    precision="bf16", plan_reductions=1, estimator="static", estimated_by="driver", budget_bytes=1 << 30,
    predicted_peak_bytes=900, predicted_phase="train", memory_source="cuda_allocator", peak_allocated_bytes=800,
    peak_reserved_bytes=1000, fragmentation=0.25, device_used_bytes=1200, prediction_error=0.1,
    rank_peaks=(RankPeak(800, 1000), RankPeak(700, None)), node_id="n1", node_name="node-c", gpu_name="H100",
    gpu_total_bytes=80 << 30, oom_retries=1, oom_events=(EVENT,), moves=(MOVE,), plan_checks=(CHECK,),
)


def test_a_report_survives_tune_and_keeps_the_names_mlflow_has():
    metrics = REPORT.to_metrics()
    assert TrialReport.from_result(metrics) == REPORT
    # The names MLflow's records already use: the report's fields, flags as 0/1, each rank flat.
    assert metrics["training_done"] == 1 and metrics["activation_checkpointing"] == 0 and metrics["moved"] == 1
    assert metrics["eval_loss"] == 0.7 and metrics["peak_reserved_bytes"] == 1000
    assert (metrics["learning_rate"], metrics["steps_per_second"], metrics["samples_per_second"]) == (2.5e-4, 12.5, 800.0)
    assert metrics["rank0_peak_reserved_bytes"] == 1000 and "rank1_peak_reserved_bytes" not in metrics
    assert (metrics["ranks"], metrics["worst_rank"]) == (2, 0)
    # Lists as JSON text: Tune's TensorBoard logger warns of a list as an invalid value.
    assert json.loads(metrics["oom_events"]) == [EVENT.to_dict()] and json.loads(metrics["moves"]) == [MOVE.to_dict()]
    assert json.loads(metrics["plan_checks"]) == [CHECK.to_dict()]
    assert not any(isinstance(value, (list, tuple, dict)) for key, value in metrics.items() if key != "plan")
    # A result from before that change (a sweep resumed across it) carries lists, read as well.
    assert TrialReport.from_result({**metrics, "oom_events": [EVENT.to_dict()], "moves": [MOVE.to_dict()]}) == REPORT
    assert not {"refused", "done", "trial_id", "time_total_s"} & set(metrics)  # unset: not reported


def test_tunes_own_keys_are_read_or_dropped_and_a_refusal_is_a_status():
    result = {**REPORT.to_metrics(), "done": True, "trial_id": "abc_00001", "time_total_s": 12.5,
              "training_iteration": 3, "config": {"lr": 0.1}, "hostname": "h", "timestamp": 1}
    report = TrialReport.from_result(result)
    assert (report.done, report.trial_id, report.time_total_s) == (True, "abc_00001", 12.5)
    assert report.measurements == {"eval_loss": 0.7, "eval_accuracy": 0.9}
    numbers = report.numbers()
    assert numbers["time_total_s"] == 12.5 and numbers["peak_allocated_bytes"] == 800
    assert numbers["learning_rate"] == 2.5e-4 and numbers["samples_per_second"] == 800.0  # MLflow metrics
    assert not {"done", "training_done", "plan", "precision", "trial_id", "training_iteration"} & set(numbers)

    refused = TrialReport.from_result({"epoch": 0, "step": 0, "plan": {**PLAN, "refusal": "needs 9 MiB"}})
    assert refused.refused and refused.refusal == "needs 9 MiB" and refused.to_metrics()["refused"] == 1
    assert "refused" not in refused.numbers()


def test_what_a_result_lacks_stays_unset():
    assert TrialReport.from_result(None) == TrialReport.from_result({}) == TrialReport()
    empty = TrialReport()
    assert (empty.epoch, empty.measured_peak, empty.ranks, empty.worst_rank, empty.refused) == (None, None, 1, None, False)


def test_mlflow_floats_come_back_as_the_counts_they_were():
    """MLflow keeps every metric as a double: a report read from it has integer counts again."""
    report = TrialReport.from_result({"step": 40.0, "micro_batch": 16.0, "peak_allocated_bytes": 1.5e9, "train_loss": 0.5,
                                      "predicted_peak_bytes": 1782579.2, "rank0_peak_allocated_bytes": 3.0})
    assert report.step == 40 and isinstance(report.step, int) and isinstance(report.micro_batch, int)
    assert report.peak_allocated_bytes == 1_500_000_000 and report.measured_peak == 1_500_000_000
    assert report.predicted_peak_bytes == 1782579.2  # not a whole number: kept as it was
    assert report.rank_peaks == (RankPeak(3, None),)
    assert {"step", "micro_batch", "oom_retries", "peak_reserved_bytes", "moved"} <= TrialReport.integer_keys()
    assert "train_loss" not in TrialReport.integer_keys()


def test_tune_keys_cover_what_tune_adds_to_a_result():
    """Whatever Tune adds to every result is not the workload's measurement (fails when Ray adds a key)."""
    from ray.tune import result

    added = set(result.AUTO_RESULT_KEYS) | {result.DONE, result.TRIAL_ID, result.EXPERIMENT_TAG, result.SHOULD_CHECKPOINT}
    assert added <= TUNE_RESULT_KEYS


def test_a_divergence_travels_as_its_line_and_its_step():
    """The line is a Tune result's text (MLflow: a tag); the step is a number MLflow keeps as a metric."""
    report = TrialReport(step=5, diverged="loss not finite at step 5 (epoch 1); last finite loss 0.4", diverged_at_step=5)
    assert report.numbers()["diverged_at_step"] == 5 and "diverged" not in report.numbers()
    back = TrialReport.from_result({**report.to_metrics(), "diverged_at_step": 5.0})
    assert back == report and isinstance(back.diverged_at_step, int) and not back.measurements


def test_a_plan_check_says_what_was_predicted_measured_and_done():
    assert CHECK.changed and CHECK.error == 0.25
    assert CHECK.describe() == ("train after step 2 (epoch 1): measured 1.2 KiB, predicted 1000 B (+25%), limit 2.0 KiB; "
                                "plan 8 x 8 (eval 64, fp32) -> 12 x 6 (eval 64, fp32)")
    kept = PlanCheck("eval", 1, 8, 1000, 900, 2000, "8 x 8 (eval 64, fp32)", "8 x 8 (eval 64, fp32)")
    assert not kept.changed and kept.describe().endswith("(-10%), limit 2.0 KiB; plan 8 x 8 (eval 64, fp32) kept")
