"""Speculative decoding with the model's DSpark head (issue 26): draft K tokens, verify them in one target forward
of K+1 positions, keep the longest accepted prefix plus the target's next token, roll the rest back.

Greedy output is the plain engine's (a draft is kept only where it is the target's argmax). With temperature > 0
and no seed, standard speculative sampling keeps the target distribution (accept with min(1, p/q), else draw from
the normalised residual max(0, p - q)). With a seed, the guard's decisions (which depend on this machine's timings)
must not change the tokens: every generated position i draws argmax(log p + G_i) with Gumbel noise G_i fixed by
(seed, i) (Gumbel-max: exactly a draw from p), the draft draws its tokens with the same noise, and a draft is kept
where it equals the target's draw. The output is then a function of the seed and the model alone, drafted or not
(it differs from the same seed with speculation off, whose sampler draws by inverse CDF).

The confidence head cuts each draft: it scores every drafted token with the chance that it is right given that the
ones before it are (a calibrated probability on the demo's held-out answers, docs/performance.md), so the expected
drafts kept by a verify of j of them is the sum over i <= j of the products of the first i scores. After drafting,
the engine verifies the j that gives the most tokens per second of verify at its measured cost, or none when a
plain step gives more (the draft is spent either way). A low-confidence draft then costs its draft and no verify.

The guard: per sequence, EMAs of the tokens a drafting step emitted and of what it cost (the draft plus its verify,
or plus the plain step that replaced a cut verify, at the engine's measured costs). Drafting stops when those
tokens per second fall below a plain step's, then re-probes after 8, 16, ... up to PROBE_MAX plain steps; a new
sequence probes at its first decode step and then waits as long as the last sequence's guard did (a head that did
not pay keeps its long waits). With a useless head each probe emits one token at the price of a draft and at most a
verify, so the loss is bounded by (draft + verify) / step - 1 per probe: one probe per request plus one per
PROBE_MAX tokens once the waits are long (plus the first request's doubling: at most log2(PROBE_MAX / PROBE_FIRST)
more probes). docs/performance.md measures it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dsflash.model.dspark import coupled_pick, gumbel
from dsflash.model.sampling import probabilities
from dsflash.runtime.scheduler.queue import StepStats, TokenEvent
from dsflash.runtime.scheduler.sampler import Sample, Sampler, top_logprobs

PROBE_FIRST, PROBE_MAX = 8, 64  # plain steps between probes once the guard turned drafting off (doubling)
EMA = 0.3  # weight of the newest verify in the acceptance average
COST_EMA = 0.2  # weight of the newest timing in the cost averages


@dataclass
class Costs:
    """Seconds of a plain decode step, of a draft, and of a verify of k drafts with its accept on this machine (EMAs,
    engine-wide)."""

    plain: float | None = None
    draft: float | None = None
    verify: dict[int, float] = field(default_factory=dict)
    backoff: int = PROBE_FIRST  # plain steps the next failed probe waits (the guards of successive sequences share it)

    def add_plain(self, s: float) -> None:
        self.plain = _ema(self.plain, s)

    def add_draft(self, s: float) -> None:
        self.draft = _ema(self.draft, s)

    def add_verify(self, k: int, s: float) -> None:
        self.verify[k] = _ema(self.verify.get(k), s)

    def verify_cost(self, k: int) -> float | None:
        """A verify of k drafts: measured, else the largest measured one's cost scaled linearly in its positions
        from a plain step's (a verify of 0 drafts would be one)."""
        if k in self.verify:
            return self.verify[k]
        if not self.verify or self.plain is None:
            return None
        m = max(self.verify)
        return self.plain + (self.verify[m] - self.plain) * k / m

    def judge(self, tokens: float, seconds: float) -> bool:
        """Whether drafting steps that emit `tokens` in `seconds` (averages) beat plain steps in tokens per second."""
        return self.plain is None or tokens / seconds >= 1 / self.plain

    def cut(self, k: int, confidence: list[float]) -> int:
        """How many of k drafts to verify, given the confidence head's scores: the count with the most expected
        tokens per second of verify, or 0 (a plain step instead) where none beats a plain step. Unmeasured costs:
        all k (a verify measures them)."""
        if self.plain is None or self.verify_cost(k) is None:
            return k
        best, chosen, kept, p = 1 / self.plain, 0, 0.0, 1.0
        for j, c in enumerate(confidence[:k], start=1):
            p *= c
            kept += p
            rate = (kept + 1) / self.verify_cost(j)
            if rate > best:
                best, chosen = rate, j
        return chosen


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - COST_EMA) * old + COST_EMA * new


class Guard:
    """One sequence's decision to draft: on while its drafting steps pay, then off with probes."""

    def __init__(self, costs: Costs):
        self.costs, self.tokens, self.seconds, self.wait = costs, None, None, 0

    @property
    def off(self) -> bool:
        return self.wait > 0

    def plain_step(self) -> None:
        self.wait = max(0, self.wait - 1)

    def verified(self, k: int, accepted: int) -> None:
        c = self.costs
        self._judge(accepted + 1, (c.draft or 0.0) + (c.verify_cost(k) or 0.0))

    def skipped(self) -> None:
        """The draft was cut whole: a plain step emitted the token, after the draft's cost."""
        c = self.costs
        self._judge(1, (c.draft or 0.0) + (c.plain or 0.0))

    def _judge(self, tokens: float, seconds: float) -> None:
        probe = self.tokens is None
        self.tokens = tokens if probe else (1 - EMA) * self.tokens + EMA * tokens
        self.seconds = seconds if probe else (1 - EMA) * self.seconds + EMA * seconds
        c = self.costs
        if self.seconds <= 0 or c.judge(self.tokens, self.seconds):
            c.backoff = PROBE_FIRST
            return
        self.wait, self.tokens, self.seconds = c.backoff, None, None  # the next drafting step is a probe
        c.backoff = min(2 * c.backoff, PROBE_MAX)


@dataclass(frozen=True)
class Speculative:
    """The engine's speculation: drafts per verify (at most the head's block size)."""

    k: int


def stats_keys() -> dict[str, int | float]:
    """spec_draft_tokens: drafts verified; spec_cut_tokens: drafts the confidence cut left unverified."""
    return {"spec_verifies": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_cut_tokens": 0,
            "spec_guard_off_steps": 0, "spec_guard_off_s": 0.0}  # fmt: skip


def decode(engine, handle, last, prompt_lp, stats: StepStats, fed: list[int]) -> None:
    """Engine._decode with speculation: the same events, stops and finish reasons, fewer target forwards."""
    req, params, runner = handle.request, handle.request.params, engine.runner
    sampler, experts_start, counters = Sampler(params), stats.experts_start, engine.counters
    guard, prompt_last = Guard(engine.costs), last  # the prompt-end snapshot keeps them
    if params.max_tokens == 0:  # only the prompt was scored (echo + logprobs)
        engine._finish(handle, TokenEvent(None, 0, finish_reason="length", prompt_logprobs=prompt_lp, stats=stats))
        return engine._save(req, req.prompt, prompt_last)
    index = 0

    def emit(s: Sample, step_stats: StepStats) -> bool:
        """Send one token as the plain engine does -> whether the request ended with it."""
        nonlocal index
        stop = (s.token in engine.eos_ids and not params.ignore_eos) or s.token in params.stop_token_ids
        done = "stop" if stop else ("length" if index + 1 == params.max_tokens else None)
        event = TokenEvent(s.token, index, s.logprob, s.top, done, stop_token=stop, stats=step_stats)
        if index == 0:
            event.prompt_logprobs = prompt_lp
        counters["tokens"] += 1
        index += 1
        if done:
            engine._finish(handle, event)
        else:
            handle.put(event)
        if index == 1:  # after the first token went out: TTFT does not wait for the copy
            engine._save(req, req.prompt, prompt_last)
        return done is not None

    coupled = not params.greedy and params.seed is not None

    def draw(logits: torch.Tensor) -> Sample:
        """The token at generated position `index` (the next one emitted), as the verify or a plain step sees it."""
        if not coupled or params.constraint is not None or sampler.sampled < params.min_tokens:
            return sampler(logits)
        return _sample(sampler, params, logits, _coupled(params, logits, sampler.sampled))

    first = draw(last)
    if emit(first, stats):
        return
    token, pos = first.token, len(req.prompt)  # sampled, not yet consumed
    while True:
        if handle.cancelled:
            return engine._finish(handle, TokenEvent(None, index, finish_reason="cancelled"))
        k = min(engine.speculative.k, params.max_tokens - index - 1)  # never compute past max_tokens
        # a constraint's state cannot be rolled back; min_tokens holds EOS back, which p would have to know; a plain
        # step is measured before the first draft (the guard compares against it)
        drafting = (
            k >= 1
            and not guard.off
            and engine.costs.plain is not None
            and params.constraint is None
            and sampler.sampled >= params.min_tokens
        )
        t = time.perf_counter()
        drafted = runner.draft(token, pos, k, _draw_params(params, sampler, coupled)) if drafting else None
        use = 0
        if drafted is not None:
            engine.costs.add_draft(time.perf_counter() - t)
            use = engine.costs.cut(len(drafted[0]), drafted[2])
            counters["spec_cut_tokens"] += len(drafted[0]) - use
        if use == 0:
            t1 = time.perf_counter()
            logits = runner.forward([token], pos, False)[-1]
            fed.append(token)
            pos += 1
            elapsed = time.perf_counter() - t
            engine.costs.add_plain(time.perf_counter() - t1)
            if drafted is not None:  # a drafting step whose verify was cut: judged as one
                guard.skipped()
            else:
                if guard.off:
                    counters["spec_guard_off_steps"] += 1
                    counters["spec_guard_off_s"] += elapsed
                guard.plain_step()
            step_stats = StepStats(experts_start, runner.counters(), step_s=elapsed)
            s = draw(logits)
            if emit(s, step_stats):
                return
            token = s.token
            continue
        ids, qlogits = drafted[0][:use], drafted[1][:use]
        t1 = time.perf_counter()
        logits = runner.verify([token, *ids], pos)
        out = _accept(sampler, params, ids, qlogits, logits, draw if coupled else None)
        n = len(out) - 1  # drafts kept
        runner.accept(n + 1)
        fed += [token, *ids[:n]]
        pos += n + 1
        elapsed = time.perf_counter() - t
        engine.costs.add_verify(len(ids), time.perf_counter() - t1)
        guard.verified(len(ids), n)
        counters["spec_verifies"] += 1
        counters["spec_draft_tokens"] += len(ids)
        counters["spec_accepted_tokens"] += n
        step_stats = StepStats(experts_start, runner.counters(), step_s=elapsed / len(out))
        for s in out:
            if emit(s, step_stats):
                return
        token = out[-1].token


SEED_MOD = 1 << 52  # seeds travel to the ranks as float64


def _draw_params(params, sampler: Sampler, coupled: bool) -> tuple:
    """(temperature, top_k, top_p, min_p, seed, index) of the draft's draws: coupled, the request's seed and the
    first drafted token's generated position (the token being verified is at sampler.sampled - 1); else a seed
    from the request's generator and index -1."""
    if params.greedy:
        return (0.0, 0, 1.0, 0.0, 0, -1)
    f = (params.temperature, params.top_k, params.top_p, params.min_p)
    if coupled:
        return (*f, params.seed % SEED_MOD, sampler.sampled)
    return (*f, int(sampler.rng.integers(SEED_MOD)), -1)


def _coupled(params, logits: torch.Tensor, index: int) -> int:
    p = probabilities(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    return coupled_pick(p, gumbel(params.seed % SEED_MOD, index, p.shape[0]))


def _accept(sampler: Sampler, params, ids: list[int], qlogits: torch.Tensor, logits: torch.Tensor,
            draw=None) -> list[Sample]:  # fmt: skip
    """The tokens a verify emits: the accepted drafts, then the target's own next token (its correction where a
    draft was rejected). logits [k+1, V]: row j is the target's distribution after the j-th fed token. draw: the
    coupled draw of a seeded request (its drafts are kept where they equal it), else None."""
    out = []
    for j, d in enumerate(ids):
        if params.greedy or draw is not None:
            s = sampler(logits[j]) if draw is None else draw(logits[j])  # the plain draw there, logprobs included
            out.append(s)
            if s.token != d:
                return out
            continue
        p = probabilities(logits[j], params.temperature, params.top_k, params.top_p, params.min_p)
        q = probabilities(qlogits[j], params.temperature, params.top_k, params.top_p, params.min_p)
        if sampler.rng.random() * float(q[d]) <= float(p[d]):
            out.append(_sample(sampler, params, logits[j], d))
            continue
        residual = (p - q).clamp_min(0)
        dist = residual if float(residual.sum()) > 0 else p
        out.append(_sample(sampler, params, logits[j], _pick(dist, sampler.rng.random())))
        return out
    out.append(sampler(logits[len(ids)]) if draw is None else draw(logits[len(ids)]))
    return out


def _sample(sampler: Sampler, params, logits: torch.Tensor, token: int) -> Sample:
    """A token drawn outside sampler() reported as sampler() would (its logprobs from the unfiltered logits)."""
    sampler.sampled += 1
    if params.logprobs is None:
        return Sample(token)
    lp = torch.log_softmax(logits.float().cpu(), dim=-1)
    return Sample(token, float(lp[token]), top_logprobs(lp, params.logprobs))


def _pick(probs: torch.Tensor, u: float) -> int:
    """The token at cumulative mass u * total of probs [V]."""
    c = probs.cumsum(0)
    return min(int(torch.searchsorted(c, u * float(c[-1]), right=True)), probs.shape[0] - 1)
