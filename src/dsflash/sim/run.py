"""Run workloads through a box under policies the way `vllm bench serve` measures them: one untimed test request
(vLLM's initial single-prompt run), then `prompts` timed ones, one at a time; TTFT and TPOT are their means."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsflash.sim.box import Box, Locality, Policy, Workload
from dsflash.sim.model import Machine, RequestResult
from dsflash.sim.traces import RequestTrace, SyntheticRouting


@dataclass(frozen=True)
class Result:
    workload: str
    policy: str
    ttft: float  # seconds, mean over the timed requests
    tpot: float  # seconds, mean over the timed requests
    decode_hit: float  # slot hit rate over decode steps
    prefill_passes: float  # expert copies in prefill / (layers * experts): full passes over the experts
    cold_share: float  # share of copies whose expert was not in the host page cache

    @property
    def decode_tok_s(self) -> float:
        return 1.0 / self.tpot if self.tpot > 0 else float("inf")


class Simulator:
    """Synthetic traces (cached per workload and request index, shared by every policy) or recorded requests."""

    def __init__(self, box: Box, locality: Locality, prompts: int = 2, recorded: list[RequestTrace] | None = None,
                 header: dict | None = None):  # fmt: skip
        self.box, self.locality, self.prompts = box, locality, prompts
        self.recorded = recorded
        if recorded is not None:
            self.layers, self.experts = len(header["layers"]), int(header["experts"])
            self.hot_order = _observed_hot_order(recorded, self.layers, self.experts)
            self.routing = None
        else:
            self.layers, self.experts = box.layers, box.experts
            self.routing = SyntheticRouting(box.layers, box.experts, box.top_k, locality)
            self.hot_order = self.routing.hot_order()
        self._traces: dict[tuple, RequestTrace] = {}

    def requests(self, wl: Workload | None) -> list[RequestTrace]:
        """The untimed test request first, then the timed ones."""
        if self.recorded is not None:
            return self.recorded
        return [self.trace(wl, i) for i in range(self.prompts + 1)]

    def trace(self, wl: Workload, i: int) -> RequestTrace:
        """Synthetic request number i of the workload (0: the untimed test request)."""
        key = (wl.input_len, wl.output_len, i)
        if key not in self._traces:
            self._traces[key] = self.routing.request(wl.input_len, wl.output_len, index=i)
        return self._traces[key]

    def run(self, policy: Policy, wl: Workload | None, box: Box | None = None) -> Result:
        box = box or self.box
        m = Machine(box, policy, self.hot_order, self.experts, seed=self.locality.seed)
        reqs = self.requests(wl)
        timed = reqs[1:] if len(reqs) > 1 else reqs
        if len(reqs) > 1:
            m.run(reqs[0])
        # an agent's turn with reuse: all but its new tokens were consumed by the turn before (never by recorded
        # requests: their prompts are what they were)
        reuse = policy.prefix_reuse and wl is not None and wl.turn_len and self.recorded is None
        cached = wl.input_len - wl.turn_len if reuse else 0
        results = [m.run(r, cached) for r in timed]
        return _summarize(wl.name if wl else "recorded", policy.label(), results, self.layers * self.experts)


@dataclass(frozen=True)
class StreamsResult:
    """B sequences decoding together: one step's mean seconds, and what a step read."""

    workload: str
    streams: int
    step_s: float
    decode_hit: float
    experts_per_step: float  # distinct routed experts a step reads, all layers (the union of its sequences')

    @property
    def aggregate_tok_s(self) -> float:
        return self.streams / self.step_s

    @property
    def per_stream_tok_s(self) -> float:
        return 1.0 / self.step_s


def run_streams(sim: Simulator, policy: Policy, wl: Workload, streams: int, box: Box | None = None) -> StreamsResult:
    """`streams` synthetic requests of the workload decoding at once, after the untimed test request."""
    box = box or sim.box
    m = Machine(box, policy, sim.hot_order, sim.experts, seed=sim.locality.seed)
    m.run(sim.trace(wl, 0))
    r = m.run_streams([_stream_trace(sim, wl, i) for i in range(streams)])
    steps = len(r.tpots)
    return StreamsResult(
        wl.name,
        streams,
        step_s=float(np.mean(r.tpots)),
        decode_hit=1 - r.decode_misses / r.decode_accesses if r.decode_accesses else float("nan"),
        experts_per_step=r.decode_accesses / steps if steps else 0.0,
    )


@dataclass(frozen=True)
class SpeculativeResult:
    """One sequence with speculative decoding at a stated acceptance."""

    workload: str
    k: int  # drafts per verify
    accepted: float  # stated: drafts kept per verify, on average
    tpot: float  # seconds per emitted token
    decode_hit: float
    experts_per_verify: float  # distinct routed experts a verify pass reads, all layers

    @property
    def decode_tok_s(self) -> float:
        return 1.0 / self.tpot


def run_speculative(sim: Simulator, policy: Policy, wl: Workload, k: int, accepted: float,
                    box: Box | None = None) -> SpeculativeResult:  # fmt: skip
    """The workload's first timed request decoding with k drafts a verify and `accepted` of them kept (after the
    untimed test request)."""
    box = box or sim.box
    m = Machine(box, policy, sim.hot_order, sim.experts, seed=sim.locality.seed)
    m.run(sim.trace(wl, 0))
    r = m.run_speculative(sim.trace(wl, 1), k, accepted)
    return SpeculativeResult(
        wl.name,
        k,
        accepted,
        tpot=float(np.mean(r.tpots)),
        decode_hit=1 - r.decode_misses / r.decode_accesses if r.decode_accesses else float("nan"),
        experts_per_verify=r.decode_accesses / r.verifies if r.verifies else 0.0,
    )


def _stream_trace(sim: Simulator, wl: Workload, i: int) -> RequestTrace:
    """Sequence i of a concurrent batch: the first timed request's prompt routing (drawing and running a 32k-token
    prompt's routing costs ~30 s, and the prompts only warm the slots here) followed by its own generated tokens'
    routing."""
    base = sim.trace(wl, 1)
    if i == 0 or base.ids is None:
        return base
    own = sim.routing.request(0, wl.output_len, index=10_000 + i)
    ids = np.concatenate([base.ids[: base.prompt_len], own.ids])
    return RequestTrace(base.prompt_len, wl.output_len, ids=ids, weights=own.weights)


def _summarize(name: str, label: str, rs: list[RequestResult], n_experts: int) -> Result:
    tpots = [np.mean(r.tpots) for r in rs if r.tpots]
    acc = sum(r.decode_accesses for r in rs)
    copies = sum(r.prefill_misses + r.decode_misses + r.prefetched for r in rs)
    return Result(
        name,
        label,
        ttft=float(np.mean([r.ttft for r in rs])),
        tpot=float(np.mean(tpots)) if tpots else 0.0,
        decode_hit=1 - sum(r.decode_misses for r in rs) / acc if acc else float("nan"),
        prefill_passes=sum(r.prefill_misses for r in rs) / len(rs) / n_experts,
        cold_share=sum(r.cold_reads for r in rs) / copies if copies else 0.0,
    )


def _observed_hot_order(reqs: list[RequestTrace], layers: int, experts: int) -> np.ndarray:
    counts = np.zeros(layers * experts)
    for r in reqs:
        for s in r.recorded:
            for l, ids in enumerate(s.routing):
                np.add.at(counts, ids.astype(np.int64) + l * experts, 1)
    return np.argsort(-counts, kind="stable")
