"""orchestrator.atomic_file: a state file holds the old content or the new, never a part of it."""

from __future__ import annotations

import os
import pickle

import pytest

from orchestrator.atomic_file import atomic_write


def test_the_file_holds_what_was_written_and_no_partial_file_is_left(tmp_path):
    path = tmp_path / "state.json"
    with atomic_write(path) as f:
        f.write("new")
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_write_that_fails_midway_keeps_the_old_file_whole(tmp_path):
    """What a full disk does to a state file half way: the error reaches the caller, the file
    keeps its old content and the partial one is removed."""
    path = tmp_path / "unsent.pkl"
    path.write_bytes(pickle.dumps(["old"]))
    with pytest.raises(OSError, match="No space left"), atomic_write(path, "wb") as f:
        f.write(b"\x80\x04 half a pickle")
        raise OSError(28, "No space left on device")
    assert pickle.loads(path.read_bytes()) == ["old"]
    assert os.listdir(tmp_path) == ["unsent.pkl"]


def test_the_file_is_created_with_the_permissions_open_would_give(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    with atomic_write(tmp_path / "a") as f:
        f.write("x")
    open(tmp_path / "b", "w").close()
    assert os.stat(tmp_path / "a").st_mode == os.stat(tmp_path / "b").st_mode


def test_only_whole_file_writes_are_accepted(tmp_path):
    with pytest.raises(ValueError, match="mode"), atomic_write(tmp_path / "log", "a"):
        pass
