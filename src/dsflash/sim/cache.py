"""Device expert-slot replacement policies over integer keys (layer * experts + expert). No timing here.

`access(keys, scan)` makes every key of one MoE call resident and returns the ones that had to be copied in; the keys
of the call are protected while it runs (the engine pins them), so a call never evicts its own experts. `scan` marks
a prefill chunk's call, which only the cold-insertion LRU (the engine's runtime.experts.slots.SlotPool) treats apart.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class LRU:
    """cold_scans: a scan's misses enter as least recently used (first to go once the call ends), as the engine
    does; plain LRU otherwise."""

    def __init__(self, slots: int, cold_scans: bool = False):
        self.slots, self.cold_scans = slots, cold_scans
        self._d: dict[int, None] = {}  # insertion order = recency, least recent first
        self.misses = 0

    def __contains__(self, key: int) -> bool:
        return key in self._d

    def access(self, keys: Iterable[int], scan: bool = False) -> list[int]:
        d = self._d
        missing = []
        for k in keys:
            if k in d:
                del d[k]
                d[k] = None
            else:
                missing.append(k)
        protect = None
        for k in missing:
            if len(d) >= self.slots:
                protect = protect or set(keys)
                self._evict(protect)
            d[k] = None
        if scan and self.cold_scans and missing:  # rebuild the order with the new keys first (least recent)
            rest = [k for k in d if k not in set(missing)]
            self._d = d = dict.fromkeys(missing[::-1] + rest)  # in the order SlotPool leaves them
        self.misses += len(missing)
        return missing

    def prefetch(self, keys: Iterable[int]) -> list[int]:
        """Bring keys in ahead of use (most recent); returns those that needed a copy."""
        return self.access(keys)

    def _evict(self, protect: set[int]) -> None:
        for k in self._d:
            if k not in protect:
                del self._d[k]
                return
        raise RuntimeError("every slot is held by the running call")


class LFU:
    """Evicts the least frequently used resident key; counts persist over the whole run (no aging), ties go to
    the least recently used."""

    def __init__(self, slots: int):
        self.slots = slots
        self.count: dict[int, int] = {}
        self._tick: dict[int, int] = {}
        self._resident: set[int] = set()
        self._heap: list[tuple[int, int, int]] = []
        self._now = 0
        self.misses = 0

    def __contains__(self, key: int) -> bool:
        return key in self._resident

    def access(self, keys: Iterable[int], scan: bool = False) -> list[int]:
        keys = list(keys)
        protect = set(keys)
        missing = []
        for k in keys:
            if k not in self._resident:
                if len(self._resident) >= self.slots:
                    self._evict(protect)
                self._resident.add(k)
                missing.append(k)
            self._touch(k)
        self.misses += len(missing)
        return missing

    def prefetch(self, keys: Iterable[int]) -> list[int]:
        return self.access(keys)

    def _touch(self, k: int) -> None:
        self._now += 1
        c = self.count.get(k, 0) + 1
        self.count[k], self._tick[k] = c, self._now
        heapq.heappush(self._heap, (c, self._now, k))
        if len(self._heap) > 8 * self.slots + 1024:  # drop stale entries now and then
            self._heap = [(self.count[r], self._tick[r], r) for r in self._resident]
            heapq.heapify(self._heap)

    def _evict(self, protect: set[int]) -> None:
        held = []
        while self._heap:
            c, t, k = heapq.heappop(self._heap)
            if k not in self._resident or self._tick[k] != t:
                continue  # stale entry
            if k in protect:
                held.append((c, t, k))
                continue
            self._resident.discard(k)
            for e in held:
                heapq.heappush(self._heap, e)
            return
        raise RuntimeError("every slot is held by the running call")


class Pinned:
    """The hottest keys stay resident for good; an LRU manages the remaining slots."""

    def __init__(self, slots: int, pinned: Iterable[int]):
        self.pinned = set(pinned)
        if len(self.pinned) >= slots:
            raise ValueError("pinning every slot leaves none for the rest")
        self.lru = LRU(slots - len(self.pinned))

    @property
    def misses(self) -> int:
        return self.lru.misses

    def __contains__(self, key: int) -> bool:
        return key in self.pinned or key in self.lru

    def access(self, keys: Iterable[int], scan: bool = False) -> list[int]:
        return self.lru.access([k for k in keys if k not in self.pinned], scan)

    def prefetch(self, keys: Iterable[int]) -> list[int]:
        return self.access(keys)


def make_cache(kind: str, slots: int, hot_order, pinned_share: float = 0.5):
    """hot_order: keys hottest first (long-run popularity), used to choose the pinned experts."""
    if kind == "lru":
        return LRU(slots)
    if kind == "lru-cold":
        return LRU(slots, cold_scans=True)
    if kind == "lfu":
        return LFU(slots)
    if kind == "pinned":
        n = int(slots * pinned_share)
        return Pinned(slots, (int(k) for k in hot_order[:n]))
    raise ValueError(f"unknown cache policy {kind!r} (lru, lru-cold, lfu, pinned)")
