"""The trial scheduler's state, saved with Tune's experiment state and put back by a resume.

Tune snapshots its trials, its search algorithm and its callbacks' states (``Callback.get_state``),
not its scheduler: a resumed sweep's scheduler is the one ``tuner.pkl`` holds, as the sweep began.
A resumed ASHA then starts with empty rungs, and a trial's first result after the resume is
recorded at every rung it had passed, with a later (better) value than the one it reached them
with; the trials still below those rungs are cut against it, and the sweep's best trial can be
stopped. :class:`SchedulerState` is a callback whose state is the scheduler's, so Tune saves it
in the same snapshot as the trials it describes and puts it back before the trials are requeued.
"""

from __future__ import annotations

from ray.tune import Callback


class SchedulerState(Callback):
    """Saves and restores ``scheduler`` (the sweep's ``OomAwareScheduler``), which Tune pickles
    with this callback in ``tuner.pkl``: the restored callback holds the restored scheduler."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler

    def get_state(self) -> dict:
        return {"scheduler": self.scheduler.state()}

    def set_state(self, state: dict) -> None:
        if "scheduler" in state:
            self.scheduler.put_back(state["scheduler"])
