"""SlotPool: which expert sits in which device slot. LRU with pins; no I/O, no torch.

Every rank runs the same sequence of calls (the router is replicated), and every decision here is a pure
function of that sequence, so all ranks pick the same slots without exchanging a message.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class SlotsExhausted(RuntimeError):
    """Every slot is pinned: the caller asked for more experts at once than the pool holds."""


class SlotPool:
    def __init__(self, n_slots: int):
        if n_slots < 1:
            raise ValueError("the expert slot pool needs at least one slot")
        self.n_slots = n_slots
        self._lru: OrderedDict[Hashable, int] = OrderedDict()  # least recently used first
        self._free = list(range(n_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._pins: dict[Hashable, int] = {}
        self.hits = self.misses = self.evictions = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def slot_of(self, key: Hashable) -> int | None:
        return self._lru.get(key)

    def acquire(self, key: Hashable, cold: bool = False) -> tuple[int, bool]:
        """(slot, hit) for key, pinned; a miss takes a free or the LRU unpinned slot. A hit becomes the most recently
        used; so does a miss, unless `cold`: then it goes in as the least recently used, first to leave once
        unpinned. That keeps a scan (a prefill chunk reading most of every layer's experts, layer after layer) from
        flushing the pool: under plain LRU, when slots < experts a scan touches, every layer evicts exactly the
        experts the next pass needs first and a repeated scan never hits."""
        slot = self._lru.get(key)
        hit = slot is not None
        if hit:
            self.hits += 1
            self._lru.move_to_end(key)
        else:
            self.misses += 1
            slot = self._free.pop() if self._free else self._evict()
            self._lru[key] = slot
            if cold:
                self._lru.move_to_end(key, last=False)
        self._pins[key] = self._pins.get(key, 0) + 1
        return slot, hit

    def release(self, key: Hashable) -> None:
        n = self._pins[key] - 1
        if n:
            self._pins[key] = n
        else:
            del self._pins[key]

    def forget(self, key: Hashable) -> None:
        """Drop a key whose slot never received its expert (a failed copy): its slot is free again."""
        slot = self._lru.pop(key, None)
        self._pins.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def _evict(self) -> int:
        for key, slot in self._lru.items():
            if key not in self._pins:
                del self._lru[key]
                self.evictions += 1
                return slot
        raise SlotsExhausted(f"all {self.n_slots} expert slots are pinned")

    def zero_counters(self) -> None:
        """Start counting afresh (which experts are resident is unchanged)."""
        self.hits = self.misses = self.evictions = 0

    def counters(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "resident": len(self._lru)}
