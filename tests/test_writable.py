"""Folders a command writes into: tried with a file first, taken back when the command refuses."""

from __future__ import annotations

import pytest

from orchestrator.errors import UserError
from orchestrator.writable import check_folder, outermost_missing, taken_back_if_refused


def test_a_folder_that_takes_no_file_is_one_line_naming_the_flag(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the folder should be")
    advice = "pass --out with a folder you can write"
    with pytest.raises(UserError) as raised:
        check_folder(blocker, "--out", advice)
    assert str(raised.value) == f"--out: cannot write to {blocker} (a file, not a folder); {advice}"
    with pytest.raises(UserError) as raised:
        check_folder(blocker / "inside", "--out", advice)
    assert str(raised.value) == f"--out: cannot write to {blocker / 'inside'} (Not a directory); {advice}"
    assert blocker.read_text() == "a file where the folder should be"


def test_a_folder_is_made_with_its_parents_and_the_probe_leaves_nothing(tmp_path):
    check_folder(tmp_path / "new" / "nested", "--out", "")
    assert list((tmp_path / "new" / "nested").iterdir()) == []


def test_outermost_missing_is_what_making_a_path_makes(tmp_path):
    assert outermost_missing(tmp_path / "a" / "b" / "c") == tmp_path / "a"
    assert outermost_missing(tmp_path / "a") == tmp_path / "a"


@pytest.mark.parametrize("stop", [UserError("refused after the checks"), KeyboardInterrupt()], ids=["refusal", "ctrl-c"])
def test_a_refusal_or_a_ctrl_c_takes_back_the_folders_its_checks_made(tmp_path, stop):
    storage = tmp_path / "results" / "nested"
    with pytest.raises(type(stop)), taken_back_if_refused(str(storage)):
        check_folder(storage, "storage_path", "")
        raise stop
    assert list(tmp_path.iterdir()) == []

    # A folder something was written to stays; one that was there before stays; no refusal, no change.
    with pytest.raises(UserError), taken_back_if_refused(str(storage)):
        storage.mkdir(parents=True)
        (storage / "checkpoint").write_text("progress")
        raise UserError("refused later")
    assert (storage / "checkpoint").exists()
    (storage / "checkpoint").unlink()
    with pytest.raises(UserError), taken_back_if_refused(str(storage)):
        raise UserError("refused, the folder the user had")
    assert storage.is_dir()
    with taken_back_if_refused(str(tmp_path / "kept")):
        check_folder(tmp_path / "kept", "storage_path", "")
    assert (tmp_path / "kept").is_dir()
