"""Tune's state files in the sweep's folder, kept whole through a storage that fills up.

Tune rewrites its state files in the sweep's folder in place (``experiment_state-*.json``, the
search's ``basic-variant-state-*.json``, ``callback-states-*.pkl``, ``tuner.pkl``): when the
storage fills up mid-write the file is left cut off, and ``--resume`` then fails ("Failed to
restore the run state", then every trial ``KeyError: 'workload'``). So the driver keeps the last
whole copy of each (:class:`KeepWholeState`, written atomically beside them, in
:data:`COPIES`), and a resume first puts back any that is cut off (:func:`restore_cut_off`).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time

from ray import tune

from orchestrator.atomic_file import atomic_write

COPIES = ".whole_state"  # folder in the sweep's folder
_PATTERNS = ("experiment_state-*.json", "basic-variant-state-*.json", "callback-states-*.pkl", "tuner.pkl")
#: How often the driver looks for state files Tune rewrote (seconds).
LOOK_EVERY_S = 5.0


def whole(path: str) -> bool:
    """Whether a state file reads to its end: JSON that parses, a pickle that ends with its STOP."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return False
    if path.endswith(".json"):
        try:
            json.loads(data)
        except ValueError:
            return False
        return True
    return data.endswith(b".")


def _state_files(sweep: str) -> list[str]:
    return sorted(f for pattern in _PATTERNS for f in glob.glob(os.path.join(sweep, pattern)))


def keep_whole_copies(sweep: str, copied: dict[str, int]) -> None:
    """Copy each state file that changed since (``copied``: path -> mtime) and reads whole."""
    for path in _state_files(sweep):
        try:
            mtime = os.stat(path).st_mtime_ns
            if copied.get(path) == mtime or not whole(path):
                continue
            os.makedirs(os.path.join(sweep, COPIES), exist_ok=True)
            with open(path, "rb") as source, atomic_write(os.path.join(sweep, COPIES, os.path.basename(path)), "wb") as f:
                shutil.copyfileobj(source, f)
            copied[path] = mtime
        except OSError:  # the storage refuses: the last whole copy stays
            continue


def restore_cut_off(sweep: str) -> list[str]:
    """Put back the last whole copy of each state file that is cut off; the names put back."""
    restored = []
    for path in _state_files(sweep):
        copy = os.path.join(sweep, COPIES, os.path.basename(path))
        if not whole(path) and whole(copy):
            with open(copy, "rb") as source, atomic_write(path, "wb") as f:
                shutil.copyfileobj(source, f)
            restored.append(os.path.basename(path))
    return restored


class KeepWholeState(tune.Callback):
    """Keeps the last whole copy of Tune's state files while the sweep runs, and at its end."""

    def __init__(self) -> None:
        self._copied: dict[str, int] = {}
        self._next = 0.0

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_copied": {}, "_next": 0.0}

    def on_step_end(self, iteration, trials, **info) -> None:
        now = time.monotonic()
        if now >= self._next and trials:
            self._next = now + LOOK_EVERY_S
            keep_whole_copies(os.path.dirname(str(trials[0].path)), self._copied)

    def on_experiment_end(self, trials, **info) -> None:
        if trials:
            keep_whole_copies(os.path.dirname(str(trials[0].path)), self._copied)
