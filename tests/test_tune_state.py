"""Tune's state files kept whole through a storage that fills up (``orchestrator/tune_state.py``)."""

from __future__ import annotations

import json
import pickle
import threading
import time
from types import SimpleNamespace

import pyarrow.fs
import pytest

from orchestrator import tune_state
from orchestrator.errors import UserError
from orchestrator.tune_state import COPIES, ForgetGoneCheckpoints, KeepWholeState, keep_whole_copies, restore_cut_off
from tests.conftest import kept_checkpoints

STATE = "experiment_state-2026-11-26_14-00-00.json"
SEARCHER = "basic-variant-state-2026-11-26_14-00-00.json"  # a pickle, whatever its name says


@pytest.fixture
def folders(tmp_path):
    """Tune's staging folder on the driver, and the sweep's folder on the storage."""
    (tmp_path / "staging").mkdir()
    (tmp_path / "sweep").mkdir()
    return tmp_path / "staging", tmp_path / "sweep"


def test_a_state_file_cut_off_by_a_full_storage_is_put_back_from_its_last_whole_copy(folders):
    staging, sweep = folders
    (staging / STATE).write_text(json.dumps({"runner_data": {"trials": 2}}))
    (staging / SEARCHER).write_bytes(pickle.dumps({"seen": [1, 2]}))
    copied = {}
    keep_whole_copies(str(staging), str(sweep), copied)  # before Tune's upload has finished
    assert sorted(p.name for p in (sweep / COPIES).iterdir()) == [SEARCHER, STATE]

    (staging / STATE).write_text('{"runner_data": {"tri')  # a staged file is never cut off, but if it were,
    keep_whole_copies(str(staging), str(sweep), copied)  # it would not replace the whole copy
    (sweep / STATE).write_text('{"runner_data": {"tri')  # the upload, cut off when the disk filled
    (sweep / SEARCHER).write_bytes(b"")
    assert sorted(restore_cut_off(str(sweep))) == [SEARCHER, STATE]
    assert json.loads((sweep / STATE).read_text()) == {"runner_data": {"trials": 2}}
    assert pickle.loads((sweep / SEARCHER).read_bytes()) == {"seen": [1, 2]}
    assert restore_cut_off(str(sweep)) == []  # whole files are left as they are


def test_a_state_file_never_uploaded_is_put_back_too(folders):
    staging, sweep = folders
    (staging / STATE).write_text("{}")
    keep_whole_copies(str(staging), str(sweep), {})
    assert restore_cut_off(str(sweep)) == [STATE] and (sweep / STATE).read_text() == "{}"


def test_a_cut_off_state_file_without_a_whole_copy_refuses_the_resume_naming_it(folders):
    _, sweep = folders
    (sweep / STATE).write_text('{"runner_data": {"tri')
    with pytest.raises(UserError, match=f"cannot resume {sweep}: Tune's {STATE} is cut off .* without --resume"):
        restore_cut_off(str(sweep))


def test_the_copies_are_made_outside_tunes_event_loop_and_the_last_one_at_the_sweeps_end(folders, monkeypatch):
    """Each copy is flushed to disk, which on a busy disk would hold up every trial waiting for
    the driver to take its report: the callback copies in a thread of its own, and the sweep's
    end waits for it and copies what changed since. The callback still pickles (Tune saves it)."""
    staging, sweep = folders
    # Where Tune's trial says the staging folder and the sweep's folder are (a Tune Trial needs Ray).
    storage = SimpleNamespace(experiment_driver_staging_path=str(staging), experiment_fs_path=str(sweep),
                              storage_filesystem=pyarrow.fs.LocalFileSystem())
    trials = [SimpleNamespace(storage=storage)]
    writers = []
    real_copy = tune_state.keep_whole_copies
    monkeypatch.setattr(tune_state, "keep_whole_copies",
                        lambda *a: (writers.append(threading.current_thread().name), real_copy(*a)))
    keep = KeepWholeState()
    (staging / STATE).write_text(json.dumps({"saved": 1}))
    keep.on_step_end(iteration=1, trials=trials)
    for _ in range(500):  # the copier takes it up
        if (sweep / COPIES / STATE).exists():
            break
        time.sleep(0.01)
    assert writers == ["keep-whole-state"]
    keep.on_step_end(iteration=2, trials=trials)  # nothing changed (or the copy still runs): no second copy
    (staging / STATE).write_text(json.dumps({"saved": 2, "more": True}))
    keep.on_experiment_end(trials=trials)
    assert writers[-1] == threading.current_thread().name
    assert json.loads((sweep / COPIES / STATE).read_text()) == {"saved": 2, "more": True}
    assert isinstance(pickle.loads(pickle.dumps(keep)), KeepWholeState)


def test_a_resumed_drivers_first_step_rids_the_unfinished_trials_of_checkpoints_gone_from_the_storage(
        tmp_path, trial_with_checkpoints):
    """Once, at the first step: an unfinished trial's state that names a deleted checkpoint is
    mended before the trial registers its next; a finished trial registers none, and is left as
    it was; the callback comes back from Tune's pickled run config as a new one."""
    unfinished, _ = trial_with_checkpoints(tmp_path / "unfinished", steps=2)
    finished, _ = trial_with_checkpoints(tmp_path / "finished", steps=2, status="TERMINATED")
    for trial in ("unfinished", "finished"):
        (tmp_path / trial / "checkpoint_000000").rmdir()
    callback = pickle.loads(pickle.dumps(ForgetGoneCheckpoints()))
    callback.on_step_begin(iteration=0, trials=[unfinished, finished])
    assert kept_checkpoints(unfinished) == ["checkpoint_000001"]
    assert kept_checkpoints(finished) == ["checkpoint_000000", "checkpoint_000001"]

    later, _ = trial_with_checkpoints(tmp_path / "later", steps=2)
    (tmp_path / "later" / "checkpoint_000000").rmdir()
    callback.on_step_begin(iteration=1, trials=[later])  # looked at once: later deletions are Tune's own
    assert kept_checkpoints(later) == ["checkpoint_000000", "checkpoint_000001"]
