"""SlotPool: LRU with pins, deterministic slot choice, counters."""

import random

import pytest

from dsflash.runtime.experts.slots import SlotPool, SlotsExhausted


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
    pool.zero_counters()  # counting afresh keeps what is resident
    assert pool.counters() == {"hits": 0, "misses": 0, "evictions": 0, "resident": 2}
    assert pool.acquire("a") == (0, True)


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


def test_cold_misses_keep_repeated_scans_hitting():
    """4 layers x 32 experts through 96 slots, every expert of every layer each pass (a prefill): plain LRU evicts
    what the next pass needs first and never hits; misses inserted cold keep two layers resident."""

    def passes(cold: bool) -> list[int]:
        pool, hits = SlotPool(96), []
        for _ in range(4):
            before = pool.hits
            for layer in range(4):
                keys = [(layer, e) for e in range(32)]
                for k in keys:
                    pool.acquire(k, cold)
                for k in keys:
                    pool.release(k)
            hits.append(pool.hits - before)
        return hits

    assert passes(cold=False) == [0, 0, 0, 0]
    assert passes(cold=True) == [0, 64, 64, 64]


def test_cold_miss_leaves_first_but_a_hit_warms_it():
    pool = SlotPool(2)
    pool.acquire("a"), pool.release("a")
    pool.acquire("b", cold=True), pool.release("b")
    assert pool.acquire("c") == (1, False)  # b, the cold one, goes before the older a
    pool.release("c")
    assert pool.acquire("d", cold=True) == (0, False)  # a is now the LRU; d takes its slot, cold
    pool.release("d")
    assert pool.acquire("d") == (0, True)  # the hit makes d the most recent...
    pool.release("d")
    assert pool.acquire("e") == (1, False)  # ...so c goes next, not d
