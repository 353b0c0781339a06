"""Every private Ray API this project uses, and nothing else: the one place to look when Ray is
upgraded.

Private here means Ray's underscored modules and attributes, and the objects Ray hands out from
its ``_internal`` packages. Every other module reaches them through this one, and
``tests/test_ray_internals.py`` checks each against the installed Ray without starting it, naming
what changed; ``pyproject.toml`` pins Ray to the minor series that test passed on.

* :func:`auth_token_loader`: ``ray._raylet.AuthenticationTokenLoader``, Ray's own lookup of the
  cluster's token, for the dashboard and the job client (``orchestrator.dashboard``).
* :func:`trial_storage_folder`: Tune's ``StorageContext`` (``ray.train._internal.storage``), where
  a trial writes the OOM it is recovering from so the driver can read it should the worker die
  (``orchestrator.trial.evidence``); :func:`state_folders`: the same context's staging and
  storage folders of the sweep, whose state files the driver keeps whole copies of
  (``orchestrator.tune_state``).
* :func:`make_last_failure`: ``Trial.run_metadata.num_failures``, which the OOM-aware scheduler
  raises so that a failure it will not retry is the trial's last (``orchestrator.retry``).
* :func:`make_next_failure_last`: ``Trial.max_failures`` lowered to ``run_metadata.num_failures``,
  so that ``Trial.should_recover()`` is false for the failure a trial announced (a data error,
  ``orchestrator.retry``): Tune handles a trial's results before its error.
* :func:`forget_running_statistics`: ``Trial.run_metadata.metric_analysis`` and ``metric_n_steps``,
  Tune's running max/min/averages of every number a trial reported, which the driver holds for
  every trial of the sweep (``orchestrator.driver_memory``).
* :data:`TOKEN_NOTICE_LOGGER`: the logger of ``ray._private.authentication``'s set-up, which
  tells every new local cluster that token authentication is on (as it always is for one) and how
  to opt out; ``run`` holds it to errors unless ``--verbose`` (``orchestrator.console``).
* :func:`ray_processes_in_group`: ``ray._private.services.ConsolePopen``, the class every process
  of a local Ray (GCS, raylet, dashboard, log monitor) is started with, so that they start in a
  process group other than the driver's (``orchestrator.ray_group``).
* :func:`callbacks_of`: ``Tuner._local_tuner.get_run_config()``, the run config a restored
  ``Tuner`` unpickled with its callbacks, whose MLflow store a resume may point elsewhere
  (``orchestrator.runner``).
* :data:`LOCAL_RAY_SYSTEM_CONFIG`: the raylet settings (``ray.init(_system_config=...)``) of the
  Ray a sweep starts itself (``orchestrator.runner``; a SLURM job's head, ``--system-config``
  in ``slurm/sweep.sbatch.tmpl``); Ray's GCS does not start with a key it
  does not know, so a renamed one fails every local sweep, and the suite with it.
* :func:`shut_down_local_ray`: ``ray._private.worker._global_node.kill_monitor``, the autoscaler
  monitor of the Ray a sweep started, stopped before ``ray.shutdown`` stops the rest: Ray stops it
  after its GCS, and its SIGTERM handler then waits on that GCS to report the monitor's own death
  until Ray kills it a second later, at the end of every command that started a Ray.
* :func:`metrics_export_interval_s`: ``ray._config.metrics_report_interval_ms()``, how often a
  Ray process exports the metrics it recorded, which a driver that counted OOMs waits out before
  it exits (``orchestrator.oom_counter``).

The retry also relies on Tune's failure path calling ``TrialScheduler.on_trial_error`` after Tune
decided to retry and before it requeues the trial, with ``Trial.error_file`` and
``Trial.pickled_error_file`` written and ``Trial.set_config`` reaching the restart (DeveloperAPI:
public, but without a stability promise); the same test drives that path.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


TOKEN_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"

#: A new local Ray prestarts an idle worker process per CPU for its first driver, which none of a
#: sweep's trials runs in: Tune gives every trial actor a runtime environment (``PL_DISABLE_FORK``,
#: for Lightning), Ray prestarts workers only for an empty one, and a data-parallel trial's ranks
#: inherit the trial's. They took CPU as the sweep started (0.6 s for the demo's two), and each
#: held ~100 MiB of host memory for the whole sweep, memory ``run``'s host plan counted as available
#: (bench/RESULTS.md, "Tune's trials do not start in the workers Ray prestarts").
LOCAL_RAY_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


class RayChanged(RuntimeError):
    """A Ray internal this project relies on is not what it was: the installed Ray is outside the
    range ``pyproject.toml`` allows, or that range is wrong."""


def auth_token_loader() -> Any:
    """Ray's token loader (``reset_cache``, ``get_token_for_http_header``, ``has_token``)."""
    from ray._raylet import AuthenticationTokenLoader

    return AuthenticationTokenLoader.instance()


def trial_storage_folder() -> str | None:
    """This trial's folder on the storage path, from inside the trial; None outside a Tune trial
    (a data-parallel group's other ranks, a test). See :func:`storage_folder`."""
    from ray import tune

    storage = tune.get_context().get_storage()  # None outside a trial (Ray warns)
    return None if storage is None else storage_folder(storage)


def storage_folder(storage: Any) -> str | None:
    """A Tune ``StorageContext``'s trial folder; None where the storage is not a local (or
    shared) filesystem path the driver can read too. Raises :class:`RayChanged` where the
    context is no longer what this reads, rather than quietly writing no OOM evidence."""
    return _local_path(storage, "trial_fs_path", "a trial cannot write down the OOM it recovers from")


def state_folders(trial: Any) -> tuple[str, str | None]:
    """Where Tune writes the sweep's state files: first to the driver's local staging folder
    (``StorageContext.experiment_driver_staging_path``, whole once written), then uploaded, in
    place and not atomically, to the sweep's folder on the storage path (None where that is not a
    local or shared filesystem path)."""
    why = "the driver cannot keep whole copies of Tune's state files"
    try:
        staging = trial.storage.experiment_driver_staging_path
    except AttributeError as exc:
        raise RayChanged(f"Ray changed: Tune's Trial.storage has no {exc.name!r}, so {why} (orchestrator/ray_internals.py)") from exc
    return staging, _local_path(trial.storage, "experiment_fs_path", why)


def _local_path(storage: Any, attribute: str, why: str) -> str | None:
    import pyarrow.fs

    try:
        filesystem, path = storage.storage_filesystem, getattr(storage, attribute)
    except AttributeError as exc:
        raise RayChanged(f"Ray changed: Tune's StorageContext has no {exc.name!r}, so {why} (orchestrator/ray_internals.py)") from exc
    if not isinstance(filesystem, pyarrow.fs.LocalFileSystem):
        return None
    return path


def make_last_failure(trial: Any) -> None:
    """Counts the trial's failures up to its ``max_failures``: Tune restarts it once more (it
    decided before the scheduler's hook ran), and that restart's failure is its last."""
    try:
        metadata = trial.run_metadata
        metadata.num_failures = max(trial.max_failures, metadata.num_failures)
    except AttributeError as exc:
        raise RayChanged(
            f"Ray changed: Tune's Trial has no {exc.name!r}, so a failure that is not retried cannot be made "
            "the trial's last (orchestrator/ray_internals.py)"
        ) from exc


def make_next_failure_last(trial: Any) -> None:
    """Lowers the trial's retry budget to the failures it has had: Tune does not restart it after
    its next failure (``Trial.should_recover()``: ``num_failures <= max_failures``)."""
    try:
        trial.max_failures = trial.run_metadata.num_failures
    except AttributeError as exc:
        raise RayChanged(
            f"Ray changed: Tune's Trial has no {exc.name!r}, so a failure that is not retried cannot be made "
            "the trial's last (orchestrator/ray_internals.py)"
        ) from exc


def forget_running_statistics(trial: Any, keep: str) -> None:
    """Drops Tune's running statistics of an ended trial's numbers (max, min, average, last-5 and
    last-10 averages of each, with the deques behind them: about 1.5 KB per number per trial,
    plus their copy in the trial's cached JSON state), except those of the metric ``keep``, which
    ``ResultGrid.get_best_result`` reads. The trial's last result stays."""
    try:
        metadata = trial.run_metadata
        metadata.metric_analysis = {k: v for k, v in metadata.metric_analysis.items() if k == keep}
        metadata.metric_n_steps = {k: v for k, v in metadata.metric_n_steps.items() if k == keep}
    except AttributeError as exc:
        raise RayChanged(
            f"Ray changed: Tune's Trial has no {exc.name!r}, so an ended trial's running statistics cannot be "
            "dropped (orchestrator/ray_internals.py)"
        ) from exc


def forget_gone_checkpoints(trial: Any) -> int:
    """Drops, from the checkpoints Tune keeps for ``trial`` (``checkpoint.keep``), those whose
    folder is gone from the storage, and returns how many it dropped. Tune deletes a checkpoint
    past ``keep`` as it registers the next one, and saves the sweep's state after: a driver
    killed between the two leaves a state that names the deleted one, and the resumed Tune
    deletes it again at the trial's next checkpoint, logging ``FileNotFoundError`` with a
    traceback. The latest is kept whatever: it is the one the trial resumes from."""
    import pyarrow.fs

    try:
        manager = trial.run_metadata.checkpoint_manager
        kept, latest = manager._checkpoint_results, manager._latest_checkpoint_result
        resumes_from = latest.checkpoint.path if latest is not None else None
        gone = [r for r in kept if r.checkpoint.path != resumes_from
                and r.checkpoint.filesystem.get_file_info(r.checkpoint.path).type == pyarrow.fs.FileType.NotFound]
        if gone:
            manager._checkpoint_results = [r for r in kept if r not in gone]
            trial.invalidate_json_state()
    except AttributeError as exc:
        raise RayChanged(
            f"Ray changed: Tune's checkpoint bookkeeping has no {exc.name!r}, so the checkpoints a killed driver "
            "deleted cannot be dropped from a resumed trial's (orchestrator/ray_internals.py)"
        ) from exc
    return len(gone)


@contextmanager
def ray_processes_in_group(group: int) -> Iterator[None]:
    """Within the block, the processes a local ``ray.init`` starts (and so the workers and agents
    their raylet starts) join the process group ``group`` (``orchestrator.ray_group``: why)."""
    from ray._private import services

    original = getattr(services, "ConsolePopen", None)
    if not (isinstance(original, type) and issubclass(original, subprocess.Popen)):
        raise RayChanged("Ray changed: ray._private.services has no ConsolePopen class, so the local Ray's processes "
                         "cannot be kept out of the driver's process group (orchestrator/ray_internals.py)")

    class InGroupPopen(original):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("process_group", group)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = InGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = original


def shut_down_local_ray() -> None:
    """``ray.shutdown()`` of a Ray this process started, a second sooner.

    ``ray.shutdown`` stops the local Ray's processes one by one, each given a second to exit on
    SIGTERM: the autoscaler monitor comes after the GCS, and its handler for SIGTERM tries to tell
    the GCS (gone by then) that the autoscaler failed, so it is killed only when that second is up
    (the demo sweep's command: 1.0 s of its 1.4 s shutdown). Killed first, while everything else
    is up, it has nothing to report; on a node that has no monitor (a driver of a cluster's) this
    does what ``ray.shutdown`` does."""
    import ray
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    if node is not None and node.is_head():
        try:
            node.kill_monitor(check_alive=False)
        except AttributeError as exc:
            raise RayChanged(
                f"Ray changed: its Node has no {exc.name!r}, so the autoscaler monitor of the Ray a sweep started "
                "cannot be stopped before the rest (orchestrator/ray_internals.py)"
            ) from exc
    ray.shutdown()


def metrics_export_interval_s() -> float:
    """How often a Ray process exports its metrics: ``metrics_report_interval_ms``, which Ray
    floors at one second (``SetReportInterval`` in ``src/ray/stats/stats.h``)."""
    import ray

    try:
        interval_ms = ray._config.metrics_report_interval_ms()
    except AttributeError as exc:
        raise RayChanged(
            f"Ray changed: ray._config has no {exc.name!r}, so the driver cannot tell how long its last OOM "
            "count takes to be exported (orchestrator/ray_internals.py)"
        ) from exc
    return max(interval_ms, 1000) / 1000


def callbacks_of(tuner: Any) -> list:
    """The callbacks ``tuner`` runs with: for a restored one, those Tune unpickled from the sweep's
    folder (``Tuner.restore`` takes no run config to replace them)."""
    try:
        return list(tuner._local_tuner.get_run_config().callbacks or [])
    except AttributeError as exc:
        raise RayChanged(
            f"Ray changed: Tune's Tuner has no {exc.name!r}, so a resumed sweep's MLflow store cannot be "
            "pointed where the resume names it (orchestrator/ray_internals.py)"
        ) from exc
