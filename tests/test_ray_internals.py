"""What this project takes from Ray beyond its public API (``orchestrator/ray_internals.py``), checked
against the installed Ray in a second, without starting it.

The Tune-level OOM retry (``orchestrator/retry.py``) needs Tune's failure path to call the
scheduler's ``on_trial_error`` after Tune decided to retry the trial and before it requeues it,
to build the restart from ``trial.config`` as set with ``Trial.set_config``, and to read
``trial.run_metadata.num_failures`` when it next decides whether to retry. The scheduler reads
the failure from ``Trial.error_file`` and ``Trial.pickled_error_file``, written on the driver
by ``Trial.handle_error`` before the hook; the runner's record does too (``outcome.py``), and the
OOM evidence is looked up under ``Trial.path``, which a trial finds in Tune's ``StorageContext``.
The dashboard and job client read Ray's token with ``ray._raylet.AuthenticationTokenLoader``. A
Ray upgrade that changes any of these fails here, naming what changed, instead of in a sweep.
(docs/ARCHITECTURE.md: the Ray range.)
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow.fs
import pytest
from ray import tune
from ray.exceptions import ActorDiedError
from ray.train._internal.storage import StorageContext
from ray.tune.execution.tune_controller import TuneController
from ray.tune.experiment import Trial
from ray.tune.schedulers import FIFOScheduler

from orchestrator.contract import NOT_RETRIED_KEY, OOM_SHRINKS_KEY, OomEvent
from orchestrator.ray_internals import (
    TOKEN_NOTICE_LOGGER,
    RayChanged,
    auth_token_loader,
    callbacks_of,
    forget_gone_checkpoints,
    forget_running_statistics,
    make_last_failure,
    make_next_failure_last,
    ray_processes_in_group,
    state_folders,
    storage_folder,
    trial_storage_folder,
)
from orchestrator.retry import OomAwareScheduler
from orchestrator.trial.evidence import write_oom_evidence
from tests.conftest import kept_checkpoints


class Controller:
    """Just enough of a ``TuneController`` for its own failure-handling methods to run on."""

    def __init__(self, scheduler):
        self._scheduler_alg = scheduler
        self._search_alg = SimpleNamespace(on_trial_complete=lambda *a, **k: None)
        self._callbacks = SimpleNamespace(on_trial_recover=lambda **k: None, on_trial_error=lambda **k: None)
        self._cached_trial_decisions, self._trial_to_actor = {}, {}
        self._trials, self._live_trials = [], set()
        self._iteration, self._has_errored = 0, False
        self.seen_by_scheduler: list[tuple[str, dict]] = []  # (trial status, config) when the hook ran

    def _set_trial_status(self, trial, status):
        trial.set_status(status)

    def _wrapped(self):
        return self

    def _mark_trial_to_checkpoint(self, trial):
        pass

    def fail(self, trial, exception):
        """The running trial fails with ``exception``, as Tune's event loop hands it over."""
        if trial not in self._trials:
            self._trials.append(trial)
        trial.set_status(Trial.RUNNING)
        for name in ("_process_trial_failure", "_try_recover", "_requeue_trial", "_schedule_trial_stop"):
            if not hasattr(TuneController, name):
                pytest.fail(f"Tune changed: TuneController.{name} is gone; re-check orchestrator/retry.py's hook")
            setattr(self, name, getattr(TuneController, name).__get__(self))
        TuneController._process_trial_failure(self, trial, exception)


class Watching(OomAwareScheduler):
    """The retry scheduler, noting what the trial looked like when Tune called it."""

    def __init__(self):
        super().__init__(FIFOScheduler())

    def on_trial_error(self, tune_controller, trial):
        tune_controller.seen_by_scheduler.append((trial.status, dict(trial.config)))
        super().on_trial_error(tune_controller, trial)


def a_trial(tmp_path: Path, max_failures: int) -> Trial:
    staging, stored = tmp_path / "staging", tmp_path / "stored"
    staging.mkdir()
    stored.mkdir()
    storage = SimpleNamespace(  # a StorageContext's paths, without a Ray session
        trial_driver_staging_path=str(staging), trial_fs_path=str(stored), trial_dir_name="t",
        experiment_fs_path=str(tmp_path), storage_filesystem=None,
    )
    trial = Trial("train_trial", config={"lr": 0.1}, trial_id="abc_00000", stub=True, max_failures=max_failures)
    trial.storage = storage
    return trial


def test_the_failure_path_the_oom_retry_relies_on(tmp_path):
    trial = a_trial(tmp_path, max_failures=3)
    assert Path(trial.path) == tmp_path / "stored", "Tune changed: Trial.path is not the trial's storage folder"
    write_oom_evidence(trial.path, OomEvent("train", 0, 3, 64, 64, 1, 2, None, "out of memory"))
    controller = Controller(Watching())

    controller.fail(trial, ActorDiedError())  # a worker that died recovering from an OOM it wrote down
    assert controller.seen_by_scheduler, "Tune changed: the scheduler's on_trial_error is not called on a retried failure"
    status, config = controller.seen_by_scheduler[0]
    assert OOM_SHRINKS_KEY not in config, "Tune changed: on_trial_error runs after the trial's config was read again"
    assert trial.error_file and Path(trial.error_file).is_file(), "Tune changed: no error.txt on the driver before the hook"
    assert trial.pickled_error_file and Path(trial.pickled_error_file).is_file(), "Tune changed: no error.pkl before the hook"
    assert trial.status == Trial.PENDING, f"Tune changed: after the hook the trial is {trial.status}, not requeued"
    assert trial.config[OOM_SHRINKS_KEY] == 1, "Tune changed: Trial.set_config in the hook does not reach the restart"

    # A bug (max_failures 0 for those): the hook makes this failure the last by raising num_failures.
    controller.seen_by_scheduler.clear()
    controller.fail(trial, RuntimeError("ValueError: a bug in the model"))
    assert trial.config[NOT_RETRIED_KEY] == "ValueError: a bug in the model"
    assert trial.run_metadata.num_failures == trial.max_failures
    assert trial.status == Trial.PENDING  # the restart Tune had decided on; it fails at once
    controller.fail(trial, RuntimeError(f"NotRetriedError: {trial.config[NOT_RETRIED_KEY]}"))
    assert not trial.should_recover() and trial.status == Trial.ERROR, (
        "Tune changed: writing trial.run_metadata.num_failures no longer ends the retries"
    )


def test_a_data_error_announced_by_a_result_ends_the_trial_without_a_restart(tmp_path):
    """The trial reports its data error, then fails: Tune does not restart it, and counts one failure."""
    trial = a_trial(tmp_path, max_failures=3)
    controller = Controller(Watching())
    controller.seen_by_scheduler.clear()
    controller._scheduler_alg.on_trial_result(controller, trial, {"data_error": "train_data sample 13: ..."})
    controller.fail(trial, RuntimeError("DataError: train_data sample 13: ..."))
    assert trial.status == Trial.ERROR, "Ray changed: lowering Trial.max_failures no longer ends the retries"
    assert trial.run_metadata.num_failures == 1 and trial.config == {"lr": 0.1}


def test_a_trial_without_a_retry_budget_is_an_error():
    with pytest.raises(RayChanged, match="Trial has no 'run_metadata'"):
        make_next_failure_last(SimpleNamespace(max_failures=3))


def test_a_trial_finds_its_storage_folder_where_the_driver_looks_for_the_evidence(tmp_path):
    storage = StorageContext(storage_path=str(tmp_path), experiment_dir_name="sweep", trial_dir_name="t")
    folder = storage_folder(storage)
    assert folder == str(tmp_path / "sweep" / "t"), f"Ray changed: StorageContext.trial_fs_path is {folder}"

    trial = a_trial(tmp_path, max_failures=1)
    trial.storage = storage
    assert Path(trial.path) == Path(folder), "Ray changed: Trial.path is not the StorageContext's trial folder"


@pytest.mark.integration
@pytest.mark.usefixtures("local_ray")  # the staging folder is in Ray's session folder
def test_the_driver_finds_where_tune_stages_and_stores_the_sweeps_state(tmp_path):
    trial = a_trial(tmp_path, max_failures=1)
    trial.storage = StorageContext(storage_path=str(tmp_path), experiment_dir_name="sweep", trial_dir_name="t")
    staging, sweep = state_folders(trial)
    assert sweep == str(tmp_path / "sweep"), f"Ray changed: StorageContext.experiment_fs_path is {sweep}"
    assert staging.endswith("/sweep/driver_artifacts"), f"Ray changed: the driver's staging folder is {staging}"


def test_a_storage_the_driver_cannot_read_has_no_evidence_folder(tmp_path):
    remote = pyarrow.fs.SubTreeFileSystem(str(tmp_path), pyarrow.fs.LocalFileSystem())  # as an s3:// bucket is
    storage = StorageContext(storage_path="bucket", experiment_dir_name="sweep", trial_dir_name="t", storage_filesystem=remote)
    assert storage_folder(storage) is None


def test_a_changed_storage_context_is_an_error_not_a_silent_loss_of_evidence():
    with pytest.raises(RayChanged, match="StorageContext has no 'storage_filesystem'"):
        storage_folder(SimpleNamespace(trial_fs_path="/somewhere"))


def test_outside_a_trial_there_is_no_storage_folder():
    assert trial_storage_folder() is None


def test_the_metrics_export_interval_is_rays_setting_floored_at_a_second():
    """Read in a fresh process each: Ray reads ``RAY_metrics_report_interval_ms`` once, at import."""
    def interval(setting: str | None) -> float:
        env = {k: v for k, v in os.environ.items() if k != "RAY_metrics_report_interval_ms"}
        if setting is not None:
            env["RAY_metrics_report_interval_ms"] = setting
        code = "from orchestrator.ray_internals import metrics_export_interval_s as f; print(f())"
        return float(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                                    text=True, timeout=120).stdout)

    assert interval(None) == 10.0
    assert interval("2500") == 2.5
    assert interval("200") == 1.0


def test_the_token_loader_the_dashboard_uses():
    loader = auth_token_loader()
    for method in ("reset_cache", "get_token_for_http_header", "has_token"):
        assert callable(getattr(loader, method, None)), f"Ray changed: AuthenticationTokenLoader.{method} is gone"


def test_the_token_notice_of_a_new_local_cluster_comes_from_the_logger_run_quiets(caplog):
    """What a new local ``ray.init`` calls to say token authentication is on: its record must come
    from :data:`TOKEN_NOTICE_LOGGER`, or ``run`` would print it on every sweep again."""
    import importlib

    module = importlib.import_module(TOKEN_NOTICE_LOGGER)
    notice = getattr(module, "_warn_token_auth_enabled", None)
    assert callable(notice), f"Ray changed: {TOKEN_NOTICE_LOGGER}._warn_token_auth_enabled is gone"
    with caplog.at_level(logging.WARNING, logger=TOKEN_NOTICE_LOGGER):
        notice()
    assert [r.name for r in caplog.records if "Token authentication is enabled" in r.getMessage()] == [TOKEN_NOTICE_LOGGER]


def test_a_trial_without_its_failure_count_is_an_error():
    with pytest.raises(RayChanged, match="Trial has no 'run_metadata'"):
        make_last_failure(SimpleNamespace(max_failures=3))


def test_an_ended_trials_running_statistics_go_but_its_metric_and_last_result_stay():
    trial = Trial("train_trial", config={"lr": 0.1}, trial_id="abc_00000", stub=True)
    for step in (1, 2):
        trial.update_last_result({"training_iteration": step, "eval_loss": 1.0 / step, "micro_batch": 32, "plan": {"accum_steps": 2}})
    assert {"eval_loss", "micro_batch", "plan/accum_steps"} <= set(trial.metric_analysis)
    forget_running_statistics(trial, keep="eval_loss")
    assert set(trial.metric_analysis) == set(trial.metric_n_steps) == {"eval_loss"}
    assert trial.metric_analysis["eval_loss"]["last"] == 0.5 and trial.last_result["micro_batch"] == 32
    with pytest.raises(RayChanged, match="Trial has no 'run_metadata'"):
        forget_running_statistics(SimpleNamespace(), keep="eval_loss")


def test_a_resumed_trial_forgets_the_checkpoints_a_killed_driver_deleted(tmp_path, trial_with_checkpoints):
    """Tune deletes a checkpoint past ``keep`` when it registers the next, and saves the state
    after: a state saved before a kill names the deleted one. Registering the trial's next
    checkpoint then fails to delete it again (``FileNotFoundError``, logged with its traceback by
    the controller) unless the trial forgot it first; the latest one is never forgotten."""
    trial, checkpoint = trial_with_checkpoints(tmp_path / "forgot", steps=2)
    (tmp_path / "forgot" / "checkpoint_000000").rmdir()  # deleted, then the driver was killed
    assert forget_gone_checkpoints(trial) == 1 and kept_checkpoints(trial) == ["checkpoint_000001"]
    trial.run_metadata.checkpoint_manager.register_checkpoint(checkpoint(2))
    assert kept_checkpoints(trial) == ["checkpoint_000001", "checkpoint_000002"]

    trial, checkpoint = trial_with_checkpoints(tmp_path / "as_tune_restores", steps=2)  # what Ray does without it
    (tmp_path / "as_tune_restores" / "checkpoint_000000").rmdir()
    with pytest.raises(FileNotFoundError, match="checkpoint_000000"):
        trial.run_metadata.checkpoint_manager.register_checkpoint(checkpoint(2))

    trial, _ = trial_with_checkpoints(tmp_path / "latest", steps=2)
    (tmp_path / "latest" / "checkpoint_000001").rmdir()  # the storage lost the latest: a resume's own error
    assert forget_gone_checkpoints(trial) == 0 and kept_checkpoints(trial) == ["checkpoint_000000", "checkpoint_000001"]
    with pytest.raises(RayChanged, match="checkpoint bookkeeping has no 'run_metadata'"):
        forget_gone_checkpoints(SimpleNamespace())


def test_the_local_rays_processes_start_in_the_group_they_are_given():
    """What ``ray.init`` starts its GCS and raylet with joins the given process group within the
    block (a SIGTERM to the driver's group does not reach it), and is Ray's own class again after."""
    import os
    import sys

    from ray._private import services

    before = services.ConsolePopen
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], process_group=0)
    try:
        with ray_processes_in_group(leader.pid):
            child = services.ConsolePopen([sys.executable, "-c", "import os; print(os.getpgrp())"],
                                          stdout=subprocess.PIPE, text=True)
            out, _ = child.communicate(timeout=30)
    finally:
        leader.kill()
        leader.wait()
    assert int(out) == leader.pid != os.getpgrp()
    assert services.ConsolePopen is before


SHUT_DOWN = """
import sys
import ray
from ray._private import node, worker
from orchestrator.ray_internals import shut_down_local_ray

stopped = []  # the order Ray stops its processes in
stop = node.Node._kill_process_impl
node.Node._kill_process_impl = lambda self, kind, *args, **kwargs: (stopped.append(kind), stop(self, kind, *args, **kwargs))[1]
ray.init(num_cpus=1, include_dashboard=False, _temp_dir=sys.argv[1])
processes = {kind: [info.process for info in infos] for kind, infos in worker._global_node.all_processes.items()}
assert "monitor" in processes and "gcs_server" in processes, processes
shut_down_local_ray()
assert not ray.is_initialized()
assert stopped[0] == "monitor" and stopped.count("monitor") == 1 and "gcs_server" in stopped, stopped
assert processes["monitor"][0].returncode == -9, processes["monitor"][0].returncode
left = [kind for kind, infos in processes.items() for process in infos if process.poll() is None]
assert not left, left
ray.init(num_cpus=1, include_dashboard=False, _temp_dir=sys.argv[2])
try:
    assert ray.get(ray.remote(lambda: 7).remote(), timeout=120) == 7
finally:
    shut_down_local_ray()
print("ok")
"""


@pytest.mark.integration  # starts a local Ray, twice
def test_a_local_ray_is_shut_down_monitor_first_with_nothing_left_running(isolated_environment, ray_temp_dir):
    """The autoscaler monitor stops before the GCS it would report its end to (killed, so it
    reports nothing), and then every other process of the Ray, as ``ray.shutdown`` stops them; a
    new Ray starts afterwards. (The second this saves a command: bench/RESULTS.md.)"""
    run = subprocess.run([sys.executable, "-c", SHUT_DOWN, str(ray_temp_dir("shutdown")), str(ray_temp_dir("again"))],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": ""})
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


class NamedCallback(tune.Callback):
    """A callback whose setting a restored Tuner must hand back as it was pickled."""

    def __init__(self, name: str):
        self.name = name


def test_a_restored_tuner_hands_back_the_callbacks_it_unpickled(tmp_path):
    """Tune saves the run config with the Tuner (``tuner.pkl``) and ``Tuner.restore`` unpickles
    it, callbacks and all, without Ray started."""
    def trainable(config):
        pass

    tune.Tuner(trainable, run_config=tune.RunConfig(name="sweep", storage_path=str(tmp_path),
                                                    callbacks=[NamedCallback("first")]))
    restored = tune.Tuner.restore(str(tmp_path / "sweep"), trainable=trainable)
    assert [(type(c), c.name) for c in callbacks_of(restored)] == [(NamedCallback, "first")]
