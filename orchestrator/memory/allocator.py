"""A model of PyTorch's CUDA caching allocator: what a sequence of allocations and frees reserves.

The trace counts tensor bytes, but a GPU runs out of memory on what PyTorch's caching allocator
has *reserved* from CUDA: requests are rounded, small ones are packed into 2 MiB segments and
1-10 MiB ones into 20 MiB segments, freed blocks stay cached and are split and merged, and
memory goes back to CUDA only when an allocation would otherwise fail. How much that adds
depends on the order of allocations and frees (the optimizer's state carved out of the first
step's cached activations, say), not on the peak of their sum, so no constant factor captures
it: measured on an H100, reserved/allocated is 1.0-1.4 with the default allocator and within a
few percent of 1 with ``expandable_segments:True``. This module replays a sequence through the
allocator's rules and reads its peaks, or where it runs out of a capacity.

The rules, as in ``c10/cuda/CUDACachingAllocator.cpp`` with ``c10/core/AllocatorConfig.{h,cpp}``
and ``c10/cuda/CUDAAllocatorConfig.{h,cpp}`` (PyTorch 2.9-2.13), for one stream and no CUDA
graphs:

* a request is rounded up to 512 bytes (``roundup_power2_divisions`` instead rounds it up to
  the next of N divisions of its power-of-two interval);
* requests of at most 1 MiB come from the small pool, whose segments are 2 MiB; larger ones
  from the large pool: a 1-10 MiB request that finds no cached block gets a new 20 MiB segment
  (``large_segment_size_mb``), a larger one a segment of its size rounded up to 2 MiB;
* a request takes the smallest cached block of its pool that fits (best fit, ties by address);
  blocks of ``max_split_size_mb`` or more serve only requests of that size or more, and only
  when at most ``max_non_split_rounding_mb`` (20 MiB) larger;
* the block is split when the rest is worth keeping: 512 bytes or more in the small pool (and
  with expandable segments), more than 1 MiB in the large pool and never for requests of
  ``max_split_size_mb`` or more; a freed block merges with free neighbours of its segment;
* when no cached block fits and a new segment would pass the capacity, the allocator frees
  cached oversize blocks (with ``max_split_size_mb``), then every cached block that is a whole
  segment, and tries once more; only then is it out of memory. A segment with one live block
  stays, which is what fragmentation costs under pressure;
* with ``expandable_segments:True`` each pool has one segment that grows: pages (2 MiB small,
  20 MiB large) are mapped on demand at the lowest free address, and on pressure every free
  page is unmapped, so reserved stays within a page or so of allocated plus the free holes.

Not modelled: ``garbage_collection_threshold`` (it frees cached blocks earlier, so the model's
reserved is an upper bound), other streams (``record_stream``), CUDA graphs' private pools and
``backend:cudaMallocAsync`` (CUDA's own pool: ``AllocatorConfig.modelled`` is False).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Iterable

from orchestrator.allocator_conf import DIVISION_INTERVALS, AllocatorConfig, MiB

MIN_BLOCK = 512
SMALL_SIZE = MiB  # the largest request of the small pool
SMALL_BUFFER = 2 * MiB  # a small-pool segment (and an expandable small pool's page)
MIN_LARGE_ALLOC = 10 * MiB  # requests below this share large-segment-sized segments
ROUND_LARGE = 2 * MiB
#: Address space of an expandable segment, in pages: far more than any GPU has.
_SEGMENT_PAGES = 1 << 20


# -- the allocator ---------------------------------------------------------------------------


class _Segment:
    """An expandable segment: its base address (pages are counted from it)."""

    __slots__ = ("base",)

    def __init__(self, base: int):
        self.base = base


class _Block:
    __slots__ = ("addr", "size", "prev", "next", "allocated", "mapped", "small", "segment")

    def __init__(self, addr: int, size: int, small: bool, segment: _Segment | None = None, mapped: bool = True):
        self.addr, self.size, self.small, self.segment, self.mapped = addr, size, small, segment, mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False


class _Pool:
    """Cached free blocks by (size, address); an expandable pool's unmapped ranges by address."""

    __slots__ = ("small", "page", "free", "unmapped")

    def __init__(self, small: bool, page: int):
        self.small, self.page = small, page
        self.free: list[tuple[int, int, _Block]] = []
        self.unmapped: list[tuple[int, _Block]] = []


@dataclass(frozen=True)
class OutOfMemory:
    """Where a replay ran out of its capacity: the allocation, and the allocator's state then."""

    event: int  # index of the failed allocation among the replayed events
    requested: int  # bytes asked
    allocated: int
    reserved: int


class AllocatorOutOfMemory(Exception):
    def __init__(self, oom: OutOfMemory):
        super().__init__(f"out of memory asking for {oom.requested} bytes ({oom.allocated} allocated, {oom.reserved} reserved)")
        self.oom = oom


class CachingAllocator:
    """One device's caching allocator, one stream. ``capacity``: bytes it may reserve (None: unbounded).

    Allocations are the blocks :meth:`malloc` returns; :meth:`run` replays a whole sequence of
    events (``n > 0``: allocate ``n`` bytes; ``~k``: free the ``k``-th allocation of this
    allocator), which is how the estimators use it.
    """

    def __init__(self, config: AllocatorConfig = AllocatorConfig(), capacity: int | None = None):
        if not config.modelled:
            raise ValueError(f"backend:{config.backend} is CUDA's own allocator, not modelled here")
        self.config, self.capacity = config, capacity
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.retries = 0  # times every cached segment was freed to make room (``num_alloc_retries``)
        self._small = _Pool(True, SMALL_BUFFER)
        self._large = _Pool(False, config.large_segment_size)
        self._max_split = config.max_split_size if config.max_split_size is not None else float("inf")
        self._expandable = config.expandable_segments
        self._divisions = config.roundup_power2_divisions if any(config.roundup_power2_divisions) else None
        self._next_address = 0
        self._handles: list[_Block | None] = []

    # -- the public operations --------------------------------------------------------------

    def round_size(self, nbytes: int) -> int:
        if nbytes < MIN_BLOCK:
            return MIN_BLOCK
        if self._divisions is not None:
            index = min(max(nbytes.bit_length() - 1 - 20, 0), DIVISION_INTERVALS - 1)  # 1 MiB = 2**20
            divisions = self._divisions[index]
            if divisions > 1 and nbytes > MIN_BLOCK * divisions:
                return _next_division(nbytes, divisions)
        return -(-nbytes // MIN_BLOCK) * MIN_BLOCK

    def allocation_size(self, size: int) -> int:
        """Bytes of a new segment for a rounded request of ``size`` that found no cached block."""
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return self.config.large_segment_size
        return -(-size // ROUND_LARGE) * ROUND_LARGE

    def malloc(self, nbytes: int) -> _Block:
        size = self.round_size(nbytes)
        pool = self._small if size <= SMALL_SIZE else self._large
        block = self._cached_block(pool, size)
        if block is None:
            alloc_size = self.allocation_size(size)
            block = (
                self._new_block(pool, size, alloc_size)
                or (self._release_oversize(pool, size) and self._new_block(pool, size, alloc_size))
                or (self._flush() and self._new_block(pool, size, alloc_size))
            )
            if not block:
                raise AllocatorOutOfMemory(OutOfMemory(len(self._handles), nbytes, self.allocated, self.reserved))
        remaining = block.size - size
        if (remaining >= MIN_BLOCK) if (pool.small or self._expandable) else (size < self._max_split and remaining > SMALL_SIZE):
            rest = block
            block = _Block(rest.addr, size, pool.small, rest.segment)
            block.prev = rest.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = rest
            rest.prev = block
            rest.addr += size
            rest.size -= size
            insort(pool.free, (rest.size, rest.addr, rest))
        block.allocated = True
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def free(self, block: _Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        pool = self._small if block.small else self._large
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        insort(pool.free, (block.size, block.addr, block))

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: every cached whole segment (and free page) back to CUDA."""
        self._release_cached()

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def run(self, events: Iterable[int]) -> OutOfMemory | None:
        """Replay ``events``; stops at, and returns, the first allocation that does not fit."""
        handles = self._handles
        malloc, free = self.malloc, self.free
        index = 0
        try:
            for index, event in enumerate(events):
                if event > 0:
                    handles.append(malloc(event))
                else:
                    free(handles[~event])
                    handles[~event] = None
        except AllocatorOutOfMemory as exc:
            return OutOfMemory(index, exc.oom.requested, exc.oom.allocated, exc.oom.reserved)
        return None

    # -- the rules ------------------------------------------------------------------------------

    def _cached_block(self, pool: _Pool, size: int) -> _Block | None:
        """``get_free_block``: best fit, with expandable segments' and oversize blocks' rules."""
        free = pool.free
        i = bisect_left(free, (size,))
        if i == len(free):
            return None
        block = free[i][2]
        if block.segment is not None:
            # A block before the segment's unmapped tail can grow into it: for "best fit" its
            # size is what it can expand to, so a later block that cannot grow may fit better.
            j = i + 1
            while block.segment is not None and j < len(free) and _expandable_size(free[j][2]) < _expandable_size(block):
                i, block = j, free[j][2]
                j += 1
        if size < self._max_split <= block.size:
            return None
        if size >= self._max_split and block.size >= size + self.config.max_non_split_rounding:
            return None
        del free[i]
        return block

    def _new_block(self, pool: _Pool, size: int, alloc_size: int) -> _Block | None:
        """``alloc_block``: a new segment (or newly mapped pages), unless it would pass the capacity."""
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None
        if self._expandable:
            return self._expandable_block(pool, size)
        block = _Block(self._region(alloc_size), alloc_size, pool.small)
        self._grow(alloc_size)
        return block

    def _release_oversize(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks``: free cached oversize segments, just enough of them."""
        if self._max_split == float("inf"):
            return False
        key = max(size, self._max_split)
        free = pool.free
        i = bisect_left(free, (key,))
        if i < len(free) and free[i][2].segment is None and _whole(free[i][2]):
            self._release(pool, free[i][2])
            return True
        released = 0
        i -= 1
        while released < key and i >= 0 and free[i][0] >= self._max_split:
            block = free[i][2]
            if block.segment is None and _whole(block):
                self._release(pool, block)
                released += block.size
            i -= 1
        return released >= key

    def _flush(self) -> bool:
        """The last resort before running out of memory: free the whole cache, then retry."""
        self.retries += 1
        return self._release_cached()

    def _release_cached(self) -> bool:
        """``release_cached_blocks``: free every cached block that is a whole segment; with
        expandable segments, unmap every page no live block touches."""
        for pool in (self._large, self._small):
            to_unmap = []
            for _, _, block in list(pool.free):
                if block.segment is not None:
                    to_unmap.append(block)
                elif _whole(block):
                    self._release(pool, block)
            for block in to_unmap:
                self._unmap(pool, block)
        return True

    def _release(self, pool: _Pool, block: _Block) -> None:
        self._remove_free(pool, block)
        self.reserved -= block.size

    # -- expandable segments -------------------------------------------------------------------

    def _expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        """``try_allocate_expandable_block``: map pages at the lowest address with room for ``size``."""
        candidate = self._room_for(pool, size)
        if not candidate.mapped and not self._map(pool, candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:  # a free block followed by unmapped pages: map some, merge
            following = candidate.next
            if not self._map(pool, following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        self._remove_free(pool, candidate)
        return candidate

    def _room_for(self, pool: _Pool, size: int) -> _Block:
        """``find_expandable_block``: the lowest unmapped range (with the free block before it)
        that has ``size`` bytes of room, or a new segment's."""
        for _, candidate in pool.unmapped:
            if candidate.prev is not None and not candidate.prev.allocated:
                candidate = candidate.prev
            room, block = 0, candidate
            while room < size and block is not None and not block.allocated:
                room += block.size
                block = block.next
            if room >= size:
                return candidate
        span = pool.page * _SEGMENT_PAGES
        base = self._region(span)
        block = _Block(base, span, pool.small, _Segment(base), mapped=False)
        insort(pool.unmapped, (block.addr, block))
        return block

    def _map(self, pool: _Pool, block: _Block, size: int) -> bool:
        """``map_block``: back the first ``size`` bytes of an unmapped range with whole pages."""
        mapped = -(-size // pool.page) * pool.page
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return False
        pool.unmapped.remove((block.addr, block))
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.addr + mapped, block.size - mapped, pool.small, block.segment, mapped=False)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            insort(pool.unmapped, (rest.addr, rest))
            block.size = mapped
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        insort(pool.free, (block.size, block.addr, block))
        self._grow(mapped)
        return True

    def _unmap(self, pool: _Pool, block: _Block) -> None:
        """``unmap_block``: give back the whole pages inside a free block; the edges stay free."""
        page, base = pool.page, block.segment.base
        start = base + -(-(block.addr - base) // page) * page
        end = base + (block.addr + block.size - base) // page * page
        if start >= end:
            return
        self._remove_free(pool, block)
        if start > block.addr:
            before = _Block(block.addr, start - block.addr, pool.small, block.segment)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            insort(pool.free, (before.size, before.addr, before))
        if end < block.addr + block.size:
            after = _Block(end, block.addr + block.size - end, pool.small, block.segment)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            insort(pool.free, (after.size, after.addr, after))
        block.addr, block.size, block.mapped = start, end - start, False
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        insort(pool.unmapped, (block.addr, block))
        self.reserved -= end - start

    # -- bookkeeping ---------------------------------------------------------------------------

    def _merge(self, pool: _Pool, block: _Block, other: _Block | None) -> None:
        """``try_merge_blocks``: absorb a free neighbour of the same mapped state."""
        if other is None or other.allocated or other.mapped != block.mapped:
            return
        if other.mapped:
            self._remove_free(pool, other)
        else:
            pool.unmapped.remove((other.addr, other))
        if other is block.prev:
            block.addr = other.addr
            block.prev = other.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = other.next
            if block.next is not None:
                block.next.prev = block
        block.size += other.size

    @staticmethod
    def _remove_free(pool: _Pool, block: _Block) -> None:
        i = bisect_left(pool.free, (block.size, block.addr))
        del pool.free[i]

    def _region(self, size: int) -> int:
        """A fresh address range (addresses order blocks of equal size, as real pointers do)."""
        address = self._next_address
        self._next_address += size
        return address

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved


def _expandable_size(block: _Block) -> int:
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


def _whole(block: _Block) -> bool:
    return block.prev is None and block.next is None


def _next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: 1200 with 4 divisions of [1024, 2048) -> 1280."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


@dataclass(frozen=True)
class Replay:
    """What one replay of a sequence reserved, and whether it fit its capacity."""

    peak_allocated: int
    peak_reserved: int
    oom: OutOfMemory | None = None
    retries: int = 0  # cache flushes it needed (each one a synchronising ``cudaFree`` storm)

    @property
    def fits(self) -> bool:
        return self.oom is None


def replay(events: Iterable[int], config: AllocatorConfig = AllocatorConfig(), capacity: int | None = None) -> Replay:
    """Replay ``events`` (``n > 0``: allocate ``n`` bytes; ``~k``: free the ``k``-th allocation)."""
    allocator = CachingAllocator(config, capacity)
    oom = allocator.run(events)
    return Replay(allocator.peak_allocated, allocator.peak_reserved, oom, allocator.retries)


__all__ = ["AllocatorOutOfMemory", "CachingAllocator", "OutOfMemory", "Replay", "replay"]
