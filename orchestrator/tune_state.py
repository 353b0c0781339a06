"""Tune's state files in the sweep's folder, kept whole through a storage that fills up, and a
resume's trials rid of the checkpoints that state names but the storage no longer has.

Tune writes its state files (``experiment_state-*.json``, the search's
``basic-variant-state-*.json``, ``callback-states-*.pkl``, ``tuner.pkl``) to a local staging
folder on the driver, then uploads them to the sweep's folder in place: when the storage fills
up mid-upload the file there is left cut off, and ``--resume`` then fails ("Failed to restore
the run state", then every trial ``KeyError: 'workload'``). So after each of Tune's saves the
driver copies the staged files, whole, to :data:`COPIES` in the sweep's folder, atomically
(:class:`KeepWholeState`); a resume first puts back any state file that is cut off or missing
(:func:`restore_cut_off`), and refuses in one line where no whole copy was ever stored.

The copies come from the staging folder rather than the sweep's folder because the upload runs
in the background: the sweep's folder may hold no whole state file yet when the storage fails,
while the staged one is whole from Tune's first save (made at the sweep's first step).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import threading
import time

from ray import tune

from orchestrator.atomic_file import atomic_write
from orchestrator.errors import UserError
from orchestrator.outcome import ENDED_IN_TUNE
from orchestrator.ray_internals import forget_gone_checkpoints, state_folders

COPIES = ".whole_state"  # folder in the sweep's folder
EXPERIMENT_STATE = "experiment_state-*.json"  # the trials' state: what a resume restores
_PATTERNS = (EXPERIMENT_STATE, "basic-variant-state-*.json", "callback-states-*.pkl", "tuner.pkl")
#: How often Tune's event loop looks for a new save: Tune calls ``on_step_end`` many times a
#: second, and a listing and a ``stat`` per state file each time were a tenth of the loop's time in
#: a sweep of short trials; Tune saves at most every 10 s.
LOOK_EVERY_S = 1.0


def whole(path: str) -> bool:
    """Whether a state file reads to its end: a pickle that ends with its STOP opcode, JSON that
    parses. Told apart by content, not name: Tune pickles the search's ``basic-variant-state-*.json``."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return False
    if data[:1] == b"\x80":  # pickle protocol 2 and later start with PROTO
        return data.endswith(b".")
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def _state_files(folder: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(os.path.join(folder, n) for n in names if any(fnmatch.fnmatchcase(n, p) for p in _PATTERNS))


def _version(path: str) -> tuple[int, int]:
    """What tells one write of a state file from the next: its mtime and size."""
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size


def _copy(source: str, destination: str) -> None:
    """``source`` to ``destination``, which is either its old self or the whole copy (``atomic_write``)."""
    with open(source, "rb") as f_in, atomic_write(destination, "wb") as f_out:
        shutil.copyfileobj(f_in, f_out)


def changed(source: str, copied: dict[str, tuple[int, int]]) -> bool:
    """Whether a state file in ``source`` differs from its last copy (``copied``: path -> mtime, size)."""
    for path in _state_files(source):
        try:
            if copied.get(path) != _version(path):
                return True
        except OSError:
            continue
    return False


def keep_whole_copies(source: str, sweep: str, copied: dict[str, tuple[int, int]]) -> None:
    """Copy each state file in ``source`` that changed since (``copied``: path -> mtime, size) and
    reads whole to the sweep's :data:`COPIES`; where the storage refuses, the last copy stays."""
    for path in _state_files(source):
        try:
            version = _version(path)
            if copied.get(path) == version or not whole(path):
                continue
            os.makedirs(os.path.join(sweep, COPIES), exist_ok=True)
            _copy(path, os.path.join(sweep, COPIES, os.path.basename(path)))
            copied[path] = version
        except OSError:
            continue


def restorable(sweep: str) -> bool:
    """Whether ``--resume`` can continue the sweep in this folder: Tune made it (``tuner.pkl``) and
    saved its state at least once (made at its first step, perhaps kept only as a whole copy). A
    sweep stopped before that has no trials to continue: Tune's ``can_restore`` says yes, and its
    restore then runs one trial of no config, which fails (``KeyError: 'workload'``)."""
    if not tune.Tuner.can_restore(sweep):
        return False
    saved = _state_files(sweep) + _state_files(os.path.join(sweep, COPIES))
    return any(fnmatch.fnmatchcase(os.path.basename(p), EXPERIMENT_STATE) for p in saved)


def restore_cut_off(sweep: str) -> list[str]:
    """Put back the last whole copy of each state file that is cut off or missing; the names put
    back. A cut-off file with no whole copy is a :class:`UserError`: Tune cannot resume from it."""
    copies = {os.path.basename(c): c for c in _state_files(os.path.join(sweep, COPIES)) if whole(c)}
    restored = []
    for name in sorted({os.path.basename(p) for p in _state_files(sweep)} | set(copies)):
        path = os.path.join(sweep, name)
        if whole(path):
            continue
        if name not in copies:
            raise UserError(
                f"cannot resume {sweep}: Tune's {name} is cut off (the storage filled up while Tune wrote it?) "
                "and no whole copy of it was kept; run the sweep again without --resume"
            )
        _copy(copies[name], path)
        restored.append(name)
    return restored


class KeepWholeState(tune.Callback):
    """Copies Tune's state files, whole, after each of its saves and at the sweep's end.

    Tune saves them (at most every 10 s, and at the end) just before it calls ``on_step_end``;
    once a second (:data:`LOOK_EVERY_S`) a step looks for a save with a ``stat`` of each staged
    file. The copies themselves (each
    flushed to disk: tens of milliseconds on a busy disk) are made by one thread of the
    callback's own: made in Tune's event loop, they held up every trial waiting for the driver
    to take its report (about as long as Tune's own save took again). A save made while a copy
    runs is copied by the next round; the sweep's end stops the thread and makes the last copy
    itself.
    """

    def __init__(self) -> None:
        self._copied: dict[str, tuple[int, int]] = {}
        self._folders: tuple[str, str | None] | None = None  # Tune's staging folder, the sweep's
        self._copier: threading.Thread | None = None
        self._due = threading.Event()  # something changed since the last copy
        self._ending = False
        self._looked_at = float("-inf")  # time.monotonic() of the last look for a save

    def __getstate__(self) -> dict:
        return {"_copied": {}, "_folders": None, "_copier": None, "_ending": False, "_looked_at": float("-inf")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _due=threading.Event())

    def on_step_end(self, iteration, trials, **info) -> None:
        now = time.monotonic()
        if now - self._looked_at < LOOK_EVERY_S:
            return
        self._looked_at = now
        folders = self._sweep_folders(trials)
        if folders is None or self._due.is_set() or not changed(folders[0], self._copied):
            return
        if self._copier is None:
            self._copier = threading.Thread(target=self._copy_when_due, args=folders, name="keep-whole-state", daemon=True)
            self._copier.start()
        self._due.set()

    def on_experiment_end(self, trials, **info) -> None:
        if self._copier is not None:
            self._ending = True
            self._due.set()
            self._copier.join()
            self._copier = None
        folders = self._sweep_folders(trials)
        if folders is not None:
            keep_whole_copies(*folders, self._copied)

    def _copy_when_due(self, staging: str, sweep: str) -> None:
        while True:
            self._due.wait()
            if self._ending:
                return
            keep_whole_copies(staging, sweep, self._copied)
            self._due.clear()

    def _sweep_folders(self, trials) -> tuple[str, str] | None:
        """Tune's staging folder and the sweep's, or None where there is nothing to copy yet (no
        trial) or nowhere to (a storage the driver cannot write as a path keeps no copies)."""
        if self._folders is None and trials:
            self._folders = state_folders(trials[0])
        if self._folders is None or self._folders[1] is None:
            return None
        return self._folders


class ForgetGoneCheckpoints(tune.Callback):
    """At a driver's first step, each trial that will run again forgets the checkpoints its
    restored state names but the storage no longer has (``ray_internals.forget_gone_checkpoints``):
    those a killed driver deleted after its last save of the sweep's state. Without it the resumed
    Tune deletes them again at the trial's next checkpoint and prints a traceback. A new sweep's
    first step finds no trial with a checkpoint; a resume's looks at its unfinished trials only
    (a finished one registers no checkpoint again), once."""

    def __init__(self) -> None:
        self._looked = False

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._looked = False

    def on_step_begin(self, iteration, trials, **info) -> None:
        if self._looked:
            return
        self._looked = True
        for trial in trials:
            if trial.status not in ENDED_IN_TUNE:
                forget_gone_checkpoints(trial)
