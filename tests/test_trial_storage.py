"""A checkpoint report the storage refuses is tried again, then ends in one line
(``orchestrator/trial/storage.py``). The refusals are real: writes to a folder that is not there."""

from __future__ import annotations

import errno

import pytest

from orchestrator.trial.storage import RETRY_DELAYS_S, StorageUnavailable, report_with_retries, storage_fault


def _write_into(folder):
    def send():
        with open(folder / "checkpoint" / "state.pt", "wb") as f:
            f.write(b"state")
    return send


def test_a_refused_report_is_tried_again_with_a_growing_pause_then_ends_in_one_line(tmp_path):
    slept = []
    with pytest.raises(StorageUnavailable) as raised:
        report_with_retries(_write_into(tmp_path), sleep=slept.append)
    assert slept == list(RETRY_DELAYS_S)
    line = str(raised.value)
    assert "\n" not in line and "No such file or directory" in line and str(tmp_path / "checkpoint") in line
    assert line.endswith(f"(tried {len(RETRY_DELAYS_S) + 1} times over {sum(RETRY_DELAYS_S):g} s)")


def test_a_storage_that_comes_back_takes_the_report(tmp_path):
    slept = []

    def the_storage_comes_back(seconds):
        slept.append(seconds)
        if len(slept) == 2:
            (tmp_path / "checkpoint").mkdir()

    report_with_retries(_write_into(tmp_path), sleep=the_storage_comes_back)
    assert slept == list(RETRY_DELAYS_S[:2]) and (tmp_path / "checkpoint" / "state.pt").read_bytes() == b"state"


def test_an_error_that_is_not_the_storage_is_not_retried():
    def send():
        raise ValueError("a metric Tune does not take")

    with pytest.raises(ValueError):
        report_with_retries(send, sleep=pytest.fail)


def test_a_refusal_that_names_no_file_is_told_where_the_checkpoint_went():
    def full():
        raise OSError(28, "Error writing bytes to file. Detail: [errno 28] No space left on device")

    with pytest.raises(StorageUnavailable) as raised:
        report_with_retries(full, where="/storage/cut/trial_0", sleep=lambda s: None)
    assert str(raised.value) == ("[Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device "
                                 "(writing a checkpoint into /storage/cut/trial_0) (tried 5 times over 15 s)")


@pytest.mark.parametrize("error, fault", [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (OSError(errno.EROFS, "Cannot create directory '/s/c'.\nDetail: [errno 30] Read-only file system"), True),
    (PermissionError(errno.EACCES, "Permission denied"), True),
    (RuntimeError("Unable to set up cluster storage with the following settings:\nStorageContext<...>"), True),
    (OSError(errno.EBADF, "Bad file descriptor"), False),
    (RuntimeError("something else"), False),
])
def test_what_counts_as_the_storage_refusing(error, fault):
    line = storage_fault(error)
    assert (line is not None) == fault
    assert line is None or "\n" not in line
