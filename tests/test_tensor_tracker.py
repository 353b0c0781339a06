"""The tensor tracker's allocation log: requested bytes in order, frees by allocation index."""

from __future__ import annotations

import torch

from orchestrator.device.tensor_tracker import StorageTracker


def test_the_log_opens_with_existing_tensors_and_records_allocations_and_frees():
    weight = torch.zeros(100)  # 400 bytes, already there when the log starts
    tracker = StorageTracker("cpu", round_to=512)
    tracker.track([weight])
    with tracker:
        log = tracker.record([weight])
        h = torch.ones(10, 30)  # 1200 bytes requested; the tracker counts 1536, the log what was asked
        y = h * 2
        del h
        z = y.sum()
        del weight
    assert tracker.stop_recording() == [400, 1200, 1200, ~1, 4, ~0]
    assert log is not None and tracker.log is None
    del y, z
