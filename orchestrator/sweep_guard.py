"""A sweep's folder is run by one driver at a time, and resumed with the config it started with.

Two ``run --name same`` would otherwise both write one Tune experiment: the second replaces the
first's state, its MLflow runs stay ``RUNNING`` for ever, and a later ``--resume`` finishes
whichever wrote last. And a ``--resume`` whose config differs would train the stored sweep
(Tune restores its own search space, scheduler and callbacks) with parts of the new config,
without a word. So the driver claims the folder (:func:`claim_sweep`) before Ray starts:

- an exclusive ``flock`` on :data:`LOCK_FILE` in it, held until the driver ends. The kernel
  releases it when the process dies however it dies, so a killed driver never blocks the
  ``--resume`` that continues its sweep;
- on a resume, the config compared with the one the sweep was started with
  (:data:`CONFIG_FILE`, written by :meth:`SweepClaim.record` when it starts). A difference in
  any key but :data:`RESUMABLE_KEYS` is refused, naming the keys, unless the user says
  ``--allow-config-change``;
- a new sweep (no ``--resume``) in a folder a sweep already started in is refused: Tune would
  write the second sweep's trials and state beside the first's, and a later ``--resume`` would
  restore whichever state file is newest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

from orchestrator import file_lock
from orchestrator.atomic_file import atomic_write
from orchestrator.config import SweepSpec
from orchestrator.errors import UserError

LOCK_FILE = ".driver.lock"  # held by the driver running the sweep; holds its pid
CONFIG_FILE = "sweep_config.json"  # the validated config the sweep runs with, key path -> value

#: Keys a resume may change without --allow-config-change: where the sweep lives (a resume finds
#: the sweep there; a moved storage folder is still the same sweep). Everything else either
#: changes what the unfinished trials train (they get the new config, the finished ones keep the
#: old: the budget, the model, the data, the memory policy), or is stored by Tune and restored
#: as it was (the search space, the scheduler, MLflow's settings), so a change would be ignored.
RESUMABLE_KEYS = frozenset({"storage_path"})
#: Kept beside the config: the MLflow store the sweep writes to as the driver resolved it (the
#: flag's or the config's, a relative SQLite path made absolute), where a resume that names none
#: writes too (``runner.resolve_tracking_uri``). Not a config key, so never compared.
TRACKING_STORE = "tracking_store"

#: The spec's fields as they are written in YAML where the two differ.
_YAML_NAMES = {"workload": "workload.name", "params": "workload.params"}


def config_values(spec: SweepSpec) -> dict[str, Any]:
    """The validated config as key paths (``workload.params.depth``) and JSON values: defaults
    filled in, so a key written out with its default value is no change."""
    plain = json.loads(json.dumps(
        {_YAML_NAMES.get(f.name, f.name): _as_plain(getattr(spec, f.name))
         for f in dataclasses.fields(spec) if f.name not in ("source", "raw")},
        default=str,
    ))
    values: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            values[prefix] = value

    walk("", plain)
    return values


def _as_plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def changed_keys(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The key paths whose values differ, a key only one side has included; sorted."""
    return sorted(k for k in stored.keys() | current.keys() if stored.get(k, _MISSING) != current.get(k, _MISSING))


_MISSING = object()


@dataclass
class SweepClaim:
    """This driver's hold on a sweep's folder; :meth:`release` gives it back (the kernel does,
    should the driver die first)."""

    folder: str
    fd: int | None
    made_folder: bool

    def record(self, spec: SweepSpec, tracking_store: str) -> None:
        """Keep the config the sweep now runs with, for the next ``--resume`` to compare, and the
        MLflow store it writes to, for the next ``--resume`` to write to."""
        path = os.path.join(self.folder, CONFIG_FILE)
        try:
            with atomic_write(path) as f:
                json.dump({**config_values(spec), TRACKING_STORE: tracking_store}, f, indent=1, sort_keys=True)
        except OSError as exc:
            raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None

    def release(self, refused: bool = False) -> None:
        """Give the folder back. ``refused``: the sweep never started, so a folder this claim made
        goes again, with what this driver wrote in it (its config, Tune's ``tuner.pkl``): a
        refused sweep leaves nothing behind."""
        if self.fd is None:
            return
        file_lock.give_back(os.path.join(self.folder, LOCK_FILE), self.fd)
        self.fd = None
        if refused and self.made_folder:
            shutil.rmtree(self.folder, ignore_errors=True)


def claim_sweep(folder: str, spec: SweepSpec, *, resuming: bool, new: bool = False,
                allow_config_change: bool = False, named: bool = True) -> SweepClaim:
    """Claim ``folder`` for this driver, or refuse in one line: another driver runs it, (when
    ``resuming``) the config differs from the stored one in a key a resume may not change, or
    (when ``new``: the user did not ask to resume) a sweep already started there. A ``--resume``
    that finds nothing Tune can restore starts the sweep again in its folder (neither flag): a
    SLURM job's attempt that ended before Tune saved any state is retried that way.

    ``named=False``: the folder's name is the driver's own (the experiment and the second it
    started), not one the user gave, so a folder that is there already is no refusal: the claim
    makes the first of ``folder_2``, ``folder_3``, ... that is not (sweeps started together in a
    shell loop, or a SLURM job array, start within one second)."""
    try:
        if named:
            made_folder = not os.path.isdir(folder)
            os.makedirs(folder, exist_ok=True)
        else:
            folder, made_folder = _new_folder(folder), True
        fd = _locked(os.path.join(folder, LOCK_FILE))
    except OSError as exc:
        raise UserError(f"cannot lock the sweep folder {folder}: {exc.strerror or exc}") from None
    claim = SweepClaim(folder, fd, made_folder)
    try:
        if new and os.path.exists(os.path.join(folder, CONFIG_FILE)):
            raise UserError(
                f"sweep {folder} already exists; continue it with --resume, or start a new sweep with another --name"
            )
        if resuming:
            _check_config(folder, spec, allow_config_change)
    except BaseException:
        claim.release(refused=True)
        raise
    return claim


def _new_folder(folder: str) -> str:
    """``folder``, or the first of ``folder_2``, ``folder_3``, ... not there yet, made (``mkdir``
    makes it for one process only, where two ask at once)."""
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    candidate, number = folder, 1
    while True:
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            number += 1
            candidate = f"{folder}_{number}"


def _locked(path: str) -> int:
    """An open descriptor of ``path`` holding its exclusive lock (``file_lock``), with this
    driver's pid in it; or the refusal, naming the driver that holds it."""
    fd = file_lock.take(path, wait=False)
    if fd is None:
        holder = _holder(path)
        raise UserError(
            f"sweep {os.path.dirname(path)} is already running (driver{' pid ' + holder if holder else ''}); "
            f"wait for it to end, or stop it and continue it with --resume; "
            f"a new sweep needs another --name"
        )
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _holder(path: str) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return f.read(32).strip()
    return ""


def sweeps_of(storage: str, experiment: str) -> list[str]:
    """The sweep folders under ``storage`` of ``experiment``: those ``run`` named for it, and those
    a ``--name`` named whose recorded config is of it."""
    found = []
    for entry in os.scandir(storage) if os.path.isdir(storage) else ():
        if entry.is_dir() and (entry.name.startswith(f"{experiment}_") or _experiment_of(entry.path) == experiment):
            found.append(entry.path)
    return found


def _experiment_of(folder: str) -> str | None:
    with contextlib.suppress(UserError):
        return (_recorded(folder) or {}).get("experiment")
    return None


def running(folder: str) -> bool:
    """Whether a driver runs the sweep in ``folder`` now: it holds the folder's lock."""
    return file_lock.held_elsewhere(os.path.join(folder, LOCK_FILE))


def recorded_tracking_store(folder: str) -> str | None:
    """The MLflow store the sweep in ``folder`` writes to, None where it recorded none (a sweep
    started before stores were kept)."""
    return (_recorded(folder) or {}).get(TRACKING_STORE)


def _recorded(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, CONFIG_FILE)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the config {folder} was started with ({CONFIG_FILE}: {exc})") from None


def _check_config(folder: str, spec: SweepSpec, allow_config_change: bool) -> None:
    stored = _recorded(folder)
    if stored is None:
        return  # a sweep started before its config was kept: nothing to compare with
    stored.pop(TRACKING_STORE, None)
    current = config_values(spec)
    changed = [k for k in changed_keys(stored, current) if k not in RESUMABLE_KEYS]
    if not changed:
        return
    described = ", ".join(f"{k} ({_shown(stored, k)} -> {_shown(current, k)})" for k in changed)
    if allow_config_change:
        print(f"Resuming with a changed config (--allow-config-change): {described}; the trials that did not "
              f"finish continue with it, the search space, scheduler and finished trials stay as stored", flush=True)
        return
    raise UserError(
        f"--resume: the config differs from the one {folder} was started with in {described}; "
        f"resume with the same config, start a new sweep (another --name), or pass --allow-config-change"
    )


def _shown(values: dict[str, Any], key: str) -> str:
    return json.dumps(values[key]) if key in values else "unset"
