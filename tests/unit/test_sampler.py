"""runtime/scheduler/sampler.py on hand-made logits: greedy picks torch's argmax (ties and NaN alike), min_tokens
holds back EOS and stop ids and then lets them through, logprobs stay those of the unmodified logits; a
constraint (structured output) masks first, and its logprobs are of the masked distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsflash.runtime.scheduler.sampler import Sampler, SamplingParams


def test_greedy_is_torchs_argmax_with_its_ties_and_nans():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randn(129280, generator=g)
        assert Sampler(SamplingParams(temperature=0))(x).token == int(x.argmax())
    tie = torch.zeros(10)
    tie[[3, 7]] = 5.0
    assert Sampler(SamplingParams(temperature=0))(tie).token == int(tie.argmax()) == 3
    nan = torch.zeros(10)
    nan[[2, 6]] = float("nan")
    assert Sampler(SamplingParams(temperature=0))(nan).token == int(nan.argmax()) == 2


def test_min_tokens_holds_back_eos_and_stop_ids_then_lets_them_through():
    x = torch.zeros(10)
    x[1], x[4], x[8] = 9.0, 8.0, 7.0  # 1 is EOS, 4 a stop id, 8 the best of the rest
    s = Sampler(SamplingParams(temperature=0, min_tokens=2, eos_ids=(1,), stop_token_ids=(4,), logprobs=1))
    first, second, third = s(x), s(x), s(x)
    assert (first.token, second.token, third.token) == (8, 8, 1)
    assert math.isclose(first.logprob, float(torch.log_softmax(x, -1)[8]), rel_tol=1e-6)  # unmodified distribution
    assert first.top[0][0] == 1
    drawn = Sampler(SamplingParams(temperature=1.0, seed=3, min_tokens=50, eos_ids=(1,), stop_token_ids=(4,)))
    assert all(drawn(x).token not in (1, 4) for _ in range(50))


class _Allow:
    """A TokenConstraint that allows a fixed set of ids and records what it was advanced with."""

    def __init__(self, ids, n: int):
        self.bits = np.packbits(np.isin(np.arange(n), list(ids)), bitorder="little")
        self.seen: list[int] = []

    def allowed(self):
        return self.bits

    def advance(self, token: int) -> None:
        self.seen.append(token)


def test_a_constraint_masks_before_sampling_and_logprobs_are_of_the_masked_distribution():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    allow = {3, 500, 999}
    states = []

    def make():
        states.append(_Allow(allow, 997))  # shorter than the logits: ids past its end are forbidden (999 too)
        return states[-1]

    s = Sampler(SamplingParams(temperature=0, logprobs=5, constraint=make))
    out = s(x)
    assert out.token == max((3, 500), key=lambda i: float(x[i])) and states[0].seen == [out.token]
    masked = torch.full_like(x, -torch.inf)
    masked[[3, 500]] = x[[3, 500]]
    assert math.isclose(out.logprob, float(torch.log_softmax(masked, -1)[out.token]), rel_tol=1e-6)
    assert {t for t, lp in out.top if lp > -math.inf} == {3, 500}
    drawn = Sampler(SamplingParams(temperature=1.0, seed=2, constraint=make))
    assert {drawn(x).token for _ in range(40)} == {3, 500}


def test_a_constraint_that_allows_only_eos_wins_over_min_tokens():
    x = torch.zeros(16)
    s = Sampler(SamplingParams(temperature=0, min_tokens=5, eos_ids=(1,), constraint=lambda: _Allow({1}, 16)))
    assert s(x).token == 1  # not NaN, not a forbidden token: the grammar is complete, EOS is the only way on
    free = Sampler(SamplingParams(temperature=0, min_tokens=5, eos_ids=(1,), constraint=lambda: _Allow({1, 7}, 16)))
    assert free(x).token == 7  # where the grammar leaves another choice, min_tokens still holds EOS back


def _filtered(x: torch.Tensor, temperature=1.0, top_k=0, min_p=0.0, top_p=1.0) -> np.ndarray:
    """The distribution the sampler must draw from, written the plain way: softmax, then the filters over a sort."""
    p = torch.softmax(x / temperature, -1).double().numpy()
    order = np.argsort(-p, kind="stable")
    keep = np.ones_like(p, dtype=bool)
    if top_k:
        keep[order[top_k:]] = False
    keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0)
    before = np.cumsum(q[order]) - q[order]
    keep[order[1:][before[1:] >= top_p * q.sum()]] = False
    q = np.where(keep, p, 0)
    return q / q.sum()


def test_sampled_frequencies_follow_the_filtered_distribution():
    """Each filter alone and together, on a vocabulary large enough for the sampler's block draw and for a nucleus
    beyond its first candidates (10k tokens near the top): the frequencies of 1500 draws match the plain
    computation (total variation, bounded well above the noise), and nothing outside the support is ever drawn."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32768, generator=g) * 0.5
    x[:10000] += 4.0  # a nucleus of thousands of tokens
    x[10000:10008] += torch.tensor([9.0, 8.5, 8.0, 7.5, 7.0, 6.0, 5.0, 4.0])
    for kw in ({}, {"temperature": 0.5}, {"top_k": 5}, {"min_p": 0.2}, {"top_p": 0.6}, {"top_p": 0.995},
               {"temperature": 0.7, "top_k": 3000, "min_p": 0.001, "top_p": 0.9}):  # fmt: skip
        want = _filtered(x, **kw)
        s = Sampler(SamplingParams(seed=11, **kw))
        draws = np.array([s(x).token for _ in range(1500)])
        assert want[draws].min() > 0, kw
        # compare on the 8 heavy tokens and the mass of the rest
        got = np.bincount(draws, minlength=x.numel()) / draws.size
        heavy = np.arange(10000, 10008)
        tv = np.abs(got[heavy] - want[heavy]).sum() + abs(got.sum() - got[heavy].sum() - (1 - want[heavy].sum()))
        assert tv < 0.09, (kw, tv)


def test_a_seed_reproduces_its_draws():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(2))
    one = Sampler(SamplingParams(seed=7, top_p=0.9))
    two = Sampler(SamplingParams(seed=7, top_p=0.9))
    assert [one(x).token for _ in range(50)] == [two(x).token for _ in range(50)]


def test_nan_or_fully_masked_logits_fail_the_draw():
    for bad in (torch.full((100,), float("nan")), torch.full((100,), -float("inf"))):
        with pytest.raises(ValueError, match="no token can be drawn"):
            Sampler(SamplingParams(temperature=0.8, seed=1))(bad)
