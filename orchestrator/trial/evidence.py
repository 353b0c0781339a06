"""The OOM a trial is recovering from, written down where the driver can read it should the
worker die before the recovery reports (:data:`orchestrator.contract.OOM_EVIDENCE_FILE`), and
the OOM events of a trial that gave up on them, which no report carried
(:data:`~orchestrator.contract.OOM_GAVE_UP_FILE`): in the trial's storage folder
(:func:`orchestrator.ray_internals.trial_storage_folder`)."""

from __future__ import annotations

import contextlib
import json
import os

from orchestrator.atomic_file import atomic_write
from orchestrator.contract import OOM_EVIDENCE_FILE, OOM_GAVE_UP_FILE, OomEvent


def write_oom_evidence(folder: str | None, event: OomEvent) -> None:
    _write(folder, OOM_EVIDENCE_FILE, event.to_dict())


def clear_oom_evidence(folder: str | None) -> None:
    if folder is not None:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, OOM_EVIDENCE_FILE))


def take_oom_evidence(folder: str | None) -> dict | None:
    """The OOM event a dead trial left behind, removed as it is read (a later death needs its own)."""
    event = _read(folder, OOM_EVIDENCE_FILE)
    if event is None:
        return None
    try:
        os.remove(os.path.join(folder, OOM_EVIDENCE_FILE))
    except OSError:
        return None
    return event


def write_gave_up_events(folder: str | None, events: list[OomEvent]) -> None:
    """The OOM events of a trial that gave up on them, for the driver to log (its error's message
    holds them as text, cut to a line in MLflow's tag)."""
    _write(folder, OOM_GAVE_UP_FILE, [e.to_dict() for e in events])


def gave_up_events(folder: str | None) -> list[dict]:
    """The OOM events a trial that gave up on them left in ``folder`` (none where it did not)."""
    events = _read(folder, OOM_GAVE_UP_FILE)
    return events if isinstance(events, list) else []


def _write(folder: str | None, name: str, value) -> None:
    """``value`` as JSON in ``folder``/``name``, whole or not at all; nowhere without a folder, and
    nothing where the storage refuses it (the evidence helps; the trial goes on without it)."""
    if folder is None:
        return
    with contextlib.suppress(OSError):
        os.makedirs(folder, exist_ok=True)
        with atomic_write(os.path.join(folder, name)) as f:
            json.dump(value, f)


def _read(folder: str | None, name: str):
    """What :func:`_write` left in ``folder``/``name``; None where nothing (whole) is there."""
    if not folder:
        return None
    try:
        with open(os.path.join(folder, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
