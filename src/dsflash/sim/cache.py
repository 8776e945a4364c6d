"""Device expert-slot replacement policies over integer keys (layer * experts + expert). No timing here.

`access(keys)` makes every key of one MoE call resident and returns the ones that had to be copied in; the keys of
the call are protected while it runs (the engine pins them), so a call never evicts its own experts.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class LRU:
    def __init__(self, slots: int):
        self.slots = slots
        self._d: dict[int, None] = {}  # insertion order = recency, least recent first
        self.misses = 0

    def __contains__(self, key: int) -> bool:
        return key in self._d

    def access(self, keys: Iterable[int]) -> list[int]:
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

    def access(self, keys: Iterable[int]) -> list[int]:
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

    def access(self, keys: Iterable[int]) -> list[int]:
        return self.lru.access([k for k in keys if k not in self.pinned])

    def prefetch(self, keys: Iterable[int]) -> list[int]:
        return self.access(keys)


def make_cache(kind: str, slots: int, hot_order, pinned_share: float = 0.5):
    """hot_order: keys hottest first (long-run popularity), used to choose the pinned experts."""
    if kind == "lru":
        return LRU(slots)
    if kind == "lfu":
        return LFU(slots)
    if kind == "pinned":
        n = int(slots * pinned_share)
        return Pinned(slots, (int(k) for k in hot_order[:n]))
    raise ValueError(f"unknown cache policy {kind!r} (lru, lfu, pinned)")
