"""The calibration table (the model against the reference box's measured rows) and the what-if table (one lever
at a time, then together), as data and as Markdown."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dsflash.sim.box import BASELINE, GB, MEASURED, WORKLOADS, Box, Policy, Workload
from dsflash.sim.run import Result, Simulator, SpeculativeResult, StreamsResult, run_speculative, run_streams


@dataclass(frozen=True)
class Lever:
    name: str
    policy: Policy = BASELINE
    box: dict = field(default_factory=dict)  # Box fields changed by this lever

    def apply(self, box: Box) -> Box:
        return box.with_(**self.box) if self.box else box


FAST_COLD = {"cold_read_bw": 12 * GB}  # page-cache misses read at the drive's sequential rate (large direct reads)
BIG_RAM = {"page_cache": 340 * GB}  # the whole 313 GB store fits in the host page cache

LEVERS = [
    Lever("reference box: LRU, copies serialized with compute, expert-major prefill"),
    Lever("LRU, prefill misses inserted cold (the engine's)", Policy(cache="lru-cold")),
    Lever("LFU replacement", Policy(cache="lfu")),
    Lever("LRU + half the slots pinned to the hottest experts", Policy(cache="pinned")),
    Lever("copies overlap compute", Policy(overlap=True)),
    Lever("copies overlap compute + prefetch (pre-gating, 80% right)", Policy(overlap=True, prefetch=True)),
    Lever("token-major prefill (expert-major off)", Policy(expert_major=False)),
    Lever("expert-major prefill in 512-token chunks (dsflash's default)", box={"prefill_chunk": 512}),
    Lever("expert-major prefill in 2048-token chunks", box={"prefill_chunk": 2048}),
    Lever("slot map on the device: no host round trip per layer", box={"layer_sync": 0.0}),
    Lever("page-cache misses at NVMe sequential rate (12 GB/s)", box=FAST_COLD),
    Lever("host RAM holds the whole store (340 GB page cache)", box=BIG_RAM),
    Lever("32k profile without its extra per-step context cost", box={"long_ctx_cost": 0.0}),
    Lever("prefix reuse: the agent's turn is its last 64 tokens on a restored snapshot", Policy(prefix_reuse=True)),
    Lever("overlap + prefetch + fast cold reads", Policy(overlap=True, prefetch=True), FAST_COLD),
    Lever(
        "device slot map + overlap + prefetch + fast cold reads",
        Policy(overlap=True, prefetch=True),
        {**FAST_COLD, "layer_sync": 0.0},
    ),
]


def calibration(sim: Simulator, workloads: list[Workload], progress: Callable[[str], None] = lambda s: None):
    rows = []
    for wl in workloads:
        progress(f"calibration: {wl.name}")
        rows.append(sim.run(BASELINE, wl))
    return rows


def calibration_markdown(rows: list[Result]) -> str:
    out = [
        "| workload | prompt / output | TTFT measured | TTFT model | ratio | decode measured | decode model | ratio "
        "| decode slot hits | prefill copies (passes) | cold reads |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        wl, m = WORKLOADS[r.workload], MEASURED.get(r.workload)
        if m is None:
            continue
        out.append(
            f"| {r.workload} | {wl.input_len} / {wl.output_len} | {m.ttft:.1f} s | {r.ttft:.1f} s | "
            f"{r.ttft / m.ttft:.2f} | {m.decode:.2f} tok/s | {r.decode_tok_s:.2f} tok/s | "
            f"{r.decode_tok_s / m.decode:.2f} | {r.decode_hit:.1%} | {r.prefill_passes:.2f} | {r.cold_share:.1%} |"
        )
    return "\n".join(out)


def what_if(sim: Simulator, workloads: list[Workload], levers: list[Lever] = LEVERS,
            progress: Callable[[str], None] = lambda s: None) -> list[tuple[Lever, list[Result]]]:  # fmt: skip
    out = []
    for lever in levers:
        results = []
        for wl in workloads:
            progress(f"what-if: {lever.name}: {wl.name if wl else 'recorded trace'}")
            results.append(sim.run(lever.policy, wl, lever.apply(sim.box)))
        out.append((lever, results))
    return out


def what_if_markdown(table: list[tuple[Lever, list[Result]]]) -> str:
    """TTFT and decode tok/s per workload, with the factor against the first row (x > 1 is better)."""
    base = {r.workload: r for r in table[0][1]}
    names = [r.workload for r in table[0][1]]
    head = "| lever | " + " | ".join(f"{n} TTFT | {n} decode" for n in names) + " |"
    out = [head, "|---|" + "---|---|" * len(names)]
    for lever, results in table:
        cells = []
        for r in results:
            b = base[r.workload]
            cells.append(f"{_secs(r.ttft)} ({b.ttft / r.ttft:.2f}x)")
            cells.append(f"{r.decode_tok_s:.2f} tok/s ({r.decode_tok_s / b.decode_tok_s:.2f}x)")
        out.append(f"| {lever.name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _secs(s: float) -> str:
    return f"{s:,.0f} s" if s >= 100 else f"{s:.1f} s"


STREAMS = (1, 2, 4, 8)


def concurrency(sim: Simulator, workloads: list[Workload], streams=STREAMS, policy: Policy = BASELINE,
                progress: Callable[[str], None] = lambda s: None) -> list[StreamsResult]:  # fmt: skip
    """Each workload decoding 1, 2, 4, 8 (`streams`) sequences at once on the box."""
    rows = []
    for wl in workloads:
        for b in streams:
            progress(f"concurrency: {wl.name}: {b} stream(s)")
            rows.append(run_streams(sim, policy, wl, b))
    return rows


def concurrency_markdown(rows: list[StreamsResult]) -> str:
    """Aggregate and per-stream decode tok/s by streams, with the factor against one stream."""
    one = {r.workload: r for r in rows if r.streams == 1}
    out = ["| workload | streams | aggregate decode | per stream | experts read per step | decode slot hits |",
           "|---|---|---|---|---|---|"]  # fmt: skip

    def cell(value: float, base: float | None) -> str:
        return f"{value:.2f} tok/s" + (f" ({value / base:.2f}x)" if base else "")

    for r in rows:
        base = one.get(r.workload)
        agg = cell(r.aggregate_tok_s, base and base.aggregate_tok_s)
        per = cell(r.per_stream_tok_s, base and base.per_stream_tok_s)
        out.append(f"| {r.workload} | {r.streams} | {agg} | {per} | {r.experts_per_step:.0f} | {r.decode_hit:.1%} |")
    return "\n".join(out)


# drafts per verify (V4.1's block size) at the reference box's measured acceptance (seed.md: 1.2 drafts a pass) and
# at what better heads give
SPECULATE = ((5, 1.2), (5, 2.0), (5, 3.0))


Speculated = tuple[Result, list[SpeculativeResult]]


def speculation(sim: Simulator, workloads: list[Workload], settings=SPECULATE, policy: Policy = BASELINE,
                progress: Callable[[str], None] = lambda s: None) -> list[Speculated]:  # fmt: skip
    """Each workload's plain decode and its decode with speculation at each (drafts, accepted) setting."""
    out = []
    for wl in workloads:
        progress(f"speculation: {wl.name}")
        plain = sim.run(policy, wl)
        out.append((plain, [run_speculative(sim, policy, wl, k, a) for k, a in settings]))
    return out


def speculation_markdown(rows: list[Speculated]) -> str:
    """Decode tok/s with speculation against plain decoding, and what a verify reads."""
    out = ["| workload | drafts / verify | accepted / verify (stated) | decode | vs plain | experts read per verify "
           "| decode slot hits |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for plain, specs in rows:
        out.append(
            f"| {plain.workload} | plain | – | {plain.decode_tok_s:.2f} tok/s | 1.00x | – | {plain.decode_hit:.1%} |"
        )
        for r in specs:
            gain = r.decode_tok_s / plain.decode_tok_s
            out.append(f"| {r.workload} | {r.k} | {r.accepted:g} | {r.decode_tok_s:.2f} tok/s | {gain:.2f}x | "
                       f"{r.experts_per_verify:.0f} | {r.decode_hit:.1%} |")  # fmt: skip
    return "\n".join(out)
