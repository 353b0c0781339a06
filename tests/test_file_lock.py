"""``orchestrator.file_lock``: one holder at a time, and no file left once the last lets go."""

from __future__ import annotations

import threading
import time

from orchestrator.file_lock import give_back, held, held_elsewhere, take


def test_the_lock_is_one_holder_at_a_time_and_its_file_goes_with_the_last(tmp_path):
    """The second waits on the file the first then removes as it lets go: it takes the lock
    again on a file at the path, not on the removed one (which would let a third in beside it)."""
    path = str(tmp_path / "store.lock")
    order: list[str] = []
    first_holds = threading.Event()

    def second():
        first_holds.wait()
        with held(path):
            order.append("second")

    waiter = threading.Thread(target=second)
    waiter.start()
    with held(path):
        first_holds.set()
        time.sleep(0.3)
        order.append("first")
    waiter.join(10)
    assert order == ["first", "second"]
    assert not (tmp_path / "store.lock").exists()


def test_without_waiting_a_held_lock_is_none_and_is_seen_held(tmp_path):
    path = str(tmp_path / "sweep.lock")
    assert not held_elsewhere(path) and not (tmp_path / "sweep.lock").exists()  # asking makes no file
    fd = take(path, wait=False)
    assert fd is not None
    assert take(path, wait=False) is None and held_elsewhere(path)
    give_back(path, fd)
    assert not held_elsewhere(path) and not (tmp_path / "sweep.lock").exists()
