"""A trial attempt's own copy of its newest checkpoint, in a scratch folder of its own, and when
the trial hands one to Tune.

The attempt keeps only its newest checkpoint here: the state an in-process OOM retry resumes
from without reading storage back, written at every checkpoint of the loop. Tune gets a
checkpoint (a copy on the sweep's storage, which a restarted trial and ``run --resume`` start
from) less often where the cadence is the default, at most every :data:`HAND_OVER_EVERY_S`
(:func:`hand_over_due`). Everything needed to continue exactly where it was is one file
(:data:`orchestrator.contract.STATE_FILE`): the trainer's state (model, optimizer, schedule,
position), the plan in force, the OOM events and shrinks so far, the node and the moves.

The scratch copy is not a state file a later process reads (those go through
``orchestrator.atomic_file``, flushed to disk): only its own process reads it, for a retry or
for Tune's copy to the sweep's storage, and a crash that loses the page cache loses the process
too. So it is written and not flushed: a GPU model's state is hundreds of MB, and writing 512 MiB
with an ``fsync`` took 0.4-1.5 s here, without one 0.19 s, at every evaluation. Its folder is the
newest checkpoint only once the file is whole.

A process that is killed (Ray's memory monitor, ``ray.kill``, a driver gone with its local Ray)
cannot remove its scratch folder, which then holds the trial's newest checkpoint for as long as
the node runs, unless the same trial comes back to it. So each folder holds a lock (``flock``)
that its process keeps while it lives, which the kernel lets go of however the process dies, and
every attempt that starts on a node first removes the folders whose lock no one holds, any
trial's.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO

import torch

from orchestrator import file_lock
from orchestrator.contract import STATE_FILE

#: Every attempt's scratch folder is ``<temp dir>/orchestrator-<trial>-<random>``.
SCRATCH_PREFIX = "orchestrator-"
#: The file in a scratch folder whose lock the attempt's process holds while it lives.
OWNER_LOCK = "attempt.lock"


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
        self.scratch, self._owner = fresh_scratch(name)
        self.newest: str | None = None  # folder of the newest checkpoint

    def adopt(self, state_file: str | None = None, *, data: bytes | None = None) -> None:
        """Start from a checkpoint made elsewhere: Tune's copy of one (a path), or its bytes sent
        by rank 0 of a group."""
        with self._new_checkpoint() as f:
            if state_file is not None:
                with open(state_file, "rb") as source:
                    shutil.copyfileobj(source, f)
            else:
                f.write(data)

    def save(self, state: dict) -> str:
        """Write ``state`` as the newest checkpoint; the one before it goes. Its folder, for Tune."""
        with self._new_checkpoint() as f:
            torch.save(state, f)
        return self.newest

    @contextlib.contextmanager
    def _new_checkpoint(self) -> Iterator[IO[bytes]]:
        """The state file of a new checkpoint folder, which becomes the newest once the block has
        written it whole (the one before it goes); a block that fails leaves no folder."""
        folder = tempfile.mkdtemp(prefix="checkpoint-", dir=self.scratch)
        try:
            with open(os.path.join(folder, STATE_FILE), "wb") as f:
                yield f
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if self.newest is not None:
            shutil.rmtree(self.newest, ignore_errors=True)
        self.newest = folder

    def load(self, map_location) -> dict:
        return torch.load(os.path.join(self.newest, STATE_FILE), map_location=map_location, weights_only=False)

    def remove(self) -> None:
        """Remove the folder, then let go of its lock (in that order: another attempt's sweep
        finds it held, or gone)."""
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self._owner is not None:
            os.close(self._owner)
            self._owner = None


def fresh_scratch(name: str) -> tuple[str, int]:
    """A temporary folder for this attempt, and the open file that holds its lock; the folders of
    attempts whose process is gone are removed first.

    The folder is made and locked under a hidden name and then renamed to its own, so that no
    other attempt's sweep can find it before it is locked.
    """
    root = tempfile.gettempdir()
    remove_abandoned(root)
    hidden = "." + SCRATCH_PREFIX
    staging = tempfile.mkdtemp(prefix=hidden, dir=root)
    owner = file_lock.take(os.path.join(staging, OWNER_LOCK))
    suffix = os.path.basename(staging)[len(hidden):]  # mkdtemp's random part, kept
    folder = os.path.join(root, f"{SCRATCH_PREFIX}{name}-{suffix}")
    os.rename(staging, folder)
    return folder, owner


def remove_abandoned(root: str) -> None:
    """Remove the scratch folders in ``root`` whose lock no process holds."""
    for lock in glob.glob(os.path.join(root, SCRATCH_PREFIX + "*", OWNER_LOCK)):
        if not file_lock.held_elsewhere(lock):
            shutil.rmtree(os.path.dirname(lock), ignore_errors=True)
