"""Allocation logs at any batch size, from logs at two, and their replay as a trial meets them."""

from __future__ import annotations

from orchestrator.allocator_conf import AllocatorConfig, parse_alloc_conf
from orchestrator.memory.allocator import replay
from orchestrator.memory.sequence import (
    TrialSequence,
    canonical,
    fit_log,
    without_prefix,
)

MiB = 2**20


def test_a_log_at_two_batch_sizes_gives_it_at_every_batch_size():
    # a weight (4 KiB), an activation (3 KiB per sample), its free, a label copy (8 bytes per sample + 16)
    at_2, at_16 = [4096, 6144, ~1, 32], [4096, 49152, ~1, 144]
    fitted = fit_log(at_2, at_16, 2, 16)
    assert fitted.allocations == 3 and len(fitted) == 4
    assert fitted.events(100) == [4096, 300 * 1024, ~1, 816]
    assert fitted.events(1) == [4096, 3072, ~1, 24]


def test_logs_that_differ_beyond_affine_sizes_have_no_fit():
    assert fit_log([100, ~0], [100, ~0, 5], 2, 16) is None  # another op at another batch size
    assert fit_log([100, 200, ~0], [100, 200, ~1], 2, 16) is None  # freed in another order
    assert fit_log([100], [107], 2, 16) is None  # 0.5 bytes per sample: not a tensor's size
    assert fit_log([100], [50], 2, 16) is None  # shrinks with the batch


def test_a_canonical_log_frees_each_run_of_frees_oldest_first():
    # three weight casts freed at once (autocast's cache, in its hash table's order), then two
    # activations: the same steps logged twice, freed in other orders, give one canonical log
    first = [10, 20, 30, ~2, ~0, ~1, 40, 50, ~4, ~3]
    second = [10, 20, 30, ~1, ~2, ~0, 40, 50, ~3, ~4]
    assert canonical(first) == canonical(second) == [10, 20, 30, ~0, ~1, ~2, 40, 50, ~3, ~4]
    assert fit_log(first, second, 2, 16) is None and fit_log(canonical(first), canonical(second), 2, 16) is not None
    # a run is not sorted across the cut (where the measured step starts)
    assert canonical([10, 20, ~1, ~0], cut=3) == [10, 20, ~1, ~0]
    assert canonical([10, 20, 30, ~2, ~1, ~0], cut=4) == [10, 20, 30, ~2, ~0, ~1]


def test_the_order_of_a_run_of_frees_does_not_change_what_the_allocator_holds():
    # blocks freed together merge with their neighbours whatever the order: the canonical order
    # replays to the same peaks as the one the process happened to take, at every later step
    for conf in ("", "expandable_segments:True"):
        config = parse_alloc_conf(conf)
        logged = [MiB, 3 * MiB, 2 * MiB, 5 * MiB, ~2, ~0, ~3, 6 * MiB, 512, ~1, ~4, 9 * MiB, ~6]
        assert replay(canonical(logged), config) == replay(logged, config)


def test_without_prefix_is_the_log_as_started_later():
    events = [10, 20, ~0, 30, ~1, ~2]
    assert without_prefix(events, 3, 2) == [30, ~0]  # the free of an earlier allocation is not there


def test_an_eval_step_replays_after_training_in_its_cache():
    train = fit_log([20 * MiB, 40 * MiB, ~1], [20 * MiB, 80 * MiB, ~1], 2, 4)  # states, activations freed
    evaluate = fit_log([10 * MiB, ~2], [20 * MiB, ~2], 2, 4)  # eval activations, numbered after training's
    sequence = TrialSequence(train, evaluate)
    result = sequence.replay(AllocatorConfig(), micro_batch=4, eval_batch=2)
    # training keeps its 80 MiB segment cached; eval's 10 MiB fits in it: no new segment
    assert (result.peak_allocated, result.peak_reserved) == (30 * MiB, 100 * MiB)
    assert TrialSequence(train).replay(AllocatorConfig(), 4).peak_reserved == 100 * MiB
    assert sequence.describe() == {"allocations": 3, "events": 5}
