"""The OOM a trial is recovering from, written down where the driver can read it should the
worker die before the recovery reports (:data:`orchestrator.contract.OOM_EVIDENCE_FILE`), in the
trial's storage folder (:func:`orchestrator.ray_internals.trial_storage_folder`)."""

from __future__ import annotations

import contextlib
import json
import os

from orchestrator.contract import OOM_EVIDENCE_FILE, OomEvent


def write_oom_evidence(folder: str | None, event: OomEvent) -> None:
    if folder is None:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        partial = os.path.join(folder, OOM_EVIDENCE_FILE + ".partial")
        with open(partial, "w") as f:
            json.dump(event.to_dict(), f)
        os.replace(partial, os.path.join(folder, OOM_EVIDENCE_FILE))
    except OSError:
        pass


def clear_oom_evidence(folder: str | None) -> None:
    if folder is not None:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, OOM_EVIDENCE_FILE))


def take_oom_evidence(folder: str | None) -> dict | None:
    """The OOM event a dead trial left behind, removed as it is read (a later death needs its own)."""
    if not folder:
        return None
    path = os.path.join(folder, OOM_EVIDENCE_FILE)
    try:
        with open(path) as f:
            event = json.load(f)
        os.remove(path)
        return event
    except (OSError, ValueError):
        return None
