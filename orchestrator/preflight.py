"""Checks a sweep passes before Ray starts: a mistake found here costs a second and one line
(exit 2), not a started cluster, a traceback, and MLflow runs left behind.

The config layer already checked every key and value (``config.py``); these look at what the
config points to. The storage folder must take files. Each workload must have data for one
optimizer step and an eval set (a 0-row dataset otherwise fails deep inside an estimator or a
trial). Each distinct model is built, its large tensors on ``meta`` (``HostOrMeta``, as the
estimators build it), so a constructor with a typo or a library that is not installed stops the
sweep here, in one line naming the user's file and line, before Ray's first line, and also under
``memory.estimator: none`` or ``measured`` (the driver's estimates, which overlap Ray's start,
would find it only after Ray started). Memory-neutral hyper-parameters (``lr``, ``seed``) are
left out, so a sweep over learning rates reads each workload's data and builds its model once.
"""

from __future__ import annotations

import inspect
import json
import numbers
import os
from pathlib import Path
from typing import Any

from orchestrator.config import SweepSpec
from orchestrator.errors import UserError
from orchestrator.writable import check_folder, outermost_missing, take_a_file

#: Hyper-parameters that change neither a workload's data nor its model.
CHECK_NEUTRAL = ("lr", "seed")


def check_storage(path: str) -> None:
    """The storage folder exists (or can be made) and takes a file."""
    check_folder(path, "storage_path", "pass --storage-path with a folder you can write")


def check_new_database(database: Path) -> None:
    """A SQLite tracking store that does not exist yet is made by the sweep's first write, after
    every check that can refuse the sweep (asking MLflow now would create its tables in the user's
    folder for a sweep that may still be refused). What can go wrong with it is found here: MLflow
    makes the missing folders, so the nearest existing one must take a file."""
    folder = outermost_missing(database).parent
    try:
        take_a_file(folder)
    except OSError as exc:
        raise UserError(
            f"tracking_uri: cannot create the MLflow database {database} ({folder}: {exc.strerror or exc}); "
            "point tracking_uri (or --tracking-uri) at a folder you can write"
        ) from None


def check_shared_storage(given: str, resolved: str, nodes: int) -> None:
    """On a cluster of several nodes, checkpoints must be where every node reads them: a trial
    restarted on another node (its node lost) resumes from the storage path, not from the disk
    of the node it left.

    From one machine we cannot see which mounts other machines share, so the rule refuses what
    is node-local for certain and trusts an absolute path to be a shared mount (NFS, Lustre, ...)
    at the same path on every node, as the README asks. A relative path is node-local for
    certain: it resolves in the driver's working directory on the head, which in a Ray Job
    (``run --address``) is a temporary copy of the project there. The default
    (``./orchestrator_results``) is relative, so a cluster of several nodes needs the flag.
    """
    if nodes > 1 and not os.path.isabs(given):
        raise UserError(
            f"storage_path: {given!r} is relative (here {resolved}, on the head node only), and this cluster has "
            f"{nodes} nodes whose trials resume from checkpoints on any node; pass --storage-path with an absolute "
            "path on storage every node mounts (NFS)"
        )


def check_workloads(spec: SweepSpec, build_models: bool = True) -> None:
    """:func:`check_workload` for every distinct trial config of the sweep (grids expanded, random
    parameters sampled, ``lr`` and ``seed`` left out). ``build_models=False``: the data only, for
    ``plan``, which shows a model that does not build here (its library is installed only where
    the trials run, say) as that trial's error and plans the others."""
    from trainables.workload import build_workload

    for config in distinct_configs(spec):
        label = _label(config, spec)
        workload = _call(lambda: build_workload(config), label, "its constructor")  # a dataclass's __post_init__, say
        check_workload(workload, spec, label, build_model=build_models)


def distinct_configs(spec: SweepSpec) -> list[dict[str, Any]]:
    """The sweep's trial configs that may build different data or models: one per distinct
    value of everything but ``lr`` and ``seed``."""
    from orchestrator.space import trial_configs

    seen, configs = set(), []
    for config in trial_configs(spec):
        key = json.dumps({k: v for k, v in sorted(config.items()) if k not in CHECK_NEUTRAL}, default=str)
        if key not in seen:
            seen.add(key)
            configs.append(config)
    return configs


def check_workload(workload, spec: SweepSpec, label: str, build_model: bool = True) -> None:
    """The workload's model builds, its training set holds one optimizer step, its eval set a
    sample, and its ``collate`` makes a batch of two of each (a bug there would otherwise show in
    every trial, after Ray started, or not at all before a sweep with ``memory.estimator: none``)."""
    from trainables.data import whole_steps

    if build_model:
        check_model_builds(workload, label)
    schedule = _call(workload.activation_schedule, label, "activation_schedule()")
    early = {name: epoch for name, epoch in schedule.items() if not isinstance(epoch, numbers.Integral) or epoch < 0}
    if early:
        raise UserError(f"{label}: activation_schedule(): {', '.join(f'{n} at {e!r}' for n, e in early.items())}; "
                        "expected the epoch each module switches on, counted from 0 (0: from the start)")
    train = _call(workload.train_data, label, "train_data()")
    samples = _call(lambda: len(train), label, "len(train_data())")
    if samples < spec.effective_batch_size:
        raise UserError(
            f"{label}: train_data has {samples} samples, fewer than one optimizer step "
            f"(effective_batch_size {spec.effective_batch_size})"
        )
    _check_first_rung_reached(spec, whole_steps(samples, spec.effective_batch_size), label)
    evaluation = _call(workload.eval_data, label, "eval_data()")
    size = _call(lambda: len(evaluation), label, "len(eval_data())")
    if size == 0:
        raise UserError(f"{label}: eval_data has no samples")
    for name, dataset, count in (("train_data", train, samples), ("eval_data", evaluation, size)):
        pair = _call(lambda: [dataset[0], dataset[min(1, count - 1)]], label, f"{name}()[0]")
        _call(lambda: workload.collate(pair), label, f"collate() of two {name} samples")
    if workload.stateful:
        _check_stateful(workload, spec, label)


def _check_first_rung_reached(spec: SweepSpec, steps_per_epoch: int, label: str) -> None:
    """With a budget in both epochs and steps, ASHA's rungs count one unit while the other may end
    the trials first: a first rung past that end is never reached, and ASHA stops no trial. The
    config alone cannot tell (an epoch's steps are the data's), so it is checked here."""
    stop, scheduler = spec.stop, spec.scheduler
    if scheduler.type != "asha" or stop.epochs is None or stop.steps is None:
        return
    last_step = stop.last_step(steps_per_epoch)
    reached = last_step if scheduler.time_attr == "step" else last_step // steps_per_epoch
    if scheduler.grace_period > reached:
        unit = scheduler.time_attr
        expected = (f"expected at most {reached}" if reached else
                    f"expected stop.steps of at least {scheduler.grace_period * steps_per_epoch}")
        raise UserError(
            f"{label}: scheduler.grace_period: the trials stop at step {last_step} ({steps_per_epoch} steps an epoch, "
            f"stop: {{epochs: {stop.epochs}, steps: {stop.steps}}}), before ASHA's first rung at {unit} "
            f"{scheduler.grace_period}, so ASHA would stop no trial; {expected}"
        )


#: Two row counts no other dimension of a state can equal both of: an LSTM's state of 2 layers
#: has 2 rows along its layer dimension too, so a wrong ``state_dim`` passes a check at 2 alone.
STATE_ROWS = (2, 3)


def _check_stateful(workload, spec: SweepSpec, label: str) -> None:
    """A stateful workload (truncated BPTT) trains in one process, and its ``initial_state`` has
    one row per stream along its ``state_dim``."""
    from trainables.carry import Carry

    if spec.resources.workers > 1:
        raise UserError(f"{label}: resources.workers: a stateful workload (truncated BPTT) trains in one process; "
                        f"expected 1, got {spec.resources.workers}")
    if not _takes(workload.loss, 3):
        raise UserError(f"{label}: {type(workload).__name__} is stateful: its loss takes (model, batch, state) and "
                        f"returns (loss, new_state); it is defined as loss{inspect.signature(workload.loss)}")
    for rows in STATE_ROWS:
        state = _call(lambda: workload.initial_state(rows), label, f"initial_state({rows})")
        _call(lambda: Carry(state, workload.state_dim).check(rows, "its state"), label, f"initial_state({rows})")


def _takes(function, arguments: int) -> bool:
    """Whether ``function`` takes ``arguments`` positional arguments; True where inspect cannot
    read it (a builtin): calling it tells."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*[None] * arguments)
    except TypeError:
        return False
    return True


def check_model_builds(workload, label: str) -> None:
    """``build_model()`` runs, its large tensors on ``meta``: seconds and no memory even for a
    model of billions of parameters. An error of the ``meta`` device itself (a constructor that
    reads a large tensor's values) is not the user's mistake: the estimators say what they make of
    such a model, and its trials build it for real."""
    from orchestrator.memory.construction import HostOrMeta

    try:
        with HostOrMeta():
            workload.build_model()
    except Exception as exc:  # noqa: BLE001 - the user's code: one line naming where it failed
        if _is_meta_limitation(exc):
            return
        _refuse(exc, label, "build_model()")


def _is_meta_limitation(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's refusal to compute on a ``meta`` tensor, not a bug of the model."""
    return isinstance(exc, (RuntimeError, NotImplementedError)) and "meta" in str(exc).lower()


def _call(function, label: str, what: str) -> Any:
    try:
        return function()
    except Exception as exc:  # noqa: BLE001 - the user's code: one line naming where it failed
        _refuse(exc, label, what)


def _refuse(exc: BaseException, label: str, what: str):
    from trainables.workload import failure_line, install_advice

    raise UserError(f"{label}: {what} failed ({failure_line(exc)}){install_advice(exc)}") from None


def _label(config: dict[str, Any], spec: SweepSpec) -> str:
    """``workload mlp (width=16)``: the workload and the searched values that picked this trial."""
    shown = {k: v for k, v in config.items() if k in spec.search_space and k not in CHECK_NEUTRAL and k != "workload"}
    values = ", ".join(f"{k}={v}" for k, v in shown.items())
    return f"workload {config['workload']}" + (f" ({values})" if values else "")
