"""The errors a trial raises for the driver to read back: their first line stands alone."""

from orchestrator.contract import OomEvent
from orchestrator.failures import exception_line
from orchestrator.trial.errors import OomRetriesExhausted


def oom(step: int, micro_batch: int, action: str, rank: int | None = None) -> OomEvent:
    return OomEvent(phase="train", epoch=1, step=step, micro_batch=micro_batch, eval_batch=64, bytes_requested=2**20,
                    bytes_allocated=2**21, bytes_reserved=None, message="CUDA out of memory", action=action, rank=rank)


def test_a_trial_out_of_retries_says_in_its_first_line_where_it_last_ran_out():
    """The table's status, ``report`` and MLflow's tag show the first line alone: it must not end
    in a colon that the event lines below it were to complete."""
    error = OomRetriesExhausted.from_events(
        [oom(1, 256, "micro-batch 256->128 (accumulation 1->2)", rank=1), oom(3, 128, "gave up", rank=1)],
        "out of memory in train and memory.max_oom_retries=1 reached")
    first, *events = str(error).splitlines()
    assert first == ("out of memory in train and memory.max_oom_retries=1 reached; 2 OOM event(s), the last in "
                     "epoch 1 train step 3 on rank 1 at micro-batch 128")
    assert events[0].startswith("  epoch 1 train step 1 on rank 1: micro-batch 256, eval batch 64, asked 1.0 MiB")
    text = f"Traceback (most recent call last):\n  File x\norchestrator.trial.errors.OomRetriesExhausted: {error}\n"
    assert exception_line(text) == f"OomRetriesExhausted: {first}"
