"""A server with --max-num-seqs 3: concurrent streams through the real openai client run as one batch, each
answers what it answers alone, and /metrics shows the batches."""

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


def test_concurrent_streams_batch_and_answer_as_alone(batching):
    client = openai.OpenAI(base_url=batching.base + "/v1", api_key="none", max_retries=0,
                           _strict_response_validation=True)  # fmt: skip
    model = client.models.list().data[0].id
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
