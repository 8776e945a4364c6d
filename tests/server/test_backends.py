"""The same API on other backends: the engine over two tensor-parallel ranks with a small slot pool (its expert
counters reach the request log and /metrics), and the CPU reference. The server does not care which runner
produces tokens."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.server.conftest import start_server


@pytest.fixture(scope="module")
def slots_server(tmp_path_factory, model_cache):
    tmp = tmp_path_factory.mktemp("slots")
    srv = start_server(tmp, model_cache, "--tp", "2", "--expert-slots", "24", "--max-model-len", "512")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_chat_and_completions_on_the_slot_engine(slots_server):
    out = slots_server.wait_output("backend engine")  # the ready card follows the first healthy /health
    assert "backend engine" in out and "24 expert slots per rank" in out and "TP 2" in out
    client = openai.OpenAI(
        base_url=slots_server.base + "/v1", api_key="x", max_retries=0, _strict_response_validation=True
    )
    chunks = list(
        client.chat.completions.create(
            model="dsflash-tiny-v4.1",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 12
    r = client.completions.create(model="dsflash-tiny-v4.1", prompt="Hello", max_tokens=6, temperature=0)
    again = client.completions.create(model="dsflash-tiny-v4.1", prompt="Hello", max_tokens=6, temperature=0)
    assert r.choices[0].text == again.choices[0].text  # greedy is deterministic through slot misses and hits
    metrics = httpx.get(slots_server.base + "/metrics").text
    values = {
        line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("dsflash:")
    }
    assert values["dsflash:expert_misses_total"] > 0 and values["dsflash:expert_bytes_streamed_total"] > 0
    for _ in range(50):
        lines = [line for line in slots_server.output().splitlines() if f"req={again.id} " in line]
        if lines:
            break
        time.sleep(0.1)
    assert "hit=-" not in lines[0] and "streamed=0B" not in lines[0]


def test_the_reference_backend_serves_the_same_api(tmp_path_factory, model_cache):
    tmp = tmp_path_factory.mktemp("reference")
    srv = start_server(tmp, model_cache, "--backend", "reference", "--max-model-len", "256")
    try:
        srv.wait_ready()
        out = srv.wait_output("backend reference")  # the ready card follows the first healthy /health
        assert "backend reference" in out and "skipped: the reference keeps every expert" in out
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, _strict_response_validation=True)
        r = client.completions.create(model="dsflash-tiny-v4.1", prompt="Hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
    finally:
        srv.stop()
