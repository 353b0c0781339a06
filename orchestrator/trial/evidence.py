"""The OOM a trial is recovering from, written down where the driver can read it should the
worker die before the recovery reports (:data:`orchestrator.contract.OOM_EVIDENCE_FILE`)."""

from __future__ import annotations

import contextlib
import json
import os

from orchestrator.contract import OOM_EVIDENCE_FILE, OomEvent


def storage_trial_folder() -> str | None:
    """This trial's folder on the storage path, from inside the trial; None where it is not a
    local (or shared) filesystem path the driver can read too."""
    import pyarrow.fs
    from ray import tune

    try:
        storage = tune.get_context().get_storage()
        if not isinstance(storage.storage_filesystem, pyarrow.fs.LocalFileSystem):
            return None
        return storage.trial_fs_path
    except Exception:  # noqa: BLE001 - evidence is best effort: without it a death keeps its plan
        return None


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
