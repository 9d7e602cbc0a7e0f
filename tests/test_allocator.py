"""estimate.allocator: the caching allocator model's rules on small replays with bytes derived by hand,
expandable segments, bad events, and parity with a plain list-scanning model on random replays."""

from __future__ import annotations

import random

import pytest

from fsdp2lite.estimate.allocator import AllocatorPeak, replay, round_size, segment_size

KiB = 1 << 10
MiB = 1 << 20


def _allocs(*sizes: int, stream: str = "compute", first_key: int = 0) -> list[tuple[str, int, int, str]]:
    return [("alloc", first_key + i, size, stream) for i, size in enumerate(sizes)]


def _frees(*keys: int, stream: str = "compute") -> list[tuple[str, int, int, str]]:
    return [("free", key, 0, stream) for key in keys]


# ---- rounding and new segments ------------------------------------------------------------------
def test_round_size_and_segment_size() -> None:
    assert [round_size(n) for n in (1, 511, 512, 513, 1536)] == [512, 512, 512, 1024, 1536]
    assert segment_size(512) == segment_size(MiB) == 2 * MiB  # small pool: up to 1 MiB
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB  # 1-10 MiB share 20 MiB
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(100 * MiB + 512) == 102 * MiB  # rounded up to 2 MiB


def test_nothing_allocated() -> None:
    assert replay([]) == AllocatorPeak(0, 0, 0, 0, {})
    assert replay([]).ratio == 1.0


def test_one_byte_takes_512_bytes_of_a_2_mib_segment() -> None:
    # 1 -> 512 (rule 1); small pool -> new 2 MiB segment, split: [512 live][2 MiB - 512 free]
    peak = replay(_allocs(1))
    assert peak == AllocatorPeak(512, 2 * MiB, 1, 2 * MiB, {"compute": 2 * MiB})
    assert peak.ratio == 4096.0


def test_zero_bytes_take_no_memory() -> None:
    peak = replay(_allocs(0) + _frees(0))
    assert (peak.allocated_peak, peak.reserved_peak, peak.segments) == (0, 0, 0)


def test_request_of_5_mib_takes_a_20_mib_segment() -> None:
    # 5 MiB is large and < 10 MiB -> 20 MiB segment; remainder 15 MiB > 1 MiB: split off
    peak = replay(_allocs(5 * MiB))
    assert peak == AllocatorPeak(5 * MiB, 20 * MiB, 1, 20 * MiB, {"compute": 20 * MiB})
    assert peak.ratio == 4.0


def test_request_over_100_mib_rounds_its_segment_to_2_mib() -> None:
    # 100 MiB + 1 -> 100 MiB + 512; segment 102 MiB; remainder 2 MiB - 512 > 1 MiB: split, 100 MiB + 512 live
    peak = replay(_allocs(100 * MiB + 1))
    assert peak == AllocatorPeak(100 * MiB + 512, 102 * MiB, 1, 102 * MiB, {"compute": 102 * MiB})


def test_unsplit_block_counts_whole_as_allocated() -> None:
    # 11 MiB -> 12 MiB segment; remainder 1 MiB is not > 1 MiB: the whole 12 MiB is handed out and counted
    assert replay(_allocs(11 * MiB)).allocated_peak == 12 * MiB
    # 1 MiB + 1 is large (-> 1 MiB + 512 > 1 MiB): a 20 MiB segment, not a 2 MiB one
    assert replay(_allocs(MiB + 1)).reserved_peak == 20 * MiB


def test_small_pool_packs_into_2_mib_segments() -> None:
    # 1 MiB (small) -> [1 MiB live][1 MiB free]; the next 1 MiB takes the rest whole (remainder 0);
    # a third request finds nothing free: a second 2 MiB segment
    assert replay(_allocs(MiB, MiB)) == AllocatorPeak(2 * MiB, 2 * MiB, 1, 2 * MiB, {"compute": 2 * MiB})
    assert replay(_allocs(MiB, MiB, 1)).reserved_peak == 4 * MiB
    # small-pool splits keep remainders of 512 bytes: 2 MiB - 512 then 512 fill one segment exactly
    assert replay(_allocs(2 * MiB - 512 - MiB, MiB, 512)).segments == 1


def test_small_and_large_pools_do_not_share() -> None:
    # a freed 5 MiB block (in a 20 MiB segment, large pool) does not serve a 4 KiB request (small pool)
    peak = replay(_allocs(5 * MiB) + _frees(0) + _allocs(4 * KiB, first_key=1))
    assert (peak.reserved_peak, peak.segments) == (22 * MiB, 2)


# ---- best fit, splitting, merging -----------------------------------------------------------------
def test_best_fit_takes_the_smallest_block_that_fits() -> None:
    # three exact segments (>= 10 MiB: rounded to 2 MiB, remainder 0), created 12, 16, 14 MiB, all freed
    events = _allocs(12 * MiB, 16 * MiB, 14 * MiB) + _frees(0, 1, 2)
    # 13 MiB -> best fit 14 (remainder 1 MiB: handed out whole); 15 MiB -> 16 (whole); 12 -> 12
    # first fit by address or largest first would hand 16 to the 13 MiB request and need a new segment
    events += _allocs(13 * MiB, 15 * MiB, 12 * MiB, first_key=3)
    peak = replay(events)
    assert (peak.reserved_peak, peak.segments) == (42 * MiB, 3)
    assert peak.allocated_peak == 42 * MiB  # 14 + 16 + 12: whole blocks, as at the start


def test_split_block_serves_later_requests() -> None:
    # a=5 MiB: new 20 MiB segment [a 5][free 15]; b=5 MiB from the 15: [a 5][b 5][free 10]
    events = _allocs(5 * MiB, 5 * MiB) + _frees(0)  # [free 5][b 5][free 10]
    # c=4 MiB: best fit is the free 5 (not the 10); remainder 1 MiB is not > 1 MiB: c holds all 5 MiB
    # d=8 MiB: the free 10, split ([d 8][free 2]); live: c 5 + b 5 + d 8 = 18 MiB, still one segment
    events += _allocs(4 * MiB, 8 * MiB, first_key=2)
    assert replay(events) == AllocatorPeak(18 * MiB, 20 * MiB, 1, 20 * MiB, {"compute": 20 * MiB})


def test_freed_blocks_merge_with_both_neighbours() -> None:
    # a, b, c = 4 MiB each from one 20 MiB segment: [a 4][b 4][c 4][free 8]
    events = _allocs(4 * MiB, 4 * MiB, 4 * MiB) + _frees(0, 2)  # [free 4][b 4][free 4 + 8 = 12]
    # 11 MiB fits only the merged 12 (c with the free block after it); remainder 1 MiB: all 12 handed out
    events += _allocs(11 * MiB, first_key=3) + _frees(1)  # b merges with the free 4 before it: [free 8][x 12]
    # 7 MiB fits only the merged 8; remainder 1 MiB: all 8 handed out -> live 8 + 12 = 20 MiB
    events += _allocs(7 * MiB, first_key=4)
    assert replay(events) == AllocatorPeak(20 * MiB, 20 * MiB, 1, 20 * MiB, {"compute": 20 * MiB})


def test_a_whole_freed_segment_serves_a_request_of_its_size() -> None:
    # 4 x 5 MiB fill one 20 MiB segment (the last takes the final 5 whole); all freed merge back to 20
    events = _allocs(5 * MiB, 5 * MiB, 5 * MiB, 5 * MiB) + _frees(1, 3, 0, 2) + _allocs(20 * MiB, first_key=4)
    peak = replay(events)
    assert (peak.allocated_peak, peak.reserved_peak, peak.segments) == (20 * MiB, 20 * MiB, 1)


def test_segments_do_not_merge_with_each_other() -> None:
    # two 10 MiB segments, both freed: adjacent addresses in this model, but two segments -> 20 MiB is new
    events = _allocs(10 * MiB, 10 * MiB) + _frees(0, 1) + _allocs(20 * MiB, first_key=2)
    peak = replay(events)
    assert (peak.reserved_peak, peak.segments, peak.largest_segment) == (40 * MiB, 3, 20 * MiB)


# ---- streams ------------------------------------------------------------------------------------
def test_streams_keep_their_own_blocks() -> None:
    same = _allocs(5 * MiB, stream="ag") + _frees(0, stream="ag") + _allocs(5 * MiB, stream="ag", first_key=1)
    assert replay(same).reserved_peak == 20 * MiB  # the freed block is reused
    other = _allocs(5 * MiB, stream="ag") + _frees(0, stream="ag") + _allocs(5 * MiB, first_key=1)
    peak = replay(other)  # "compute" may not take "ag"'s block: a second segment
    assert (peak.reserved_peak, peak.segments) == (40 * MiB, 2)
    assert peak.by_stream == {"ag": 20 * MiB, "compute": 20 * MiB}
    assert peak.ratio == 8.0  # 40 MiB reserved for 5 MiB live at once


def test_a_block_returns_to_the_stream_that_allocated_it() -> None:
    # allocated on "ag", freed from "compute" (FSDP's all-gather output): the block stays "ag"'s
    events = _allocs(5 * MiB, stream="ag") + _frees(0, stream="compute")
    assert replay(events + _allocs(5 * MiB, stream="ag", first_key=1)).segments == 1
    assert replay(events + _allocs(5 * MiB, stream="compute", first_key=1)).segments == 2


# ---- fragmentation and expandable segments ------------------------------------------------------
def test_holes_between_live_blocks_fragment_and_expandable_segments_remove_it() -> None:
    # 5 x 4 MiB fill one 20 MiB segment: [a 4][b 4][c 4][d 4][e 4]; free a, c, e: three 4 MiB holes
    events = _allocs(*[4 * MiB] * 5) + _frees(0, 2, 4)
    events += _allocs(8 * MiB, first_key=5)  # 8 MiB fits no hole: a new 20 MiB segment
    peak = replay(events)
    assert (peak.allocated_peak, peak.reserved_peak, peak.segments) == (20 * MiB, 40 * MiB, 2)
    assert peak.ratio == 2.0
    # expandable: live bytes peak at 20 MiB (then 4 + 4 + 8 = 16): one 20 MiB page of the large pool
    expandable = replay(events, expandable_segments=True)
    assert expandable == AllocatorPeak(20 * MiB, 20 * MiB, 1, 20 * MiB, {"compute": 20 * MiB})
    assert expandable.ratio == 1.0


def test_expandable_segments_grow_by_pages_per_stream_and_pool() -> None:
    # large pool pages are 20 MiB, small pool pages 2 MiB; one segment per (stream, pool)
    events = _allocs(5 * MiB, 1) + _allocs(5 * MiB, stream="ag", first_key=2)
    peak = replay(events, expandable_segments=True)
    assert peak == AllocatorPeak(10 * MiB + 512, 42 * MiB, 3, 20 * MiB, {"compute": 22 * MiB, "ag": 20 * MiB})
    # a growing request reuses the freed bytes: 30 MiB freed, then 35 MiB -> 35 rounds up to 40 MiB mapped
    # (fixed segments: 30 MiB, then a new 36 MiB one)
    growing = _allocs(30 * MiB) + _frees(0) + _allocs(35 * MiB, first_key=1)
    assert replay(growing, expandable_segments=True).reserved_peak == 40 * MiB
    assert replay(growing).reserved_peak == 66 * MiB


def test_expandable_segments_count_rounded_requests_as_allocated() -> None:
    # every remainder of 512 bytes or more is split off: 11 MiB is 11 MiB allocated, not a 12 MiB block
    peak = replay(_allocs(11 * MiB), expandable_segments=True)
    assert (peak.allocated_peak, peak.reserved_peak) == (11 * MiB, 20 * MiB)


# ---- bad events ---------------------------------------------------------------------------------
@pytest.mark.parametrize("expandable", [False, True])
def test_bad_events_name_the_key(expandable: bool) -> None:
    with pytest.raises(ValueError, match=r"event 1: free of key 7, which is not live"):
        replay(_allocs(MiB) + _frees(7), expandable_segments=expandable)
    with pytest.raises(ValueError, match=r"event 2: free of key 0, which is not live"):
        replay(_allocs(MiB) + _frees(0, 0), expandable_segments=expandable)
    with pytest.raises(ValueError, match=r"event 1: alloc of key 'w', which is already live"):
        replay([("alloc", "w", 8, "compute"), ("alloc", "w", 8, "compute")], expandable_segments=expandable)
    with pytest.raises(ValueError, match=r"event 0: alloc of key 3 with nbytes=-1; expected >= 0"):
        replay([("alloc", 3, -1, "compute")], expandable_segments=expandable)
    with pytest.raises(ValueError, match=r"event 0: kind 'malloc'; expected 'alloc' or 'free'"):
        replay([("malloc", 3, 8, "compute")], expandable_segments=expandable)
    with pytest.raises(ValueError, match=r"event 0 is \('alloc', 3, 8\): expected \(kind, key, nbytes, stream\)"):
        replay([("alloc", 3, 8)], expandable_segments=expandable)  # type: ignore[list-item]


def test_a_key_may_come_back_after_its_free() -> None:
    peak = replay(_allocs(5 * MiB) + _frees(0) + _allocs(5 * MiB) + _frees(0))
    assert (peak.allocated_peak, peak.reserved_peak) == (5 * MiB, 20 * MiB)


# ---- parity with a plain model ------------------------------------------------------------------
def _reference_replay(events: list[tuple[str, int, int, str]]) -> tuple[int, int, int]:
    """The same rules written as plainly as possible: segments are lists of [size, free] blocks, best fit
    is a scan over all of them. Returns (allocated peak, reserved, segments)."""
    segments: list[tuple[str, bool, list[list]]] = []  # (stream, small, blocks in address order)
    live: dict[int, list] = {}
    allocated = allocated_peak = reserved = 0
    for kind, key, nbytes, stream in events:
        if kind == "free":
            block = live.pop(key)
            allocated -= block[0]
            block[1] = True
            for _, _, blocks in segments:
                merged: list[list] = []
                for b in blocks:
                    if merged and merged[-1][1] and b[1]:
                        merged[-1][0] += b[0]
                    else:
                        merged.append(b)
                blocks[:] = merged
            continue
        size = max(512, -(-nbytes // 512) * 512)
        small = size <= MiB
        fits = [
            (b[0], i, j)
            for i, (s, sm, blocks) in enumerate(segments)
            if s == stream and sm == small
            for j, b in enumerate(blocks)
            if b[1] and b[0] >= size
        ]
        if fits:
            _, i, j = min(fits)  # smallest; among equal sizes the earlier segment, then the lower address
        else:
            total = 2 * MiB if small else 20 * MiB if size < 10 * MiB else -(-size // (2 * MiB)) * 2 * MiB
            segments.append((stream, small, [[total, True]]))
            reserved += total
            i, j = len(segments) - 1, 0
        blocks = segments[i][2]
        block = blocks[j]
        rest = block[0] - size
        if rest >= 512 if small else rest > MiB:
            block[0] = size
            blocks.insert(j + 1, [rest, True])
        block[1] = False
        live[key] = block
        allocated += block[0]
        allocated_peak = max(allocated_peak, allocated)
    return allocated_peak, reserved, len(segments)


def _random_events(seed: int, n: int) -> list[tuple[str, int, int, str]]:
    rng = random.Random(seed)
    sizes = [100, 4 * KiB, 300 * KiB, MiB, MiB + 1, 3 * MiB, 7 * MiB, 11 * MiB, 19 * MiB, 41 * MiB]
    live: list[tuple[int, str]] = []
    events: list[tuple[str, int, int, str]] = []
    for key in range(n):
        if live and rng.random() < 0.5:
            freed, stream = live.pop(rng.randrange(len(live)))
            events.append(("free", freed, 0, stream))
        stream = rng.choice(["compute", "ag"])
        events.append(("alloc", key, rng.choice(sizes) + rng.randrange(3 * KiB), stream))
        live.append((key, stream))
    return events


@pytest.mark.parametrize("seed", range(4))
def test_matches_a_plain_model_on_random_replays(seed: int) -> None:
    events = _random_events(seed, 400)
    peak = replay(events)
    assert (peak.allocated_peak, peak.reserved_peak, peak.segments) == _reference_replay(events)
    assert sum(peak.by_stream.values()) == peak.reserved_peak >= peak.allocated_peak
