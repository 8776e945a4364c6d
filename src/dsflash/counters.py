"""The expert counters every consumer reads (engine, /metrics, bench JSON, gates): one type, one set of names.
Pure Python at the bottom of the layers, so that the HTTP-only bench reads the server's /metrics into the same type.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

# the counters /metrics exposes (after its "dsflash:" prefix): field -> (metric name, help text)
PROMETHEUS = {
    "hits": ("expert_hits_total", "Routed-expert lookups served from a device slot."),
    "misses": ("expert_misses_total", "Routed-expert lookups that streamed the expert in."),
    "bytes_streamed": ("expert_bytes_streamed_total", "Expert bytes copied to the device, all ranks."),
}


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

    @classmethod
    def from_prometheus(cls, text: str, prefix: str = "dsflash:") -> ExpertCounters | None:
        """The counters in a Prometheus text exposition (summed over label sets), None where it has none of them
        (another server)."""
        names = {prefix + metric: field for field, (metric, _) in PROMETHEUS.items()}
        values: dict[str, int] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                try:
                    values[names[name]] = values.get(names[name], 0) + int(float(line.rsplit(" ", 1)[1]))
                except (IndexError, ValueError):
                    continue
        return cls(**values) if values else None
