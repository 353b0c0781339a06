"""A trial's host memory against a node's (``orchestrator/host_memory.py``): pure arithmetic on
measured footprints."""

from __future__ import annotations

from orchestrator.config import DataLoading
from orchestrator.host_memory import INTERPRETER_BYTES, plan_host_memory, trial_parts
from trainables.footprint import DataFootprint

MiB = 1 << 20
# 100 MiB of tensors, 50 MiB of Python objects, 4 MiB batches, 30 MiB of model and optimizer.
FOOTPRINT = DataFootprint(tensor_bytes=100 * MiB, array_bytes=0, copied_bytes=50 * MiB, batch_bytes=4 * MiB,
                          state_bytes=30 * MiB)


def test_workers_share_tensors_copy_objects_and_hold_their_batches_ahead():
    parts = trial_parts(FOOTPRINT, DataLoading(num_workers=4, prefetch_factor=3), pinned=True)
    assert parts == {"datasets": (100 + 50 * 5) * MiB, "loader interpreters": 0, "batches ahead": 4 * 3 * 4 * MiB,
                     "pinned": 4 * 3 * 4 * MiB, "checkpoint copy": 30 * MiB}
    alone = trial_parts(FOOTPRINT, DataLoading(), pinned=False)  # loading in the trial's process: one batch at a time
    assert alone == {"datasets": 150 * MiB, "loader interpreters": 0, "batches ahead": 4 * MiB, "pinned": 0,
                     "checkpoint copy": 30 * MiB}


def test_arrays_are_shared_with_forked_workers_and_copied_into_workers_that_get_them_pickled():
    arrays = DataFootprint(tensor_bytes=0, array_bytes=100 * MiB, copied_bytes=0, batch_bytes=0, state_bytes=0)
    by_method = {method: trial_parts(arrays, DataLoading(num_workers=4, multiprocessing_context=method), pinned=False)
                 for method in ("fork", "forkserver", "spawn")}
    assert {m: parts["datasets"] for m, parts in by_method.items()} == {
        "fork": 100 * MiB, "forkserver": 500 * MiB, "spawn": 500 * MiB}
    assert trial_parts(arrays, DataLoading(), pinned=False)["datasets"] == 100 * MiB  # no workers: the trial's own


def test_a_fork_server_is_one_interpreter_more_and_each_spawned_worker_one():
    interpreters = {method: trial_parts(FOOTPRINT, DataLoading(num_workers=4, multiprocessing_context=method),
                                        pinned=False)["loader interpreters"]
                    for method in ("fork", "forkserver", "spawn")}
    assert interpreters == {"fork": 0, "forkserver": INTERPRETER_BYTES, "spawn": 4 * INTERPRETER_BYTES}
    assert trial_parts(FOOTPRINT, DataLoading(multiprocessing_context="spawn"), pinned=False)["loader interpreters"] == 0


def test_settings_that_fit_are_kept():
    data = DataLoading(num_workers=4)
    plan = plan_host_memory(FOOTPRINT, data, pinned=False, trials_at_once=2, available_bytes=10_000 * MiB)
    assert plan.data == data and not plan.reduced and plan.refusal is None
    assert plan.trial_bytes == (100 + 250 + 32 + 30) * MiB


def test_a_node_that_cannot_hold_its_trials_loads_fewer_batches_ahead_then_uses_fewer_workers():
    data = DataLoading(num_workers=8, prefetch_factor=4)
    # 8 workers: 100 + 450 + 8*4*4 + 30 = 708 MiB a trial; prefetch 1: 612; 4 workers: 100 + 250 + 16 + 30 = 396.
    plan = plan_host_memory(FOOTPRINT, data, pinned=False, trials_at_once=2, available_bytes=800 * MiB)
    assert plan.data == DataLoading(num_workers=4, prefetch_factor=1)
    assert plan.reduced == "data.num_workers 8->4, data.prefetch_factor 4->1" and plan.refusal is None
    assert "2 at once: 792.0 MiB of 800.0 MiB available; data.num_workers 8->4" in plan.describe()


def test_a_node_that_cannot_hold_them_even_without_workers_is_refused_in_one_line():
    plan = plan_host_memory(FOOTPRINT, DataLoading(num_workers=2), pinned=False, trials_at_once=4, available_bytes=500 * MiB)
    assert plan.data == DataLoading() and plan.reduced == "data.num_workers 2->0"
    assert plan.refusal.startswith("4 trial(s) at once need 736.0 MiB of host memory even loading in their own processes")
    assert "\n" not in plan.describe()


