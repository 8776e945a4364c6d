"""The modelled box, the workloads and the reference box's measured table. Every number says where it comes from:
`published` (the model card or a hardware spec), `derived` (arithmetic on published numbers), `guess` (stated
assumption) or `fitted` (chosen so that the model reproduces the measured table; see docs/simulator.md)."""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9
MB = 1e6


@dataclass(frozen=True)
class Box:
    """Hardware and engine constants of one box; times in seconds, sizes in bytes, bandwidths in bytes/s."""

    chips: int = 4  # published: QuietBox 2 = 2x p300c = 4 Blackhole chips, TP 4
    link_bw: float = 7.88 * GB  # derived: PCIe Gen4 x4 per chip (measured width, seed.md §2)
    link_efficiency: float = 0.8  # guess: PCIe payload efficiency of large host-to-device copies
    dram_bw: float = 512 * GB  # published: GDDR6 per chip
    resident_bytes: float = 6.9 * GB  # derived: attention, head and shared experts read per pass (all chips)
    expert_bytes: float = 19.91 * MB  # derived: one routed expert in bfp4_b (34,560 tiles x 576 B)
    layers: int = 40  # published: MoE layers of V4.1-Flash
    experts: int = 384  # published: routed experts per layer
    top_k: int = 6  # published
    slots: int = 4500  # published: device expert slots (each one expert's TP shard on every chip)
    floor: float = 0.150  # published: per decode step dispatch floor of the resident V4-Flash box (ndalyTT)
    layer_sync: float = 2.0e-3  # fitted: per MoE layer and pass, the host round trip streaming adds (read the
    # router's choice back, map experts to slots, enqueue the copies): a resident box has no such step
    token_compute: float = 50e-6  # derived: ~31 GFLOP per token at ~25% of ~2.5 PFLOPS (prefill, per token)
    moe_share: float = 0.5  # guess: share of a layer's compute after its router (what expert copies can hide behind)
    page_cache: float = 225 * GB  # derived: 249 GB visible RAM minus ~24 GB for the process and the OS (guess)
    store_bytes: float = 313 * GB  # published: packed expert store
    # fitted: effective rate of reading an expert that is not in the page cache (from NVMe, for all four chips).
    # The drive streams ~12 GB/s (guess: Gen5 x4); 0.5 GB/s is what 4 KiB page faults on an mmap at queue depth
    # one deliver, which is how an mmap-served store reads a cold expert
    cold_read_bw: float = 0.5 * GB
    prefill_chunk: int = 128  # guess: tokens per expert-major prefill pass (seed.md §3.3)
    long_ctx_cost: float = 15e-6  # fitted: seconds per step per context token beyond `long_ctx_from` (32k profile)
    long_ctx_from: int = 9216  # published: the default profile's context; the 32k profile pays beyond it
    prefetch_accuracy: float = 0.8  # guess: share of the next layer's experts a pre-gating predictor names correctly
    # derived: a V4.1-Flash decode state's bytes per token (fp32 KV-source latents + index keys, Engram history;
    # docs/serving.md) and its fixed part (window rings, pending groups), on each of the TP ranks
    state_bytes_per_token: float = 6408.0
    state_fixed_bytes: float = 11.3 * MB
    snapshot_bw: float = 8 * GB  # guess: host memcpy of a snapshot back into the decode state
    # fitted: one DSpark draft pass (V4.1-Flash's 3 stages over a block of 5). The box measured 1.2 drafts accepted
    # a pass and slower than plain decoding (seed.md); with a verify priced as the batched step below (about 1.2
    # plain steps for 6 positions), that needs a draft of at least ~0.28 s, about one traced decode step. Three
    # stages' share of the floor and their round trips would be ~0.02 s: the draft ran far slower than its
    # arithmetic (an untraced pass would: guess)
    draft_time: float = 0.30

    @property
    def shard_bytes(self) -> float:
        return self.expert_bytes / self.chips

    @property
    def miss_time(self) -> float:
        """Seconds to copy one expert's shards, all chips in parallel over their own links."""
        return self.shard_bytes / (self.link_bw * self.link_efficiency)

    @property
    def cold_time(self) -> float:
        """Seconds to read one whole expert from NVMe into the page cache."""
        return self.expert_bytes / self.cold_read_bw

    @property
    def page_cache_experts(self) -> int:
        return int(min(self.page_cache, self.store_bytes) / self.expert_bytes)

    def with_(self, **kw) -> Box:
        return replace(self, **kw)


@dataclass(frozen=True)
class Policy:
    """The levers: slot replacement, pinned hot experts, copy/compute overlap, prefetch, expert-major prefill."""

    # lru | lru-cold (prefill misses enter least recently used, as the engine does) | lfu | pinned (LRU over the
    # slots left after pinning the hottest experts)
    cache: str = "lru"
    pinned_share: float = 0.5  # share of the slots pinned by `pinned`
    overlap: bool = False  # copies run while the device computes (otherwise they serialize with compute)
    prefetch: bool = False  # the next layer's predicted experts are copied during this layer (needs overlap)
    expert_major: bool = True  # a prefill chunk loads each touched expert once (off: token by token)
    prefix_reuse: bool = False  # a turn that extends an earlier one restores its snapshot, prefills only the rest
    name: str = ""

    def label(self) -> str:
        if self.name:
            return self.name
        names = {"lru": "LRU", "lru-cold": "LRU, prefill misses cold", "lfu": "LFU"}
        parts = [names.get(self.cache, f"LRU + {self.pinned_share:.0%} pinned hot")]
        if self.overlap:
            parts.append("overlap")
        if self.prefetch:
            parts.append("prefetch")
        if self.prefix_reuse:
            parts.append("prefix reuse")
        if not self.expert_major:
            parts.append("token-major prefill")
        return ", ".join(parts)


BASELINE = Policy(name="reference box (LRU, copies serialized, expert-major prefill)")


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    profile: str
    context: int
    turn_len: int = 0  # > 0: the prompt is an earlier turn's conversation plus this many new tokens (an agent's loop)

    def scaled(self, f: float) -> Workload:
        return replace(self, input_len=max(1, round(self.input_len * f)), output_len=max(2, round(self.output_len * f)),
                       turn_len=max(1, round(self.turn_len * f)) if self.turn_len else 0)  # fmt: skip


# the reference box's four `vllm bench serve` workloads (seed.md) and the serving profile each needs
WORKLOADS = {
    "chat": Workload("chat", 128, 256, "default", 9216),
    "codegen": Workload("codegen", 1024, 1024, "default", 9216),
    "agent": Workload("agent", 8192, 512, "default", 9216, turn_len=64),
    "long": Workload("long", 32768, 256, "p300x2-32k", 33792),
}


@dataclass(frozen=True)
class Measured:
    ttft: float  # seconds
    decode: float  # tok/s = 1000 / mean TPOT (ms)


# published: the reference box's model card (seed.md), one user, random tokens, --ignore-eos
MEASURED = {
    "chat": Measured(10.2, 3.65),
    "codegen": Measured(52.7, 3.73),
    "agent": Measured(154.0, 3.78),
    "long": Measured(399.0, 1.73),
}


@dataclass(frozen=True)
class Locality:
    """Synthetic routing: per layer a Zipf(s) popularity over a random order of the experts; each request skews
    it by a log-normal factor per expert (sigma: how much requests differ); a token reuses the previous token's
    experts at a layer with probability `reuse`."""

    zipf: float = 1.7  # fitted to the reference box's table
    request_sigma: float = 2.1  # fitted to the reference box's table
    reuse: float = 0.2  # guess
    seed: int = 0


REFERENCE = Box()
REFERENCE_LOCALITY = Locality()
