"""A round of queued MLflow writes merged per run (orchestrator/tracking/batching.py): which
writes go together, and that a merged batch leaves a real SQLite store as the writes one by one do."""

from __future__ import annotations

import uuid

from mlflow import MlflowClient

from orchestrator.tracking.batching import RunBatch, merged, parts
from orchestrator.tracking.operations import AddParams, EndRun, LogArtifact, LogResult, SetTags, StartRun
from orchestrator.tracking.runs import SweepIdentity, TrialRef
from orchestrator.tracking.writer import MlflowWriter

A, B = TrialRef("a_00000", "trial_a_00000", "mlp"), TrialRef("b_00001", "trial_b_00001", "mlp")


def result(target: TrialRef, step: int, loss: float) -> LogResult:
    return LogResult(target, step, {"train_loss": loss, "epoch": float(step)}, 1_000 + step)


def a_trials_life(target: TrialRef, first_step: int = 1) -> list:
    """What the callback queues for one short trial, start to end."""
    return [
        StartRun(target, params={"config.lr": "0.01"}, tags={"tune.trial_path": "/t"}),
        AddParams(target, {"estimator": "trace"}),
        SetTags(target, {"precision": "fp32"}),
        *(result(target, step, 1.0 / step) for step in range(first_step, first_step + 3)),
        AddParams(target, {"plan.micro_batch": "32"}),
        EndRun(target, "FINISHED"),
    ]


def test_each_runs_writes_become_one_batch_up_to_its_end_in_their_order():
    a, b = a_trials_life(A), a_trials_life(B)
    interleaved = [SetTags(None, {"mlflow.runName": "sweep"})] + [op for pair in zip(a, b) for op in pair]
    sends = merged(interleaved)
    assert [type(s).__name__ for s in sends] == ["SetTags", "RunBatch", "RunBatch"]
    assert sends[1].parts == a and sends[2].parts == b
    assert sorted(map(id, (op for s in sends for op in parts(s)))) == sorted(map(id, interleaved))


def test_an_artifact_or_an_end_closes_a_runs_batch_and_a_write_alone_stays_itself():
    restart = StartRun(A, params={"config.lr": "0.01"})
    artifact = LogArtifact(A, "plan_history.json", [{"step": 2}])
    ops = [result(A, 1, 1.0), artifact, result(A, 2, 0.5), EndRun(A, "FAILED"), restart, result(A, 3, 0.4)]
    sends = merged(ops)
    assert sends[0] is ops[0] and sends[1] is artifact  # one write: no batch around it
    assert isinstance(sends[2], RunBatch) and sends[2].parts == ops[2:4]
    assert isinstance(sends[3], RunBatch) and sends[3].parts == ops[4:]


def run_data(uri: str, sweep: SweepIdentity, target: TrialRef) -> dict:
    client = MlflowClient(uri)
    writer = MlflowWriter(uri, sweep)
    run = client.get_run(writer.run_id(target))
    history = {int(m.step): m.value for m in client.get_metric_history(run.info.run_id, "train_loss")}
    tags = {k: v for k, v in run.data.tags.items() if not k.startswith(("mlflow.", "orchestrator.sweep_id"))}
    return {"status": run.info.status, "params": run.data.params, "tags": tags, "train_loss": history}


def test_a_batch_leaves_the_store_as_its_writes_one_by_one_do(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    one_by_one, batched = (SweepIdentity(uuid.uuid4().hex, name, "batching") for name in ("one", "batched"))
    # A resumed trial: it had steps 1-2 already, reports 2 again (kept as first sent) and 3-4.
    earlier = [StartRun(A, params={"config.lr": "0.01"}), result(A, 1, 1.0), result(A, 2, 0.5)]
    later = [StartRun(A, params={"config.lr": "0.01", "resources.cpu": "1"}), result(A, 2, 9.0),
             result(A, 3, 0.4), result(A, 3, 8.0), result(A, 4, 0.3), SetTags(A, {"node_name": "n1"}),
             AddParams(A, {"plan.micro_batch": "32"}), EndRun(A, "FINISHED")]
    for sweep, batch in ((one_by_one, False), (batched, True)):
        writer = MlflowWriter(uri, sweep, new_sweep=True)
        for op in earlier:
            op.apply(writer)
        writer = MlflowWriter(uri, sweep)  # the resumed driver knows nothing of what landed
        if batch:
            [send] = merged(later)
            send.apply(writer)
        else:
            for op in later:
                op.apply(writer)
    expected = run_data(uri, one_by_one, A)
    assert expected["train_loss"] == {1: 1.0, 2: 0.5, 3: 0.4, 4: 0.3}
    assert expected["status"] == "FINISHED" and expected["params"]["resources.cpu"] == "1"
    assert run_data(uri, batched, A) == expected
