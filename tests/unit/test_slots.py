"""SlotPool: LRU with pins, deterministic slot choice, counters."""

import random

import pytest

from dsflash.runtime.slots import SlotPool, SlotsExhausted


def test_lru_eviction_and_counters():
    pool = SlotPool(2)
    assert pool.acquire("a") == (0, False)
    assert pool.acquire("b") == (1, False)
    pool.release("a"), pool.release("b")
    assert pool.acquire("a") == (0, True)  # a is now the most recent
    pool.release("a")
    assert pool.acquire("c") == (1, False)  # so b (least recent) is evicted and c takes its slot
    pool.release("c")
    assert "b" not in pool and pool.slot_of("a") == 0
    assert pool.counters() == {"hits": 1, "misses": 3, "evictions": 1, "resident": 2}


def test_pinned_slots_are_never_evicted():
    pool = SlotPool(2)
    pool.acquire("a")  # stays pinned
    pool.acquire("b")
    pool.release("b")
    assert pool.acquire("c") == (1, False)  # b goes, not the older but pinned a
    with pytest.raises(SlotsExhausted):
        pool.acquire("d")  # a and c are both pinned


def test_same_calls_give_same_slots():
    """Ranks agree on slots without talking: the pool is a pure function of the call sequence."""
    rng = random.Random(0)
    calls = [rng.randrange(20) for _ in range(500)]

    def run():
        pool, out = SlotPool(7), []
        for k in calls:
            out.append(pool.acquire(k))
            pool.release(k)
        return out

    assert run() == run()


def test_forget_frees_the_slot_of_an_expert_that_never_arrived():
    pool = SlotPool(2)
    slot, _ = pool.acquire("a")
    pool.forget("a")  # its copy failed
    assert "a" not in pool and pool.acquire("b") == (slot, False)
