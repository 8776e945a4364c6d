"""logits -> next token (+ logprobs): greedy, temperature, top_k, top_p, min_p, min_tokens, per-request seed, and a
per-request constraint on which tokens may come next (structured output; the runtime knows only the mask)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from dsflash.model.sampling import filtered

MAX_TOP_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily


class TokenConstraint(Protocol):
    """One sequence's allowed-token state: allowed() before each draw, advance() with the token drawn."""

    def allowed(self) -> np.ndarray | None:
        """uint8 [ceil(n / 8)]: bit i % 8 (little-endian) of byte i // 8 set where token i may come next (the
        bitmask grammar engines compute; ids past its end may not), or None: any token."""
        ...

    def advance(self, token: int) -> None: ...


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
    # a fresh TokenConstraint per sequence (structured output), or None; the sampler applies its mask before anything
    # else, and logprobs are then those of the masked distribution
    constraint: Callable[[], TokenConstraint] | None = field(default=None, compare=False)

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
        self.constraint = params.constraint() if params.constraint is not None else None
        self.rng = np.random.default_rng(params.seed if params.seed is not None else int.from_bytes(os.urandom(8)))

    def __call__(self, logits: torch.Tensor) -> Sample:
        """logits [V] fp32 -> the next token; logprobs are of the distribution before min_tokens' hold-back, as vLLM
        reports them (after a constraint's mask: what it forbids has probability 0)."""
        logits = logits.float().cpu()
        allowed = self.constraint.allowed() if self.constraint is not None else None
        if allowed is not None:
            logits = _mask(logits, allowed)
        raw = logits
        if self.sampled < self.params.min_tokens and self.held_back:
            held = logits.clone()
            held[self.held_back] = -torch.inf
            if allowed is None or bool(torch.isfinite(held).any()):  # a constraint that allows only EOS wins
                logits = held
        self.sampled += 1
        token = _argmax(logits) if self.params.greedy else self._draw(logits)
        if self.constraint is not None:
            self.constraint.advance(token)
        k = self.params.logprobs
        if k is None:
            return Sample(token)
        lp = torch.log_softmax(raw, dim=-1)
        return Sample(token, float(lp[token]), top_logprobs(lp, k))

    def _draw(self, logits: torch.Tensor) -> int:
        """One draw from what the filters keep (model.sampling: the definition speculative decoding shares)."""
        p = self.params
        ids, v = filtered(logits, p.temperature, p.top_k, p.top_p, p.min_p)
        i = _pick(v, self.rng.random())
        return i if ids is None else int(ids[i])


def _pick(v: np.ndarray, u: float, block: int = 1024) -> int:
    """The index at mass u * sum(v) of the unnormalised probabilities v >= 0, in float64: first the block (block
    sums), then the index inside it, so no cumulative sum runs over the whole vocabulary."""
    sums = np.cumsum(np.add.reduceat(v, np.arange(0, v.shape[0], block), dtype=np.float64))
    target = u * sums[-1]
    b = min(int(np.searchsorted(sums, target, side="right")), sums.shape[0] - 1)
    rest = target - (sums[b - 1] if b else 0.0)
    part = np.cumsum(v[b * block : (b + 1) * block], dtype=np.float64)
    return b * block + min(int(np.searchsorted(part, rest, side="right")), part.shape[0] - 1)


# byte -> the 8 logit offsets its bits mean (0: allowed, -inf: not)
_BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool), 0, -np.inf
).astype(np.float32)


def _mask(logits: torch.Tensor, allowed: np.ndarray) -> torch.Tensor:
    """logits [V] with -inf where the bitmask allowed [ceil(n / 8)] has no bit (or ends). A table lookup per byte and
    one add, in numpy: ~5x faster than unpacking to bools and a where (numbers in docs/performance.md)."""
    x = logits.contiguous().numpy()
    n = x.shape[0]
    bias = np.take(_BYTE_BIAS, allowed, axis=0).reshape(-1)
    if bias.shape[0] < n:
        bias = np.concatenate([bias, np.full(n - bias.shape[0], -np.inf, dtype=np.float32)])
    return torch.from_numpy(np.add(x, bias[:n]))


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
