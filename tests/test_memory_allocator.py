"""The caching-allocator model, rule by rule, against figures worked out by hand from PyTorch's rules."""

from __future__ import annotations

import pytest

from orchestrator.allocator_conf import AllocatorConfig, parse_alloc_conf
from orchestrator.memory.allocator import CachingAllocator, OutOfMemory, replay

MiB = 2**20
EXPANDABLE = AllocatorConfig(expandable_segments=True)


# -- rounding and pools ----------------------------------------------------------------------


@pytest.mark.parametrize("nbytes, rounded", [(1, 512), (512, 512), (513, 1024), (1000, 1024), (3 * MiB + 1, 3 * MiB + 512)])
def test_requests_round_up_to_512_bytes(nbytes, rounded):
    assert CachingAllocator().round_size(nbytes) == rounded


def test_roundup_power2_divisions_rounds_to_the_next_division():
    four = CachingAllocator(parse_alloc_conf("roundup_power2_divisions:4"))
    assert four.round_size(5 * MiB + 1) == 6 * MiB  # [4, 8) MiB in four steps of 1 MiB
    assert four.round_size(5 * MiB) == 5 * MiB  # already on a division
    assert four.round_size(8 * MiB) == 8 * MiB  # a power of two
    assert four.round_size(1200) == 1536  # not above 512 x 4: plain 512-byte rounding


def test_small_requests_share_a_2_mib_segment():
    a = CachingAllocator()
    a.malloc(1000)
    a.malloc(1000)
    assert (a.allocated, a.reserved) == (2048, 2 * MiB)


def test_1_to_10_mib_requests_share_a_20_mib_segment():
    a = CachingAllocator()
    a.malloc(3 * MiB)
    a.malloc(3 * MiB)  # the first split the segment: 17 MiB left, more than 1 MiB
    assert (a.allocated, a.reserved) == (6 * MiB, 20 * MiB)


def test_large_requests_get_a_segment_rounded_to_2_mib_and_keep_a_small_rest():
    a = CachingAllocator()
    a.malloc(11 * MiB + 1)  # 11 MiB + 512 B -> a 12 MiB segment; the rest (1 MiB - 512 B) is not split off
    assert (a.allocated, a.reserved) == (12 * MiB, 12 * MiB)


# -- the cache: best fit, splitting, merging -------------------------------------------------------


def test_freed_blocks_stay_reserved_and_serve_the_best_fit():
    a = CachingAllocator()
    x, y = a.malloc(30 * MiB), a.malloc(40 * MiB)
    x_address = x.addr
    a.free(x)
    a.free(y)
    assert (a.allocated, a.reserved) == (0, 70 * MiB)
    z = a.malloc(25 * MiB)  # the 30 MiB block fits best, split into 25 + 5
    assert (z.size, z.addr, a.reserved) == (25 * MiB, x_address, 70 * MiB)
    a.malloc(39 * MiB)  # the 40 MiB block: 1 MiB left over is not worth a split
    assert (a.allocated, a.reserved) == (65 * MiB, 70 * MiB)


def test_freed_neighbours_merge_back_into_the_segment():
    a = CachingAllocator()
    x, y, z = (a.malloc(3 * MiB) for _ in range(3))  # 3 + 3 + 3 of a 20 MiB segment, 11 MiB free after
    a.free(y)
    a.free(x)  # merges with y
    a.malloc(6 * MiB)  # fits the merged hole exactly: no new segment
    assert a.reserved == 20 * MiB
    a.free(z)
    a.empty_cache()  # the segment still has the 6 MiB block: it stays
    assert a.reserved == 20 * MiB


def test_empty_cache_returns_whole_segments_only():
    a = CachingAllocator()
    blocks = [a.malloc(3 * MiB) for _ in range(3)] + [a.malloc(50 * MiB)]
    for b in blocks:
        a.free(b)
    a.empty_cache()
    assert a.reserved == 0


def test_a_new_segment_when_cached_blocks_are_too_small():
    a = CachingAllocator()
    a.free(a.malloc(20 * MiB))
    a.malloc(25 * MiB)  # 20 MiB cached is too small: cudaMalloc 26 MiB (rounded to 2 MiB)
    assert a.reserved == 46 * MiB


# -- out of memory ------------------------------------------------------------------------------------


def test_under_pressure_the_cache_is_freed_and_the_allocation_retried():
    a = CachingAllocator(capacity=40 * MiB)
    a.free(a.malloc(20 * MiB))
    a.malloc(25 * MiB)  # 20 + 26 > 40: the cached 20 MiB segment goes back to CUDA first
    assert (a.reserved, a.retries) == (26 * MiB, 1)


def test_a_segment_with_a_live_block_cannot_be_freed_so_it_runs_out():
    result = replay([3 * MiB, 25 * MiB], capacity=40 * MiB)  # 20 MiB segment pinned by 3 MiB, + 26 > 40
    assert not result.fits
    assert result.oom == OutOfMemory(event=1, requested=25 * MiB, allocated=3 * MiB, reserved=20 * MiB)
    assert result.peak_reserved == 20 * MiB


def test_fits_exactly_at_the_capacity():
    assert replay([20 * MiB, 20 * MiB], capacity=40 * MiB).fits
    assert not replay([20 * MiB, 20 * MiB + 1], capacity=40 * MiB).fits


# -- max_split_size_mb ------------------------------------------------------------------------------------


def test_oversize_blocks_serve_only_large_requests_within_20_mib():
    config = parse_alloc_conf("max_split_size_mb:40")
    a = CachingAllocator(config)
    a.free(a.malloc(50 * MiB))
    a.malloc(10 * MiB)  # below max_split: the cached 50 MiB block is not used, new 10 MiB segment
    assert a.reserved == 60 * MiB
    b = a.malloc(45 * MiB)  # oversize request, block < 45 + 20 MiB: taken whole, never split
    assert (b.size, a.reserved, a.allocated) == (50 * MiB, 60 * MiB, 60 * MiB)
    a.free(b)
    a.malloc(41 * MiB)  # the 50 MiB block is 9 MiB too large: still within 20 MiB, taken
    assert a.reserved == 60 * MiB
    c = CachingAllocator(parse_alloc_conf("max_split_size_mb:40"))
    c.free(c.malloc(70 * MiB))
    c.malloc(42 * MiB)  # 70 >= 42 + 20: too wasteful, a new 42 MiB segment
    assert c.reserved == 112 * MiB


def test_oversize_cached_blocks_are_freed_first_under_pressure():
    a = CachingAllocator(parse_alloc_conf("max_split_size_mb:40"), capacity=70 * MiB)
    a.free(a.malloc(50 * MiB))
    a.malloc(30 * MiB)  # 50 + 30 > 70: the cached oversize block goes, without flushing the whole cache
    assert (a.reserved, a.retries) == (30 * MiB, 0)


# -- expandable segments ------------------------------------------------------------------------------


def test_expandable_segment_maps_20_mib_pages_and_grows_into_the_free_tail():
    a = CachingAllocator(EXPANDABLE)
    a.malloc(3 * MiB)  # maps one 20 MiB page, splits: 17 MiB free before the unmapped tail
    assert a.reserved == 20 * MiB
    a.malloc(30 * MiB)  # grows from the free 17 MiB: maps 13 MiB more, i.e. one more page
    assert (a.allocated, a.reserved) == (33 * MiB, 40 * MiB)
    plain = replay([3 * MiB, 30 * MiB])
    assert plain.peak_reserved == 50 * MiB  # the default allocator: a 20 MiB and a 30 MiB segment


def test_expandable_small_pool_uses_2_mib_pages():
    a = CachingAllocator(EXPANDABLE)
    for _ in range(5):
        a.malloc(600 * 1024)  # 3 MB of small requests: two 2 MiB pages of one growing segment
    assert a.reserved == 4 * MiB


def test_expandable_segment_unmaps_free_pages_under_pressure():
    a = CachingAllocator(EXPANDABLE, capacity=80 * MiB)
    x = a.malloc(40 * MiB)  # two pages
    a.malloc(3 * MiB)  # a third page, after x: 17 MiB of it free
    a.free(x)
    assert a.reserved == 60 * MiB
    # No free block of 50 MiB, and 60 + 50 > 80: x's two free pages are unmapped (20 MiB left),
    # then the free 17 MiB at the end grows by two pages (40 MiB; 20 + 50 <= 80 passes the check).
    a.malloc(50 * MiB)
    assert (a.allocated, a.reserved, a.retries) == (53 * MiB, 60 * MiB, 1)
    # With the capacity at 60 MiB the retry's check (20 + 50 > 60) fails as PyTorch's does: OOM.
    assert not replay([40 * MiB, 3 * MiB, ~0, 50 * MiB], EXPANDABLE, capacity=60 * MiB).fits


def test_expandable_segments_reserve_less_when_state_is_carved_from_cached_activations():
    """The first step's activations are freed, the optimizer's state takes part of their cache,
    and the second step's activations no longer fit what is left."""
    activations, state = 100 * MiB, 30 * MiB
    events = [activations, ~0, state, activations, ~2]
    plain, expandable = replay(events), replay(events, EXPANDABLE)
    assert plain.peak_allocated == expandable.peak_allocated == 130 * MiB
    assert plain.peak_reserved == 200 * MiB  # 70 MiB of the first segment cannot hold 100 MiB
    assert expandable.peak_reserved == 140 * MiB  # 70 MiB free + 30 MiB more, in 20 MiB pages


# -- replay ---------------------------------------------------------------------------------------------------


def test_replay_frees_by_allocation_order_and_reports_peaks():
    result = replay([1000, 3 * MiB, ~0, 2000, ~1, ~2])  # ~2 frees the third allocation, 2000 bytes
    assert (result.peak_allocated, result.peak_reserved, result.fits) == (2048 + 3 * MiB, 22 * MiB, True)


def test_cudamallocasync_is_not_modelled():
    config = parse_alloc_conf("backend:cudaMallocAsync")
    assert not config.modelled
    with pytest.raises(ValueError, match="not modelled"):
        CachingAllocator(config)


# -- PYTORCH_CUDA_ALLOC_CONF --------------------------------------------------------------------------------


def test_parse_alloc_conf_reads_every_modelled_setting():
    config = parse_alloc_conf(
        " expandable_segments:True, max_split_size_mb:128,max_non_split_rounding_mb:40,"
        "roundup_power2_divisions:[64:8,256:4,>:1],garbage_collection_threshold:0.6,release_lock_on_cudamalloc:False"
    )
    assert config.expandable_segments and config.max_split_size == 128 * MiB
    assert config.max_non_split_rounding == 40 * MiB and config.garbage_collection_threshold == 0.6
    # 64 MiB -> interval 6 (and every interval below it), 256 MiB -> 8, '>' -> from 9 on; 7 stays 0
    assert config.roundup_power2_divisions == (8,) * 7 + (0, 4) + (1,) * 7
    assert parse_alloc_conf(None) == parse_alloc_conf("") == AllocatorConfig()
    assert parse_alloc_conf("roundup_power2_divisions:2").roundup_power2_divisions == (2,) * 16


@pytest.mark.parametrize("text, message", [
    ("expandible_segments:True", "unknown key 'expandible_segments'"),
    ("expandable_segments:true", "expandable_segments: expected True or False, got 'true'"),
    ("max_split_size_mb:10", "max_split_size_mb: expected a whole number of at least 20, got '10'"),
    ("max_split_size_mb:lots", "max_split_size_mb: expected a whole number"),
    ("garbage_collection_threshold:1.5", "garbage_collection_threshold: expected a number between 0 and 1"),
    ("roundup_power2_divisions:3", "roundup_power2_divisions: expected a power of two, got '3'"),
    ("roundup_power2_divisions:[100:4]", "interval boundaries must be powers of two"),
    ("backend:magic", "backend: expected native or cudaMallocAsync, got 'magic'"),
    ("expandable_segments", "expandable_segments: expected 'expandable_segments:<value>'"),
    ("expandable_segments:True max_split_size_mb:64", "expected True or False, got 'Truemax_split_size_mb'"),
])
def test_parse_alloc_conf_names_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_alloc_conf(text)
