"""A trial attempt's own copy of its newest checkpoint, in a scratch folder of its own, and when
the trial hands one to Tune.

The attempt keeps only its newest checkpoint here: the state an in-process OOM retry resumes
from without reading storage back, written at every checkpoint of the loop. Tune gets a
checkpoint (a copy on the sweep's storage, which a restarted trial and ``run --resume`` start
from) less often where the cadence is the default, at most every :data:`HAND_OVER_EVERY_S`
(:func:`hand_over_due`). Everything needed to continue exactly where it was is one file
(:data:`orchestrator.contract.STATE_FILE`): the trainer's state (model, optimizer, schedule,
position), the plan in force, the OOM events and shrinks so far, the node and the moves.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

import torch

from orchestrator.atomic_file import atomic_write
from orchestrator.contract import STATE_FILE


#: At the default cadence (a checkpoint at every evaluation), the shortest time between two
#: checkpoints a trial hands to Tune. Each one Tune records costs the driver: with
#: ``checkpoint.keep`` checkpoints per trial, Tune snapshots the whole sweep's state and uploads
#: its folder (every trial's result files) whenever a trial has handed over ``keep`` since the last
#: snapshot, so that no snapshot names a deleted checkpoint. A sweep of one-second trials
#: evaluating every epoch paid one such snapshot per trial, a cost that grows with the trials
#: already run. Ten seconds is Tune's own shortest period between snapshots: a driver killed
#: between two loses about as much either way.
HAND_OVER_EVERY_S = 10.0


def hand_over_due(explicit_cadence: bool, final: bool, since_last_s: float) -> bool:
    """Whether this checkpoint goes to Tune: every one of a cadence the user set
    (``checkpoint.every``), the last of a trial, and otherwise one every :data:`HAND_OVER_EVERY_S`."""
    return explicit_cadence or final or since_last_s >= HAND_OVER_EVERY_S


class LocalCheckpoints:
    """The scratch folder of one attempt of a trial (or of one rank of it), and its newest checkpoint."""

    def __init__(self, name: str):
        self.scratch = fresh_scratch(name)
        self.newest: str | None = None  # folder of the newest checkpoint

    def adopt(self, state_file: str | None = None, *, data: bytes | None = None) -> None:
        """Start from a checkpoint made elsewhere: Tune's copy of one (a path), or its bytes sent
        by rank 0 of a group."""
        folder = tempfile.mkdtemp(prefix="checkpoint-", dir=self.scratch)
        with atomic_write(os.path.join(folder, STATE_FILE), "wb") as f:
            if state_file is not None:
                with open(state_file, "rb") as source:
                    shutil.copyfileobj(source, f)
            else:
                f.write(data)
        self.newest = folder

    def save(self, state: dict) -> str:
        """Write ``state`` as the newest checkpoint; the one before it goes. Its folder, for Tune."""
        folder = tempfile.mkdtemp(prefix="checkpoint-", dir=self.scratch)
        with atomic_write(os.path.join(folder, STATE_FILE), "wb") as f:
            torch.save(state, f)
        if self.newest is not None:
            shutil.rmtree(self.newest, ignore_errors=True)
        self.newest = folder
        return folder

    def load(self, map_location) -> dict:
        return torch.load(os.path.join(self.newest, STATE_FILE), map_location=map_location, weights_only=False)

    def remove(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def fresh_scratch(trial_id: str) -> str:
    """A temporary folder for this attempt of the trial, removed when it ends in any state.

    A worker that was killed could not remove its own; the trial's next attempt on this node
    removes it.
    """
    prefix = f"orchestrator-{trial_id}-"
    for stale in glob.glob(os.path.join(tempfile.gettempdir(), prefix + "*")):
        shutil.rmtree(stale, ignore_errors=True)
    return tempfile.mkdtemp(prefix=prefix)
