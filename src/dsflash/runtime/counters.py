"""The expert counters every consumer reads (engine, metrics, bench JSON, gates): one type, one set of names."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class ExpertCounters:
    """Routed-expert lookups of an engine since it started (or since the counters were zeroed).

    A runner over N ranks counts hits and misses once (every rank makes the same slot choices, a function of the
    routing) and the bytes streamed into slots over all of its ranks (each streams its shard of the same experts).
    """

    hits: int = 0  # lookups served from a slot
    misses: int = 0  # lookups that streamed the expert into a slot
    evictions: int = 0  # misses that replaced a resident expert
    bytes_streamed: int = 0  # bytes copied (or mapped) into slots, all ranks together
    stream_s: float = 0.0  # seconds rank 0 spent bringing experts into slots

    @property
    def lookups(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def __sub__(self, other: ExpertCounters) -> ExpertCounters:
        """What was counted between `other` (earlier) and this."""
        return ExpertCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def scaled_bytes(self, ranks: int) -> ExpertCounters:
        """One rank's counters as its runner reports them: its bytes times the ranks that stream the same shards."""
        return ExpertCounters(self.hits, self.misses, self.evictions, self.bytes_streamed * ranks, self.stream_s)

    def to_json(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}
