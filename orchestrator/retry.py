"""OOM retries at the Tune level: a scheduler that wraps the user's and shrinks plans.

Most OOMs never reach Tune: the trainable catches them, shrinks its plan and resumes from its
last checkpoint in the same process. This wrapper covers what the trainable cannot: a worker
that *died* of memory (killed by Ray's memory monitor, or dead while recovering from an OOM it
had recorded; see :mod:`orchestrator.failures` for the evidence). A worker that died without
such evidence (``kill -9``, a lost node) restarts with the plan it had, told why (so that,
resumed on another node, it can say why it moved; it re-plans there only if that node's
budget is smaller, ``orchestrator.trial.run``). Tune calls a scheduler's
``on_trial_error`` before it requeues a failed trial, and the requeued trial is built from
``trial.config`` and restored from the last checkpoint, so setting a config key there is how
the restarted trial learns to apply one more reduction (the same mechanism PBT uses to mutate
configs). Every scheduling decision is still the wrapped scheduler's (FIFO, ASHA, ...).

Tune decides whether to retry before this hook runs, from ``FailureConfig.max_failures``; a
trial whose in-process retries ran out, or that failed for another reason more often than the
sweep's ``max_failures`` allows, is therefore restarted once more, and told here to fail at
once, with its failure count raised so that this failure is its last.

A data error (a sample that cannot be loaded) is known before Tune decides: the trial reports
it (``TrialReport.data_error``) just before it raises, and Tune handles a trial's results before its
error, so ``on_trial_result`` lowers that trial's retry budget to what it has spent and the
failure that follows is its last: it is not restarted at all.
"""

from __future__ import annotations

from ray.tune.schedulers import TrialScheduler

from orchestrator.contract import (
    NOT_RETRIED_KEY,
    OOM_GAVE_UP_KEY,
    OOM_SHRINKS_KEY,
    OTHER_FAILURES_KEY,
    RESTART_REASON_KEY,
)
from orchestrator.failures import classify, exception_line, gave_up_message, last_failure, pickled_failure
from orchestrator.ray_internals import make_last_failure, make_next_failure_last
from orchestrator.trial.evidence import take_oom_evidence
from orchestrator.trial_report import TrialReport


class OomAwareScheduler(TrialScheduler):
    """The user's scheduler, plus what each kind of failure means for the trial's restart.

    Tune's retry budget (``FailureConfig.max_failures``) is ``max_oom_retries + max_failures``;
    this wrapper spends it by kind: OOM restarts until the plan has no smaller step left,
    other failures (a bug in the model, a bad file) at most ``max_failures`` times, as a Tune
    user who set ``FailureConfig(max_failures=...)`` would expect.
    """

    def __init__(self, inner: TrialScheduler, max_failures: int = 0):
        super().__init__()
        self.inner = inner
        self.max_failures = max_failures
        self.data_errors: set[str] = set()  # trials whose next failure is a data error

    def state(self) -> dict:
        """What a resume needs (``orchestrator.scheduler_state``): the wrapped scheduler's own
        attributes (ASHA's rungs and the values recorded at them) and the data errors pending."""
        return {"inner": dict(vars(self.inner)), "data_errors": set(self.data_errors)}

    def put_back(self, state: dict) -> None:
        vars(self.inner).update(state["inner"])
        self.data_errors = set(state["data_errors"])

    def on_trial_error(self, tune_controller, trial) -> None:
        if trial.trial_id in self.data_errors:  # not retried (see the module): nothing to prepare
            self.inner.on_trial_error(tune_controller, trial)
            return
        failure = last_failure(trial.error_file)
        evidence = take_oom_evidence(str(trial.path) if trial.path else None)
        kind = classify(failure, pickled_failure(trial.pickled_error_file, failure), oom_evidence=evidence is not None)
        config = dict(trial.config)
        if kind == "oom":
            # A worker killed by memory cannot shrink its own plan: the restart does it.
            config[OOM_SHRINKS_KEY] = config.get(OOM_SHRINKS_KEY, 0) + 1
        elif kind in ("node_died", "node_unreachable", "worker_died"):
            # Not memory: the same plan, from the last checkpoint, wherever Ray places it next.
            config[RESTART_REASON_KEY] = kind
        elif kind == "gave_up" and not config.get(OOM_GAVE_UP_KEY):
            config[OOM_GAVE_UP_KEY] = gave_up_message(failure)
            make_last_failure(trial)  # its restart fails at once, from the key above
        elif kind == "other" and not config.get(NOT_RETRIED_KEY):
            config[OTHER_FAILURES_KEY] = config.get(OTHER_FAILURES_KEY, 0) + 1
            if config[OTHER_FAILURES_KEY] > self.max_failures:
                config[NOT_RETRIED_KEY] = exception_line(failure)
                make_last_failure(trial)  # its restart fails at once, from the key above
        if config != trial.config:
            trial.set_config(config)
        self.inner.on_trial_error(tune_controller, trial)

    # -- everything else is the wrapped scheduler's decision (save a data error's report) -----
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
        if TrialReport.from_result(result).data_error:  # the trial fails next, of a data error: no retry
            self.data_errors.add(trial.trial_id)
            make_next_failure_last(trial)
            return TrialScheduler.CONTINUE
        with _infinities_compared():
            return self.inner.on_trial_result(tune_controller, trial, result)

    def on_trial_complete(self, tune_controller, trial, result):
        with _infinities_compared():
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


def _infinities_compared():
    """A diverged trial reports an infinite metric (its worst value, ``orchestrator.trial.run``):
    ASHA's rung cutoff interpolates percentiles over it, which makes numpy warn of an invalid
    value on the console although the ranking is right (the infinity ranks last)."""
    import numpy as np

    return np.errstate(invalid="ignore")
