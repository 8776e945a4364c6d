"""Slot replacement policies of the simulator."""

import pytest

from dsflash.sim.cache import LFU, LRU, Pinned, make_cache


def test_lru_evicts_least_recent():
    c = LRU(3)
    assert c.access([1, 2, 3]) == [1, 2, 3]
    assert c.access([1]) == []  # 1 is now most recent
    assert c.access([4]) == [4]  # evicts 2
    assert 2 not in c and 1 in c and 3 in c
    assert c.misses == 4


def test_a_call_never_evicts_its_own_keys():
    c = LRU(3)
    c.access([1, 2, 3])
    assert c.access([1, 5, 6]) == [5, 6]  # 2 and 3 go, never 1 (hit in the same call)
    assert 1 in c and 5 in c and 6 in c
    with pytest.raises(RuntimeError):
        c.access([7, 8, 9, 10])


def test_lfu_keeps_frequent_keys():
    c = LFU(2)
    for _ in range(3):
        c.access([1])
    c.access([2])
    c.access([3])  # 2 (count 1) goes, not 1 (count 3)
    assert 1 in c and 3 in c and 2 not in c
    c.access([4])  # 3 has count 1, older than 4: 3 goes
    assert 3 not in c and 1 in c
    for k in range(10, 200):  # many stale heap entries: the heap is rebuilt without losing anyone
        c.access([k])
    assert 1 in c and c.misses == 1 + 1 + 1 + 1 + 190


def test_lfu_protects_the_call():
    c = LFU(2)
    c.access([1, 1, 1])
    c.access([2])
    assert c.access([3, 2]) == [3]  # 2 has the lowest count but is in the call, so 1 goes
    assert 2 in c and 3 in c and 1 not in c


def test_pinned():
    c = Pinned(4, [7, 8])
    assert c.access([7, 8, 1, 2]) == [1, 2]
    c.access([3])
    assert 7 in c and 8 in c and 1 not in c
    with pytest.raises(ValueError):
        Pinned(2, [1, 2])


def test_make_cache():
    assert isinstance(make_cache("lru", 4, [0, 1]), LRU)
    assert isinstance(make_cache("lfu", 4, [0, 1]), LFU)
    pinned = make_cache("pinned", 4, [9, 8, 7, 6], pinned_share=0.5)
    assert pinned.pinned == {9, 8}
    with pytest.raises(ValueError):
        make_cache("fifo", 4, [])


def test_cold_scans_match_the_engine_pool():
    """The simulator's cold-insertion LRU makes the same choices as the engine's SlotPool on repeated scans."""
    from dsflash.runtime.experts.slots import SlotPool

    sim, pool = make_cache("lru-cold", 96, hot_order=[]), SlotPool(96)
    for _ in range(3):
        for layer in range(4):
            keys = [layer * 32 + e for e in range(32)]
            missed = sim.access(keys, scan=True)
            got = [pool.acquire(k, cold=True) for k in keys]
            for k in keys:
                pool.release(k)
            assert missed == [k for k, (_, hit) in zip(keys, got, strict=True) if not hit]
    assert sim.misses == pool.misses == 3 * 128 - 2 * 64
