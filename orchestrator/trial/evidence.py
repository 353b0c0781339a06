"""The OOM a trial is recovering from, written down where the driver can read it should the
worker die before the recovery reports (:data:`orchestrator.contract.OOM_EVIDENCE_FILE`), in the
trial's storage folder (:func:`orchestrator.ray_internals.trial_storage_folder`)."""

from __future__ import annotations

import contextlib
import json
import os

from orchestrator.atomic_file import atomic_write
from orchestrator.contract import OOM_EVIDENCE_FILE, OomEvent


def write_oom_evidence(folder: str | None, event: OomEvent) -> None:
    if folder is None:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        with atomic_write(os.path.join(folder, OOM_EVIDENCE_FILE)) as f:
            json.dump(event.to_dict(), f)
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
