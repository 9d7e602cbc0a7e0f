"""What PyTorch's CUDA caching allocator would reserve for a recorded sequence of allocations and frees.

    peak = replay([("alloc", 1, 5 << 20, "compute"), ("free", 1, 0, "compute")])
    peak.allocated_peak, peak.reserved_peak, peak.ratio     # 5 MiB, 20 MiB, 4.0

A training step's tensors (``allocated``, ``torch.cuda.max_memory_allocated``) are not what runs out:
the allocator keeps freed memory cached in the segments it took from ``cudaMalloc`` and hands it out
again only where a request fits, so what it holds (``reserved``, ``torch.cuda.max_memory_reserved``) is
larger, and an OOM comes when *that* reaches the card. ``replay`` runs a model of the allocator of
``c10/cuda/CUDACachingAllocator.cpp`` (default settings, one device) over the events of a simulated
step and reports both peaks. On an H100, max reserved / max allocated measured 1.26 for Llama-3-8B
(world 8, FSDP) and 1.06 for Llama-3.2-1B; this model is not yet checked against those runs.

Events are ``("alloc", key, nbytes, stream)`` and ``("free", key, 0, stream)``; a key names one live
allocation and may be used again after its free. The stream of a free is not used: as in torch, a block
goes back to the pool of the stream that allocated it (FSDP frees an all-gather output on the compute
stream that the all-gather stream allocated; the memory stays the all-gather stream's).

[Note: the caching allocator's rules]
1. Rounding. A request of n bytes becomes ``round_size(n)``: 512 below 512, else n rounded up to a
   multiple of 512. A 0-byte tensor takes no memory (torch returns a null pointer without a block).
2. Pools. Blocks of at most 1 MiB (rounded) live in a small pool, larger ones in a large pool, and
   each pool is kept per stream: a block freed by stream s serves only later requests of stream s.
3. Best fit. A request takes the smallest free block of its stream and pool whose size is at least
   the request, the lowest address among equal sizes (torch's set is ordered by stream, size, ptr).
4. New segments. With no block that fits, one ``cudaMalloc`` of ``segment_size(size)``: 2 MiB for a
   small request, 20 MiB for a large one under 10 MiB, else the size rounded up to 2 MiB. Its
   addresses are this model's own, above every earlier segment's.
5. Splitting. The block handed out is split when what remains is worth keeping: at least 512 bytes
   in the small pool, more than 1 MiB in the large one; the remainder stays free in the pool.
   Otherwise the whole block is handed out, and torch counts the whole block as allocated:
   ``alloc_found_block`` adds ``block->size`` to ``allocated_bytes`` (the request goes to
   ``requested_bytes``, which ``max_memory_allocated`` does not report). An 11 MiB request in a new
   12 MiB segment is 12 MiB allocated here, as there.
6. Freeing. A freed block merges with a free neighbour on either side in its segment (blocks of one
   segment never merge with another's), then returns to its pool.
7. Segments are never released: reserved only grows, so its peak is its final value.

[Note: expandable segments]
With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` torch keeps one growing segment per stream
and pool, maps physical pages onto its end as requests need them, and splits every block whose
remainder is at least 512 bytes, so a block's allocated size is its rounded request. The page is the
segment's granularity: ``kSmallBuffer`` (2 MiB) for the small pool and ``kLargeBuffer`` (20 MiB) for the
large one (``find_expandable_block``: ``segment_size = pool->is_small ? kSmallBuffer : kLargeBuffer``;
``ExpandableSegment::map`` rounds a range out to it). The model here is simpler than the segment: each
(stream, pool) maps ``ceil(live bytes / page)`` pages at its most, where live bytes are that pool's
rounded requests alive at once, as if a freed block's bytes could serve any later block of its stream
and pool. A real segment can still hold a free hole in its middle too small for the next request and
map past it; that fragmentation is left out, so this is a lower bound on what torch reserves (live
blocks never overlap and pages are never unmapped here), and it shows what expandable segments
remove: the holes between fixed-size segments.

Left out: the garbage-collection threshold and per-process memory fraction; the OOM path (freeing one
cached block, then all unsplit ones, and retrying ``cudaMalloc``) and ``empty_cache``, so a replay
never shrinks reserved; ``max_split_size_mb`` (oversize blocks that are never split) and
``roundup_power2_divisions``; CUDA graph private pools; ``record_stream``'s deferred frees (a block
used on another stream is freed here at once, not when that stream's event completes); ``cudaMalloc``'s
own alignment and the driver's memory outside the allocator.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of this
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request served from the small pool
SMALL_SEGMENT = 2 << 20  # kSmallBuffer: a small pool segment, and a small expandable page
LARGE_SEGMENT = 20 << 20  # kLargeBuffer: the segment for 1-10 MiB requests, and a large expandable page
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here a segment is the request rounded to ROUND_LARGE
ROUND_LARGE = 2 << 20  # kRoundLarge

Event = tuple[str, Hashable, int, str]


@dataclass(frozen=True)
class AllocatorPeak:
    """What the allocator held over a replay: the peaks torch reports and the segments behind them."""

    allocated_peak: int  # max over time of bytes in live blocks (torch.cuda.max_memory_allocated)
    reserved_peak: int  # max over time of bytes in segments (torch.cuda.max_memory_reserved)
    segments: int  # segments created (expandable: one per stream and pool that mapped a page)
    largest_segment: int  # bytes of the largest segment (expandable: the most pages one mapped)
    by_stream: dict[str, int]  # stream -> bytes reserved for it at the end (every stream that reserved)

    @property
    def ratio(self) -> float:
        """reserved_peak / allocated_peak: what the cache adds on top of the tensors (1.0 if none)."""
        return self.reserved_peak / self.allocated_peak if self.allocated_peak else 1.0


def round_size(nbytes: int) -> int:
    """Rule 1: the bytes a request of ``nbytes`` occupies, 512 at least (``round_size`` in torch)."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """Rule 4: the ``cudaMalloc`` for a rounded request that no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def replay(events: Iterable[Event], expandable_segments: bool = False) -> AllocatorPeak:
    """Run the allocator model over ``events`` in order and report its peaks.

    ``events``: ``("alloc", key, nbytes, stream)`` or ``("free", key, 0, stream)``; a key is unique among
    live allocations and may come back after its free. ``expandable_segments``: model
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` ([Note: expandable segments]).
    Raises ``ValueError`` naming the event for a free of a key that is not live, an alloc of a key that
    is, an unknown kind, a negative size or an event that is not four fields."""
    allocator: _CachingAllocator | _ExpandableAllocator
    allocator = _ExpandableAllocator() if expandable_segments else _CachingAllocator()
    for index, event in enumerate(events):
        try:
            kind, key, nbytes, stream = event
        except (TypeError, ValueError):
            raise ValueError(f"event {index} is {event!r}: expected (kind, key, nbytes, stream)") from None
        if kind == "alloc":
            if key in allocator.live:
                raise ValueError(f"event {index}: alloc of key {key!r}, which is already live (not freed)")
            if nbytes < 0:
                raise ValueError(f"event {index}: alloc of key {key!r} with nbytes={nbytes}; expected >= 0")
            allocator.alloc(key, nbytes, stream)
        elif kind == "free":
            if key not in allocator.live:
                raise ValueError(f"event {index}: free of key {key!r}, which is not live (never allocated or freed)")
            allocator.free(key)
        else:
            raise ValueError(f"event {index}: kind {kind!r}; expected 'alloc' or 'free'")
    return allocator.peak()


# ---- the caching allocator (rules 1-7) ------------------------------------------------------------
class _Block:
    """A contiguous range of one segment, live or free; ``prev``/``next`` are its segment neighbours."""

    __slots__ = ("addr", "size", "pool", "prev", "next", "free")

    addr: int
    size: int
    pool: _Pool
    prev: _Block | None
    next: _Block | None
    free: bool

    def __init__(self, addr: int, size: int, pool: _Pool, before: _Block | None, after: _Block | None) -> None:
        self.addr, self.size, self.pool, self.prev, self.next, self.free = addr, size, pool, before, after, False


class _Pool:
    """The free blocks of one stream's small or large pool, ordered by (size, address) for best fit."""

    __slots__ = ("small", "order", "blocks")

    small: bool
    order: list[tuple[int, int]]  # (size, addr) of every free block, sorted
    blocks: dict[int, _Block]  # addr -> free block

    def __init__(self, small: bool) -> None:
        self.small, self.order, self.blocks = small, [], {}

    def take_best_fit(self, size: int) -> _Block | None:
        """Rule 3: remove and return the smallest free block of at least ``size`` bytes, if any."""
        i = bisect.bisect_left(self.order, (size, -1))
        if i == len(self.order):
            return None
        _, addr = self.order.pop(i)
        block = self.blocks.pop(addr)
        block.free = False
        return block

    def put(self, block: _Block) -> None:
        block.free = True
        bisect.insort(self.order, (block.size, block.addr))
        self.blocks[block.addr] = block

    def remove(self, block: _Block) -> None:
        i = bisect.bisect_left(self.order, (block.size, block.addr))
        if i == len(self.order) or self.order[i] != (block.size, block.addr):
            raise RuntimeError(f"free block at {block.addr} of {block.size} bytes is missing from its pool")
        del self.order[i]
        del self.blocks[block.addr]
        block.free = False


class _CachingAllocator:
    """Fixed segments from ``cudaMalloc``, split and merged in place ([Note: the caching allocator's rules])."""

    live: dict[Hashable, _Block | None]  # key -> its block (None: a 0-byte tensor, no block)
    pools: dict[tuple[str, bool], _Pool]  # (stream, small) -> pool
    reserved: dict[str, int]  # stream -> bytes of its segments
    allocated: int
    allocated_peak: int
    segments: int
    largest_segment: int
    next_addr: int  # where the next segment starts in this model's address space

    def __init__(self) -> None:
        self.live, self.pools, self.reserved = {}, {}, {}
        self.allocated = self.allocated_peak = self.segments = self.largest_segment = self.next_addr = 0

    def alloc(self, key: Hashable, nbytes: int, stream: str) -> None:
        if nbytes == 0:
            self.live[key] = None
            return
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self.pools.get((stream, small))
        if pool is None:
            pool = self.pools[(stream, small)] = _Pool(small)
        block = pool.take_best_fit(size) or self._new_segment(pool, stream, segment_size(size))
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:  # rule 5: split off the rest
            rest = _Block(block.addr + size, remaining, pool, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            pool.put(rest)
        self.live[key] = block
        self.allocated += block.size  # the whole block, as torch's allocated_bytes counts it
        self.allocated_peak = max(self.allocated_peak, self.allocated)

    def _new_segment(self, pool: _Pool, stream: str, nbytes: int) -> _Block:
        block = _Block(self.next_addr, nbytes, pool, None, None)
        self.next_addr += nbytes
        self.reserved[stream] = self.reserved.get(stream, 0) + nbytes
        self.segments += 1
        self.largest_segment = max(self.largest_segment, nbytes)
        return block

    def free(self, key: Hashable) -> None:
        block = self.live.pop(key)
        if block is None:
            return
        self.allocated -= block.size
        pool = block.pool
        before, after = block.prev, block.next
        if before is not None and before.free:  # rule 6: [before][block] -> [block]
            pool.remove(before)
            block.addr, block.size, block.prev = before.addr, before.size + block.size, before.prev
            if block.prev is not None:
                block.prev.next = block
        if after is not None and after.free:  # [block][after] -> [block]
            pool.remove(after)
            block.size, block.next = block.size + after.size, after.next
            if block.next is not None:
                block.next.prev = block
        pool.put(block)

    def peak(self) -> AllocatorPeak:
        return AllocatorPeak(
            allocated_peak=self.allocated_peak,
            reserved_peak=sum(self.reserved.values()),  # rule 7: nothing is released, the end is the peak
            segments=self.segments,
            largest_segment=self.largest_segment,
            by_stream=dict(self.reserved),
        )


# ---- expandable segments ------------------------------------------------------------------------
class _ExpandableAllocator:
    """One segment per (stream, pool) mapping pages up to its live bytes' peak ([Note: expandable segments])."""

    live: dict[Hashable, tuple[tuple[str, bool], int] | None]  # key -> ((stream, small), bytes)
    live_bytes: dict[tuple[str, bool], int]  # (stream, small) -> bytes of its live blocks
    mapped: dict[tuple[str, bool], int]  # (stream, small) -> bytes of pages mapped
    allocated: int
    allocated_peak: int

    def __init__(self) -> None:
        self.live, self.live_bytes, self.mapped = {}, {}, {}
        self.allocated = self.allocated_peak = 0

    def alloc(self, key: Hashable, nbytes: int, stream: str) -> None:
        if nbytes == 0:
            self.live[key] = None
            return
        size = round_size(nbytes)  # every remainder is split off: the block is the rounded request
        segment = (stream, size <= SMALL_SIZE)
        self.live[key] = (segment, size)
        live = self.live_bytes[segment] = self.live_bytes.get(segment, 0) + size
        page = SMALL_SEGMENT if segment[1] else LARGE_SEGMENT
        self.mapped[segment] = max(self.mapped.get(segment, 0), -(-live // page) * page)
        self.allocated += size
        self.allocated_peak = max(self.allocated_peak, self.allocated)

    def free(self, key: Hashable) -> None:
        entry = self.live.pop(key)
        if entry is None:
            return
        segment, size = entry
        self.live_bytes[segment] -= size
        self.allocated -= size

    def peak(self) -> AllocatorPeak:
        by_stream: dict[str, int] = {}
        for (stream, _), nbytes in self.mapped.items():
            by_stream[stream] = by_stream.get(stream, 0) + nbytes
        return AllocatorPeak(
            allocated_peak=self.allocated_peak,
            reserved_peak=sum(self.mapped.values()),  # pages are never unmapped: the end is the peak
            segments=len(self.mapped),
            largest_segment=max(self.mapped.values(), default=0),
            by_stream=by_stream,
        )
