"""runtime/scheduler/sampler.py on hand-made logits: greedy picks torch's argmax (ties and NaN alike), min_tokens
holds back EOS and stop ids and then lets them through, logprobs stay those of the unmodified logits."""

from __future__ import annotations

import math

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
