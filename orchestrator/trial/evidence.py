"""The OOM a trial is recovering from, written down where the driver can read it should the
worker die before the recovery reports (:data:`orchestrator.contract.OOM_EVIDENCE_FILE`), in the
trial's storage folder (:func:`orchestrator.ray_internals.trial_storage_folder`)."""

from __future__ import annotations

import contextlib
import json
import os

from orchestrator.atomic_file import atomic_write
from orchestrator.contract import OOM_EVIDENCE_FILE, OOM_GAVE_UP_FILE, OomEvent


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


def write_gave_up_events(folder: str | None, events: list[OomEvent]) -> None:
    """The OOM events of a trial that gave up on them, for the driver to log (its error's message
    holds them as text, cut to a line in MLflow's tag)."""
    if folder is None:
        return
    with contextlib.suppress(OSError):
        os.makedirs(folder, exist_ok=True)
        with atomic_write(os.path.join(folder, OOM_GAVE_UP_FILE)) as f:
            json.dump([e.to_dict() for e in events], f)


def gave_up_events(folder: str | None) -> list[dict]:
    """The OOM events a trial that gave up on them left in ``folder`` (none where it did not)."""
    if not folder:
        return []
    try:
        with open(os.path.join(folder, OOM_GAVE_UP_FILE)) as f:
            events = json.load(f)
    except (OSError, ValueError):
        return []
    return events if isinstance(events, list) else []
