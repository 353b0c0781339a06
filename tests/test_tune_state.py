"""Tune's state files kept whole through a storage that fills up (``orchestrator/tune_state.py``)."""

from __future__ import annotations

import json
import pickle

import pytest

from orchestrator.errors import UserError
from orchestrator.tune_state import COPIES, keep_whole_copies, restore_cut_off

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
