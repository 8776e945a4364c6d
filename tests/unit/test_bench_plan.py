"""`dsflash bench`'s plan: what the options and a workload preset send, and bad options refused before any request."""

import pytest

from dsflash.bench.client import BenchError
from dsflash.bench.options import BenchOptions
from dsflash.bench.run import make_plan


def test_a_workload_sets_lengths_prompts_and_one_user():
    plan = make_plan(BenchOptions(workload="chat", scale=0.25))
    assert (plan.input_len, plan.output_len, plan.num_prompts, plan.max_concurrency) == (32, 64, 3, 1)
    assert plan.path == "/v1/completions" and plan.backend == "openai"
    assert plan.metadata == {"workload": "chat", "profile": "default", "scale": 0.25}
    assert plan.metrics == ("ttft", "tpot", "itl", "e2el") and plan.percentiles == (99.0,)


def test_the_chat_backend_picks_the_chat_path():
    assert make_plan(BenchOptions(backend="openai-chat")).path == "/v1/chat/completions"
    assert make_plan(BenchOptions(endpoint="chat")).backend == "openai-chat"


@pytest.mark.parametrize(
    "opts,message",
    [
        (BenchOptions(scale=0), "--scale must be positive"),
        (BenchOptions(num_prompts=0), "--num-prompts must be at least 1"),
        (BenchOptions(max_concurrency=0), "--max-concurrency must be greater than 0"),
        (BenchOptions(endpoint="v1/x"), "--endpoint: expected completions, chat or a path"),
        (BenchOptions(percentile_metrics="ttft,speed"), "--percentile-metrics: unknown ['speed']"),
    ],
)
def test_bad_options_fail_before_any_request(opts, message):
    with pytest.raises(BenchError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make_plan(opts)


def test_multi_turn_plan_and_turn_means():
    from dsflash.bench.client import RequestOutput
    from dsflash.bench.metrics import by_turn
    from dsflash.bench.options import BenchOptions
    from dsflash.bench.run import make_plan

    plan = make_plan(BenchOptions(workload="multi-turn"))
    assert (plan.input_len, plan.output_len, plan.num_prompts, plan.turns, plan.turn_len) == (4096, 64, 2, 4, 64)
    assert plan.metadata["turns"] == 4 and plan.max_concurrency == 1
    assert make_plan(BenchOptions(workload="multi-turn", scale=0.5, turns=3)).turn_len == 32
    outs = [RequestOutput(success=True, ttft=t) for t in (2.0, 0.1, 0.3, 4.0, 0.2, 0.5)]
    got = by_turn(outs, [0, 1, 2, 0, 1, 2])
    assert got["mean_ttft_ms_by_turn"] == pytest.approx([3000, 150, 400])
