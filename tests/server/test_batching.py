"""A server with --max-num-seqs 3: concurrent streams through the real openai client run as one batch, each
answers what it answers alone, and /metrics shows the batches; n choices and best_of run as sequences of one
request (streamed with their indexes, usage counting the prompt once)."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import start_server

THINK_OFF = {"chat_template_kwargs": {"thinking": False}, "ignore_eos": True}


@pytest.fixture(scope="module")
def batching(tmp_path_factory, model_cache):
    tmp = tmp_path_factory.mktemp("batching")
    srv = start_server(tmp, model_cache, "--max-num-seqs", "3", "--max-model-len", "256", "--no-prefix-cache")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _chat(client, model, i: int, max_tokens: int):
    """A streamed greedy chat with usage -> (text, usage)."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Story number {i}: " + "go on " * (3 * i)}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=THINK_OFF,
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    return text, usage


def _client(srv) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0,
                           _strict_response_validation=True)  # fmt: skip
    return client, client.models.list().data[0].id


def test_concurrent_streams_batch_and_answer_as_alone(batching):
    client, model = _client(batching)
    lengths = [12, 16, 20]
    got: list = [None] * 3
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _chat(client, model, i, lengths[i]))) for i in
               range(3)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    alone = [_chat(client, model, i, lengths[i]) for i in range(3)]
    for i, ((text, usage), (want, want_usage)) in enumerate(zip(got, alone, strict=True)):
        assert text == want and text, i
        assert usage.completion_tokens == lengths[i] == want_usage.completion_tokens
        assert usage.prompt_tokens == want_usage.prompt_tokens
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(batching.base + "/metrics").text)}
    buckets = families["dsflash:batch_size"].samples
    sizes = {float(s.labels["le"]): s.value for s in buckets if s.name.endswith("_bucket")}
    assert sizes[float("inf")] > sizes[1.0]  # some decode steps advanced several sequences
    steps = families["dsflash:step_tokens"].samples
    assert any(s.name.endswith("_count") and s.value > 0 for s in steps)


N_TOKENS = 6
ASK = [{"role": "user", "content": "Name three colours."}]


def _n_stream(client, model, n: int) -> tuple[dict[int, str], dict[int, str], object]:
    """A streamed chat of n choices -> (text by index, finish reason by index, usage)."""
    stream = client.chat.completions.create(model=model, messages=ASK, max_tokens=N_TOKENS, temperature=0, n=n,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=THINK_OFF)  # fmt: skip
    text, finish, usage = {}, {}, None
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    return text, finish, usage


def test_n_choices_streamed_and_folded_answer_as_one(batching):
    client, model = _client(batching)
    one = client.chat.completions.create(model=model, messages=ASK, max_tokens=N_TOKENS, temperature=0,
                                         extra_body=THINK_OFF)  # fmt: skip
    want = one.choices[0].message.content
    streamed: list = [None, None]
    threads = [threading.Thread(target=lambda i=i: streamed.__setitem__(i, _n_stream(client, model, 3))) for i in
               range(2)]  # fmt: skip
    for t in threads:  # two n=3 streams at once: six sequences over three slots
        t.start()
    full = client.chat.completions.create(model=model, messages=ASK, max_tokens=N_TOKENS, temperature=0, n=3,
                                          extra_body=THINK_OFF)  # fmt: skip
    for t in threads:
        t.join()
    assert [(c.index, c.message.content, c.finish_reason) for c in full.choices] == [(i, want, "length") for i in
                                                                                     range(3)]  # fmt: skip
    assert full.usage.prompt_tokens == one.usage.prompt_tokens
    assert full.usage.completion_tokens == 3 * N_TOKENS
    for text, finish, usage in streamed:
        assert text == {0: want, 1: want, 2: want} and finish == {0: "length", 1: "length", 2: "length"}
        assert (usage.prompt_tokens, usage.completion_tokens) == (one.usage.prompt_tokens, 3 * N_TOKENS)


def test_seeded_choices_differ_reproducibly_and_best_of_returns_the_likeliest(batching):
    client, model = _client(batching)

    def sampled(**kw):
        return client.completions.create(model=model, prompt="Once upon a time", max_tokens=N_TOKENS,
                                         temperature=1.0, seed=7, extra_body={"ignore_eos": True}, **kw)  # fmt: skip

    first, again = sampled(n=3, logprobs=0), sampled(n=3, logprobs=0)
    texts = [c.text for c in first.choices]
    assert len(set(texts)) > 1 and texts == [c.text for c in again.choices]
    best = sampled(n=1, best_of=3)  # the same three seeds (7, 8, 9), the likeliest returned
    score = {c.text: sum(c.logprobs.token_logprobs) for c in first.choices}
    assert [c.text for c in best.choices] == [max(score, key=score.get)]
    assert best.usage.completion_tokens == N_TOKENS
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=model, prompt="x", best_of=2, stream=True)
