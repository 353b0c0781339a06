"""The Tune-level failure handling: which failures shrink the plan, and which end the trial."""

from types import SimpleNamespace

from ray.tune.schedulers import FIFOScheduler

from orchestrator.failures import classify, exception_line, last_failure
from orchestrator.retry import OomAwareScheduler
from trainables.trainable import NOT_RETRIED_KEY, OOM_GAVE_UP_KEY, OOM_SHRINKS_KEY, OTHER_FAILURES_KEY


def _trial(tmp_path, text, config=None, failures=1, max_failures=3):
    error_file = tmp_path / "error.txt"
    error_file.write_text(text)
    trial = SimpleNamespace(
        error_file=str(error_file), config=dict(config or {"lr": 0.1}), max_failures=max_failures,
        run_metadata=SimpleNamespace(num_failures=failures),
    )
    trial.set_config = lambda c: setattr(trial, "config", c)
    return trial


def test_the_newest_failure_block_is_read(tmp_path):
    trial = _trial(tmp_path, "Failure # 1 (occurred at x)\nValueError: old\nFailure # 2 (occurred at y)\nRayActorError: died\n")
    assert "died" in last_failure(trial.error_file) and "old" not in last_failure(trial.error_file)
    assert last_failure(str(tmp_path / "missing")) == ""


def test_failures_are_classified():
    assert classify("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB") == "oom"
    assert classify("RuntimeError: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate") == "oom"
    assert classify("RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED") == "oom"  # as the worker's is_oom
    assert classify("ray.exceptions.RayActorError: The actor died unexpectedly") == "worker_died"
    assert classify("orchestrator.oom.OomRetriesExhausted: out of memory in train and no smaller plan") == "gave_up"
    assert classify("ValueError: a bug in the model") == "other"


def test_a_worker_killed_by_oom_restarts_with_one_more_reduction(tmp_path):
    scheduler = OomAwareScheduler(FIFOScheduler())
    trial = _trial(tmp_path, "Failure # 1\nRayActorError: The actor died unexpectedly\n")
    scheduler.on_trial_error(None, trial)
    assert trial.config[OOM_SHRINKS_KEY] == 1
    trial = _trial(tmp_path, "Failure # 2\ntorch.OutOfMemoryError: CUDA out of memory\n", config=trial.config)
    scheduler.on_trial_error(None, trial)
    assert trial.config[OOM_SHRINKS_KEY] == 2


def test_a_trial_that_gave_up_is_not_trained_again(tmp_path):
    scheduler = OomAwareScheduler(FIFOScheduler())
    trial = _trial(tmp_path, (
        "Failure # 1\nTraceback (most recent call last):\n  File x\n"
        "orchestrator.oom.OomRetriesExhausted: out of memory in train and no smaller plan is left; 1 OOM event(s):\n"
        "  epoch 0 train step 3: micro-batch 1, eval batch 8, asked 10 B with 20 B allocated -> gave up\n"
    ))
    scheduler.on_trial_error(None, trial)
    assert trial.config[OOM_GAVE_UP_KEY] == (
        "out of memory in train and no smaller plan is left; 1 OOM event(s):\n"
        "  epoch 0 train step 3: micro-batch 1, eval batch 8, asked 10 B with 20 B allocated -> gave up"
    )
    assert trial.run_metadata.num_failures == trial.max_failures  # its next failure is its last


def test_other_errors_are_not_retried_by_default(tmp_path):
    """As with Tune's own default (max_failures=0): a bug in the model fails its trial once."""
    scheduler = OomAwareScheduler(FIFOScheduler())
    trial = _trial(tmp_path, "Failure # 1\nTraceback\n  File x\nmy_models.wide.ShapeError: bad width 17\n")
    scheduler.on_trial_error(None, trial)
    assert trial.config == {"lr": 0.1, OTHER_FAILURES_KEY: 1, NOT_RETRIED_KEY: "ShapeError: bad width 17"}
    assert trial.run_metadata.num_failures == trial.max_failures  # the restart Tune makes is the last


def test_other_errors_are_retried_up_to_max_failures(tmp_path):
    scheduler = OomAwareScheduler(FIFOScheduler(), max_failures=1)
    trial = _trial(tmp_path, "Failure # 1\nOSError: stale file handle\n")
    scheduler.on_trial_error(None, trial)
    assert trial.config == {"lr": 0.1, OTHER_FAILURES_KEY: 1} and trial.run_metadata.num_failures == 1
    trial = _trial(tmp_path, "Failure # 2\nOSError: stale file handle\n", config=trial.config, failures=2)
    scheduler.on_trial_error(None, trial)
    assert trial.config[NOT_RETRIED_KEY] == "OSError: stale file handle"


def test_the_exception_line_is_the_innermost_without_its_module():
    text = (
        "ray.exceptions.RayTaskError(OomRetriesExhausted): \x1b[36mray::ImplicitFunc.train()\x1b[39m\n"
        "  File x, in run\n    raise ValueError(f'a: {b}')\n"
        "orchestrator.oom.OomRetriesExhausted: out of memory in train; 2 OOM event(s):\n  epoch 0 ...\n"
    )
    assert exception_line(text) == "OomRetriesExhausted: out of memory in train; 2 OOM event(s):"
    assert exception_line("Traceback\n  File x\nKeyboardInterrupt\n") == "KeyboardInterrupt"
