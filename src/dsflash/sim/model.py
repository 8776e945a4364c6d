"""The step-time model: for each forward pass, per MoE layer, which experts miss the device slots (cache.py),
where their bytes come from (host page cache or NVMe), and how the copies line up with the compute.

Concurrent sequences (run_streams): one decode step advances each of B sequences by a token; per layer the union
of their routed experts is looked up, copied and read once, the resident weights (attention, head, shared
experts) once per step; attention's context cost is per sequence, and the B tokens' math shows only where it
outlasts the step's floor and weight reads.

Speculative decoding (run_speculative): a pass drafts k tokens (Box.draft_time) and verifies k + 1 positions of one
sequence as such a batched step over the routing of its next k + 1 tokens, and emits a stated number of them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dsflash.sim.box import Box, Policy
from dsflash.sim.cache import make_cache
from dsflash.sim.traces import RequestTrace, Step


@dataclass
class RequestResult:
    ttft: float
    tpots: list[float]
    prefill_misses: int = 0
    decode_misses: int = 0
    decode_accesses: int = 0
    cold_reads: int = 0
    prefetched: int = 0
    verifies: int = 0  # speculative verify passes


@dataclass
class Machine:
    """One box running one policy: its slot cache, its page-cache set, the clock rules."""

    box: Box
    policy: Policy
    hot_order: np.ndarray  # (layer * experts + expert) keys, hottest first
    experts: int
    seed: int = 0
    cache: object = field(init=False)
    page: set = field(init=False)

    def __post_init__(self):
        slots = min(self.box.slots, len(self.hot_order))
        self.cache = make_cache(self.policy.cache, slots, self.hot_order, self.policy.pinned_share)
        # the host page cache: an LRU over whole experts, first holding the long-run hottest ones
        self.page = dict.fromkeys(int(k) for k in self.hot_order[: self.box.page_cache_experts][::-1])
        self._rng = np.random.default_rng(self.seed + 7919)

    def run_streams(self, traces: list[RequestTrace]) -> RequestResult:
        """B requests at once: their prompts prefilled one after another (not timed; a prompt routed as one before
        it is not run again), then decode steps that advance every sequence by one token -> the decode steps'
        seconds (tpots) and slot counts."""
        res = RequestResult(0.0, [])
        decodes, warmed = [], []
        for tr in traces:
            steps = list(tr.steps(self.box.prefill_chunk, self.policy.expert_major))
            prompt = None if tr.ids is None else tr.ids[: tr.prompt_len]
            if prompt is None or not any(np.array_equal(prompt, w) for w in warmed):
                for step in steps:
                    if step.kind == "prefill":
                        self._step(step, tr, res)
                warmed.append(prompt)
            decodes.append([s for s in steps if s.kind == "decode"])
        res.prefill_misses = res.decode_misses = res.decode_accesses = 0
        for k in range(min(len(d) for d in decodes)):
            batch = [d[k] for d in decodes]
            layers = len(batch[0].routing)
            routing = [np.concatenate([s.routing[l] for s in batch]) for l in range(layers)]
            step = Step("decode", batch[0].pos, len(batch), routing, positions=[s.pos for s in batch])
            res.tpots.append(self._step(step, traces[0], res))
        return res

    def run_speculative(self, trace: RequestTrace, k: int, accepted: float) -> RequestResult:
        """One request with speculative decoding: its prompt prefilled (not timed), then passes that draft k tokens
        and verify k + 1 positions at once (the routing of the next k + 1 generated tokens, the union of their
        experts read once), each emitting `accepted` + 1 tokens on average (a running fraction decides how many) ->
        tpots per emitted token, slot counts over the verify passes."""
        res = RequestResult(0.0, [])
        decodes = []
        for step in trace.steps(self.box.prefill_chunk, self.policy.expert_major):
            if step.kind == "prefill":
                self._step(step, trace, res)
            else:
                decodes.append(step)
        res.prefill_misses = 0
        i, owed = 0, 0.0
        while i < len(decodes):
            block = decodes[i : i + k + 1]
            routing = [np.concatenate([s.routing[l] for s in block]) for l in range(len(block[0].routing))]
            verify = Step("decode", block[0].pos, len(block), routing, positions=[s.pos for s in block])
            t = self.box.draft_time + self._step(verify, trace, res)
            owed += accepted + 1
            n = max(1, min(int(owed), len(block)))
            owed -= n
            res.tpots += [t / n] * n
            res.verifies += 1
            i += n
        return res

    def run(self, trace: RequestTrace, cached: int = 0) -> RequestResult:
        """One request; `cached` prompt tokens come from a prefix snapshot (copied back at snapshot_bw)."""
        b = self.box
        res = RequestResult(0.0, [])
        if cached:
            res.ttft += b.chips * (b.state_fixed_bytes + cached * b.state_bytes_per_token) / b.snapshot_bw
        for step in trace.steps(self.box.prefill_chunk, self.policy.expert_major, start=cached):
            t = self._step(step, trace, res)
            if step.kind == "prefill":
                res.ttft += t
            else:
                res.tpots.append(t)
        return res

    # ---- one forward pass ---------------------------------------------------------------------
    def _compute(self, step: Step, touched: int) -> float:
        """Device time of the pass, all layers: the dispatch floor or, if longer, reading the resident weights and
        the `touched` experts from device DRAM; the host round trips; per-token math; the 32k profile's cost."""
        b = self.box
        dram = (b.resident_bytes + touched * b.expert_bytes) / (b.chips * b.dram_bw)
        if step.positions is not None:  # a batched decode step: the tokens' math runs under the floor
            ctx = sum(max(0, p + 1 - b.long_ctx_from) for p in step.positions)
            device = max(b.floor, dram, step.n * b.token_compute)
            return device + b.layer_sync * len(step.routing) + b.long_ctx_cost * ctx
        ctx = max(0, step.pos + step.n - b.long_ctx_from)
        math = step.n * b.token_compute if step.kind == "prefill" else 0.0
        return max(b.floor, dram) + b.layer_sync * len(step.routing) + math + b.long_ctx_cost * ctx

    def _step(self, step: Step, trace: RequestTrace, res: RequestResult) -> float:
        b, pol, E = self.box, self.policy, self.experts
        layers = len(step.routing)
        calls = [(np.unique(ids) + l * E).tolist() for l, ids in enumerate(step.routing)]
        c = self._compute(step, sum(len(k) for k in calls)) / layers
        c_post = c * b.moe_share
        c_pre = c - c_post
        prefetch = pol.prefetch and pol.overlap and step.kind == "decode"
        t = dma = 0.0
        ready = 0.0  # when the copies prefetched for this layer are done
        for l, keys in enumerate(calls):
            missing = self.cache.access(keys, scan=step.kind == "prefill")
            x = self._copy_time(missing, res)
            if step.kind == "decode":
                res.decode_misses += len(missing)
                res.decode_accesses += len(keys)
            else:
                res.prefill_misses += len(missing)
            if not pol.overlap:
                t += c + x
                continue
            t += c_pre  # attention and router: now the layer's experts are known
            router = t
            dma = max(dma, t) + x
            loads_done = max(dma if missing else 0.0, ready)
            t = max(t + c_post, loads_done)
            if prefetch and l + 1 < layers:
                guess = self._predict(step.routing[l + 1], trace, l + 1)
                fetched = self.cache.prefetch((guess + (l + 1) * E).tolist())
                res.prefetched += len(fetched)
                dma = max(dma, router) + self._copy_time(fetched, res)
                ready = dma
            else:
                ready = 0.0
        return t

    def _copy_time(self, missing: list[int], res: RequestResult) -> float:
        """Copies of one layer's misses: every chip's link in parallel; page-cache misses also wait on NVMe."""
        if not missing:
            return 0.0
        page, cap = self.page, self.box.page_cache_experts
        cold = 0
        for k in missing:
            if k in page:
                del page[k]
            else:
                cold += 1
                if len(page) >= cap:
                    del page[next(iter(page))]
            page[k] = None
        res.cold_reads += cold
        return max(len(missing) * self.box.miss_time, cold * self.box.cold_time)

    def _predict(self, ids: np.ndarray, trace: RequestTrace, layer: int) -> np.ndarray:
        """A pre-gating predictor's guess of a layer's experts: right with probability `prefetch_accuracy`, else an
        expert drawn from the request's popularity (uniform for recorded traces)."""
        ids = np.unique(ids)
        wrong = self._rng.random(len(ids)) >= self.box.prefetch_accuracy
        if wrong.any():
            if trace.weights is not None:
                w = trace.weights[layer]
                ids = ids.copy()
                ids[wrong] = self._rng.choice(len(w), size=int(wrong.sum()), p=w)
            else:
                ids = ids.copy()
                ids[wrong] = self._rng.integers(0, self.experts, size=int(wrong.sum()))
        return np.unique(ids)
