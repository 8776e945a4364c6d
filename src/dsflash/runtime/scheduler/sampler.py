"""logits -> next token (+ logprobs): greedy, temperature, top_k, top_p, min_p, min_tokens, per-request seed."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; k = the sampled token's logprob and the top k alternatives
    prompt_logprobs: int | None = None
    # vLLM's min_tokens: until this many tokens are out, EOS (eos_ids) and stop_token_ids are never sampled
    min_tokens: int = 0
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or not 0 <= self.min_p <= 1 or self.max_tokens < 0 or self.min_tokens < 0:
            raise ValueError("top_k >= 0, min_p in [0, 1], max_tokens >= 0 and min_tokens >= 0 are required")
        for k in (self.logprobs, self.prompt_logprobs):
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        # below ~1e-5 the scaled logits overflow to inf and softmax turns them into NaN; it is argmax anyway (as vLLM)
        return self.temperature < GREEDY_BELOW or self.top_k == 1


@dataclass(frozen=True)
class Sample:
    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None


class Sampler:
    """One per request: owns its random generator so a seed reproduces the sequence."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.sampled = 0  # tokens drawn so far: the engine calls once per generated token
        self.held_back = list({*params.eos_ids, *params.stop_token_ids}) if params.min_tokens else []
        self.gen = torch.Generator()
        self.gen.manual_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)

    def __call__(self, logits: torch.Tensor) -> Sample:
        """logits [V] fp32 -> the next token; logprobs are of the unmodified distribution, as vLLM reports them."""
        logits = logits.float().cpu()
        raw = logits
        if self.sampled < self.params.min_tokens and self.held_back:
            logits = logits.clone()
            logits[self.held_back] = -torch.inf
        self.sampled += 1
        token = _argmax(logits) if self.params.greedy else self._draw(logits)
        k = self.params.logprobs
        if k is None:
            return Sample(token)
        lp = torch.log_softmax(raw, dim=-1)
        return Sample(token, float(lp[token]), top_logprobs(lp, k))

    def _draw(self, logits: torch.Tensor) -> int:
        p = self.params
        x = logits / p.temperature
        if p.top_k > 0:
            kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, -torch.inf)
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0)
        if p.top_p < 1:
            sorted_p, order = probs.sort(descending=True)
            # drop a token once the mass before it already reaches top_p; the first always stays
            drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
            drop[0] = False  # a top_p below fp32's smallest value compares as 0 and would drop it too
            probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0))
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.gen))


def _argmax(logits: torch.Tensor) -> int:
    """The first index of the largest logit [V] (a NaN counts as largest, as in torch). numpy's: torch's argmax over a
    129k vocabulary took ~200 us a token on an AVX2 EPYC, numpy's ~15 us."""
    return int(logits.contiguous().numpy().argmax())


def top_logprobs(lp: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely tokens of log-probabilities lp [V], best first."""
    if k == 0:
        return ()
    values, ids = torch.topk(lp, k)
    return tuple(zip(ids.tolist(), values.tolist(), strict=True))
