"""Tune's state files kept whole through a storage that fills up (``orchestrator/tune_state.py``)."""

from __future__ import annotations

import json
import pickle

from orchestrator.tune_state import COPIES, keep_whole_copies, restore_cut_off, whole


def test_a_state_file_cut_off_by_a_full_storage_is_put_back_from_its_last_whole_copy(tmp_path):
    state = tmp_path / "experiment_state-2026-11-26_14-00-00.json"
    searcher = tmp_path / "callback-states-2026-11-26_14-00-00.pkl"
    state.write_text(json.dumps({"runner_data": {"trials": 2}}))
    searcher.write_bytes(pickle.dumps({"seen": [1, 2]}))
    copied = {}
    keep_whole_copies(str(tmp_path), copied)
    assert sorted(p.name for p in (tmp_path / COPIES).iterdir()) == sorted([state.name, searcher.name])

    state.write_text('{"runner_data": {"tri')  # Tune's rewrite, cut off when the disk filled
    searcher.write_bytes(b"")
    keep_whole_copies(str(tmp_path), copied)  # a cut-off file never replaces the whole copy
    assert not whole(str(state)) and not whole(str(searcher))
    assert sorted(restore_cut_off(str(tmp_path))) == sorted([state.name, searcher.name])
    assert json.loads(state.read_text()) == {"runner_data": {"trials": 2}}
    assert pickle.loads(searcher.read_bytes()) == {"seen": [1, 2]}
    assert restore_cut_off(str(tmp_path)) == []  # whole files are left as they are
