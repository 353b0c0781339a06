"""OOM retries at the Tune level: a scheduler that wraps the user's and shrinks plans.

Most OOMs never reach Tune: the trainable catches them, shrinks its plan and resumes from its
last checkpoint in the same process. This wrapper covers what the trainable cannot: a worker
that *died* (a hard CUDA failure, the process killed). Tune calls a scheduler's
``on_trial_error`` before it requeues a failed trial, and the requeued trial is built from
``trial.config`` and restored from the last checkpoint, so setting a config key there is how
the restarted trial learns to apply one more reduction (the same mechanism PBT uses to mutate
configs). Every scheduling decision is still the wrapped scheduler's (FIFO, ASHA, ...).

Tune decides whether to retry before this hook runs, from ``FailureConfig.max_failures``; a
trial whose in-process retries ran out is therefore restarted once more, and told here to fail
at once, with its failure count raised so that this failure is its last.
"""

from __future__ import annotations

from ray.tune.schedulers import TrialScheduler

from trainables.trainable import OOM_GAVE_UP_KEY, OOM_SHRINKS_KEY

_GAVE_UP = ("OomRetriesExhausted",)
_OOM = ("OutOfMemoryError", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
_WORKER_DIED = ("RayActorError", "actor died unexpectedly", "ActorDiedError")


def last_failure(error_file: str | None) -> str:
    """The text of the newest ``Failure # N`` block Tune wrote for a trial."""
    if not error_file:
        return ""
    try:
        with open(error_file) as f:
            text = f.read()
    except OSError:
        return ""
    return text.rsplit("Failure # ", 1)[-1]


def gave_up_message(failure: str) -> str:
    """The ``OomRetriesExhausted`` message (reason and event lines) out of a failure's traceback."""
    lines = failure.splitlines()
    start = max(i for i, line in enumerate(lines) if "OomRetriesExhausted:" in line)
    message = [lines[start].split("OomRetriesExhausted:", 1)[1].strip()]
    message += [line for line in lines[start + 1 :] if line.startswith("  epoch ")]
    return "\n".join(message)


def classify(failure: str) -> str:
    """``gave_up`` | ``oom`` | ``worker_died`` | ``other``."""
    if any(s in failure for s in _GAVE_UP):
        return "gave_up"
    if any(s.lower() in failure.lower() for s in _OOM):
        return "oom"
    if any(s in failure for s in _WORKER_DIED):
        return "worker_died"
    return "other"


class OomAwareScheduler(TrialScheduler):
    def __init__(self, inner: TrialScheduler):
        super().__init__()
        self.inner = inner

    def on_trial_error(self, tune_controller, trial) -> None:
        kind = classify(last_failure(trial.error_file))
        config = dict(trial.config)
        if kind in ("oom", "worker_died"):
            # A worker killed by memory cannot shrink its own plan: the restart does it.
            config[OOM_SHRINKS_KEY] = config.get(OOM_SHRINKS_KEY, 0) + 1
            trial.set_config(config)
        elif kind == "gave_up" and not config.get(OOM_GAVE_UP_KEY):
            config[OOM_GAVE_UP_KEY] = gave_up_message(last_failure(trial.error_file))
            trial.set_config(config)
            trial.run_metadata.num_failures = max(trial.max_failures, trial.run_metadata.num_failures)
        self.inner.on_trial_error(tune_controller, trial)

    # -- everything else is the wrapped scheduler's decision ---------------------------------
    @property
    def metric(self):
        return self.inner.metric

    @property
    def supports_buffered_results(self):
        return self.inner.supports_buffered_results

    def set_search_properties(self, metric, mode, **spec) -> bool:
        return self.inner.set_search_properties(metric, mode, **spec)

    def on_trial_add(self, tune_controller, trial):
        return self.inner.on_trial_add(tune_controller, trial)

    def on_trial_result(self, tune_controller, trial, result):
        return self.inner.on_trial_result(tune_controller, trial, result)

    def on_trial_complete(self, tune_controller, trial, result):
        return self.inner.on_trial_complete(tune_controller, trial, result)

    def on_trial_remove(self, tune_controller, trial):
        return self.inner.on_trial_remove(tune_controller, trial)

    def choose_trial_to_run(self, tune_controller):
        return self.inner.choose_trial_to_run(tune_controller)

    def debug_string(self) -> str:
        return self.inner.debug_string()

    def save(self, checkpoint_path: str):
        return self.inner.save(checkpoint_path)

    def restore(self, checkpoint_path: str):
        return self.inner.restore(checkpoint_path)
