"""What a worker remembers between the trials it runs (the sweeps that reuse workers are in
``test_trainable.py``)."""

from orchestrator.trial.reuse import WorkerHistory


def test_a_reused_workers_budget_adds_back_its_own_cuda_context():
    history = WorkerHistory()
    assert history.gpu_free_before_context(70 * 2**30) == 70 * 2**30  # first trial: read before the context
    history.cuda_context_bytes = 600 * 2**20
    assert history.gpu_free_before_context(70 * 2**30) == 70 * 2**30 + 600 * 2**20
    assert history.gpu_free_before_context(None) is None  # no NVML
