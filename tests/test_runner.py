"""The runner's own decisions: what counts as finished, and which sweep folder a run uses."""

import os
from types import SimpleNamespace

from orchestrator.config import parse_spec
from orchestrator.runner import SweepOutcome, _experiment_name, _row, summary_table

SPEC = parse_spec({
    "experiment": "exp", "workload": "mlp", "search_space": {"lr": {"choice": [0.1, 0.01]}},
    "effective_batch_size": 32, "stop": {"epochs": 3},
})
METRICS = {"trial_id": "abc_00000", "epoch": 3, "eval_loss": 0.5, "micro_batch": 16, "accum_steps": 2,
           "peak_allocated_bytes": 2048, "memory_source": "cpu_tensor_tracker", "oom_retries": 1}


def result(metrics, error=None):
    return SimpleNamespace(metrics=metrics, config={"workload": "mlp", "lr": 0.1, "seed": 0}, error=error, path="/x/t")


def test_a_completed_or_early_stopped_trial_is_finished():
    row = _row(result({**METRICS, "done": True}), SPEC)
    assert (row.status, row.plan, row.final_metric, row.oom_retries, row.config) == ("TERMINATED", "16 x 2", 0.5, 1, "lr=0.1")
    assert _row(result({**METRICS, "epoch": 1, "done": True}), SPEC).status == "TERMINATED"  # e.g. ASHA stopped it


def test_an_interrupted_trial_is_not_finished_and_fails_the_sweep():
    rows = [_row(result({**METRICS, "done": True}), SPEC), _row(result({**METRICS, "epoch": 2, "done": False}), SPEC)]
    assert rows[1].status == "INTERRUPTED"
    assert not SweepOutcome(rows, "/x", "sqlite:///m.db").ok
    # The budget spent, interrupted before Tune saw it return: finished.
    assert _row(result({**METRICS, "epoch": 3, "done": False, "training_done": 1}), SPEC).status == "TERMINATED"


def test_refused_and_errored_trials():
    refused = _row(result({"trial_id": "r", "epoch": 0, "refused": 1, "refusal": "needs 31 GiB", "done": True}), SPEC)
    assert refused.status == "REFUSED" and refused.note == "needs 31 GiB" and refused.plan == "-"
    errored = _row(result({}, error=RuntimeError("ray::train()\n\x1b[36mTraceback\nValueError: bad width\n")), SPEC)
    assert errored.status == "ERROR" and errored.note == "ValueError: bad width"
    assert "REFUSED: needs 31 GiB" in summary_table([refused], SPEC)
    assert "  3/3 ep  " in summary_table([_row(result({**METRICS, "done": True}), SPEC)], SPEC)


def test_a_step_budget_shows_steps_run():
    spec = parse_spec({**SPEC.raw, "stop": {"epochs": 3, "steps": 500}})
    row = _row(result({**METRICS, "epoch": 1, "step": 500, "done": True}), spec)
    table = summary_table([row], spec)
    assert "1/3 ep, 500/500 steps" in table and "eval_loss" in table.splitlines()[0]


def test_each_run_gets_its_own_folder_unless_named(tmp_path):
    name, restore = _experiment_name(SPEC, str(tmp_path), None, resume=False)
    assert name.startswith("exp_") and restore is None
    assert _experiment_name(SPEC, str(tmp_path), "exp-job7", resume=False) == ("exp-job7", None)
    # Nothing there to resume: a named run starts its sweep under that name.
    assert _experiment_name(SPEC, str(tmp_path), "exp-job7", resume=True) == ("exp-job7", None)
    assert not os.listdir(tmp_path)
