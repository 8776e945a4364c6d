"""Black-box: the official openai client (strict response validation) against a real server with the embedded model."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsflash.service.api import PREFIX_METRICS
from tests.server.conftest import API_KEY

THINK_OFF = {"chat_template_kwargs": {"thinking": False}}
Q = [{"role": "user", "content": "Say something."}]


def raw(server, path, body, **kw):
    return httpx.post(server.base + path, json=body, headers=server.headers, timeout=60, **kw)


# ---- models ------------------------------------------------------------------------------------------------------
def test_models_card(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["dsflash-tiny-v4.1"]
    card = models[0].model_dump()
    assert card["owned_by"] == "dsflash" and card["root"] and card["max_model_len"] == 1024
    assert client.models.retrieve("dsflash-tiny-v4.1").id == "dsflash-tiny-v4.1"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


# ---- chat --------------------------------------------------------------------------------------------------------
def test_chat_thinking_by_default_splits_reasoning(client, model):
    r = client.chat.completions.create(model=model, messages=Q, max_tokens=6, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    # thinking is on by default: the prompt opened <think>, so a random model's output is all reasoning
    assert msg.model_extra["reasoning_content"] and msg.content == ""
    assert r.usage.completion_tokens == 6 and r.usage.completion_tokens_details.reasoning_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_chat_stream_shape(client, model):
    chunks = list(
        client.chat.completions.create(
            model=model, messages=Q, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    middle = chunks[1:-2]
    assert len(middle) >= 1 and all(c.choices[0].delta.model_extra.get("reasoning_content") for c in middle)
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].choices[0].delta.content is None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(model=model, messages=Q, max_tokens=3, stream=True, temperature=0))
    assert all(c.choices for c in plain) and all(c.usage is None for c in plain)


def test_stream_and_non_stream_agree(client, model):
    kw = dict(model=model, messages=Q, max_tokens=12, temperature=0, extra_body=THINK_OFF)
    full = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))
    assert full == streamed and full


def test_async_client_streams(server, model):
    async def go():
        client = openai.AsyncOpenAI(
            base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, _strict_response_validation=True
        )
        stream = await client.chat.completions.create(
            model=model, messages=Q, max_tokens=4, temperature=0, stream=True, extra_body=THINK_OFF
        )
        text = [c.choices[0].delta.content async for c in stream if c.choices]
        full = await client.chat.completions.create(
            model=model, messages=Q, max_tokens=4, temperature=0, extra_body=THINK_OFF
        )
        await client.close()
        return "".join(t or "" for t in text), full.choices[0].message.content

    streamed, full = asyncio.run(go())
    assert streamed == full


def test_thinking_off_and_server_default_override(server, client, model):
    r = client.chat.completions.create(model=model, messages=Q, max_tokens=4, temperature=0, extra_body=THINK_OFF)
    assert r.choices[0].message.content and r.choices[0].message.model_extra["reasoning_content"] is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    on = raw(server, "/tokenize", {"messages": Q}).json()["tokens"]
    off = raw(server, "/tokenize", {"messages": Q, "chat_template_kwargs": {"thinking": False}}).json()["tokens"]
    assert on[-1] == 128821 and off[-1] == 128822  # <think> vs </think> closes the prompt


def test_content_parts_and_inbound_reasoning(client, model):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "Again"},
    ]
    r = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_sampling_parameters(client, model):
    kw = dict(model=model, messages=Q, max_tokens=8, extra_body={**THINK_OFF, "ignore_eos": True})

    def text(**more):
        return client.chat.completions.create(**kw, **more).choices[0].message.content

    assert text(temperature=1.0, seed=7) == text(temperature=1.0, seed=7)
    assert len({text(temperature=1.0, seed=s) for s in (1, 2, 3)}) > 1
    assert text(temperature=0) == text(temperature=0.7, top_p=1e-9)  # a vanishing nucleus is greedy
    r = client.chat.completions.create(
        **{**kw, "extra_body": {**kw["extra_body"], "top_k": 1, "min_p": 0.5}}, temperature=1.0, top_p=0.9
    )
    assert r.choices[0].message.content == text(temperature=0)
    assert client.chat.completions.create(**kw, max_completion_tokens=3).usage.completion_tokens == 3


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(
        model=model, messages=Q, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, extra_body=THINK_OFF
    )
    entries = r.choices[0].logprobs.content
    assert len(entries) == 5 and all(len(e.top_logprobs) == 3 for e in entries)
    assert all(e.token == e.top_logprobs[0].token and e.logprob <= 0 for e in entries)  # greedy: best first
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    stream = client.chat.completions.create(
        model=model, messages=Q, max_tokens=4, temperature=0, logprobs=True, top_logprobs=20, stream=True,
        extra_body=THINK_OFF,
    )  # fmt: skip
    got = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(got) == 4 and all(len(e.top_logprobs) == 20 for e in got)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=Q, logprobs=True, top_logprobs=21)


def test_stop_strings_and_stop_token_ids(server, client, model):
    kw = dict(model=model, messages=Q, max_tokens=24, temperature=0, extra_body={**THINK_OFF, "ignore_eos": True})
    free = client.chat.completions.create(**kw, logprobs=True).choices[0]
    text, tokens = free.message.content, [e.token for e in free.logprobs.content]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.chat.completions.create(**kw, stop=[stop, "never-there"]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == text[: text.index(stop)]
    stream = client.chat.completions.create(**kw, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text[: text.index(stop)]
    # n = 2 on this one-sequence server: the choices run one after another, each ending at its own stop
    both = client.chat.completions.create(**kw, stop=stop, n=2).choices
    assert [(c.index, c.message.content, c.finish_reason) for c in both] == [(i, cut.message.content, "stop") for i
                                                                             in range(2)]  # fmt: skip
    # a stop token id: the 4th token's id, found through /tokenize
    ids = raw(server, "/tokenize", {"prompt": tokens[3], "add_special_tokens": False}).json()["tokens"]
    if len(ids) == 1:
        body = {**kw["extra_body"], "stop_token_ids": ids}
        r = client.chat.completions.create(**{**kw, "extra_body": body}).choices[0]
        first = tokens.index(tokens[3])
        assert r.finish_reason == "stop" and r.message.content == "".join(tokens[:first])


# ---- completions -------------------------------------------------------------------------------------------------
def test_completions_text_and_token_prompts(server, client, model):
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("length", "stop")
    prompt_ids = raw(server, "/tokenize", {"prompt": "Once upon a time"}).json()["tokens"]
    assert r.usage.prompt_tokens == len(prompt_ids) and prompt_ids[0] == 0  # BOS first
    ids = client.completions.create(model=model, prompt=prompt_ids, max_tokens=5, temperature=0)
    assert ids.choices[0].text == r.choices[0].text
    assert client.completions.create(model=model, prompt="x", temperature=0).usage.completion_tokens <= 16  # default


def test_completions_stream_echo_logprobs(server, client, model):
    # OpenAI (and vLLM) stream completion chunks with "finish_reason": null until the last one, but openai-python's
    # Completion type makes finish_reason a required literal, so strict validation rejects every such stream:
    # this one test reads the stream with a lenient client and checks the shape itself
    lenient = openai.OpenAI(base_url=client.base_url, api_key=API_KEY, max_retries=0)
    chunks = list(
        lenient.completions.create(
            model=model,
            prompt="Hello",
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2]) and all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    r = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text == "Hello" + text
    r = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(t) >= 5 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    # echo + logprobs puts null for the first prompt token (OpenAI's legacy shape), which the strict client rejects
    body = {"model": model, "prompt": "Hello", "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0}
    lp = raw(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["tokens"]) == 2 + 2


# ---- errors through the client -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra,status",
    [
        ({"n": 17}, 400),
        ({"temperature": "hot"}, 400),
        ({"temperature": 2.5}, 400),
        ({"top_p": 0}, 400),
        ({"max_tokens": 0}, 400),
        ({"max_tokens": 5000}, 400),
        ({"seed": 1 << 64}, 400),
        ({"stop": [1, 2]}, 400),
        ({"presence_penalty": 0.5}, 400),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}}, 400),
        ({"tool_choice": "required"}, 400),  # no tools
        ({"chat_template_kwargs": {"thinkin": True}}, 400),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400),
        ({"messages": []}, 400),
        ({"model": "gpt-4o"}, 404),
    ],
)
def test_bad_chat_requests(server, extra, status):
    body = {"model": "dsflash-tiny-v4.1", "messages": Q, "max_tokens": 4, **extra}
    r = raw(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_client_exception_classes(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x " * 1100}], max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=["a", "b"])
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0, _strict_response_validation=True)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- tokenizer endpoints, health, metrics ------------------------------------------------------------------------
def test_tokenize_detokenize(server):
    t = raw(server, "/tokenize", {"model": "dsflash-tiny-v4.1", "prompt": "Hello world", "return_token_strs": True})
    body = t.json()
    assert body["tokens"][0] == 0 and body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    assert body["token_strs"][1:] == ["Hello", " world"]
    plain = raw(server, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()["tokens"]
    assert plain == body["tokens"][1:]
    assert raw(server, "/detokenize", {"tokens": plain}).json() == {"prompt": "Hello world"}
    assert raw(server, "/v1/detokenize", {"tokens": [10**9]}).status_code == 400


def _count(text: str, endpoint: str, outcome: str) -> float:
    want = {"model_name": "dsflash-tiny-v4.1", "endpoint": endpoint, "outcome": outcome}
    family = next(f for f in text_string_to_metric_families(text) if f.name == "dsflash:requests")
    return next(s.value for s in family.samples if s.name == "dsflash:requests_total" and s.labels == want)


def test_health_and_metrics(server, client, model):
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    before = httpx.get(server.base + "/metrics").text
    client.completions.create(model=model, prompt="x", max_tokens=2)
    raw(server, "/v1/chat/completions", {"messages": Q, "temperature": -1})
    text = httpx.get(server.base + "/metrics").text
    assert _count(text, "completion", "ok") == _count(before, "completion", "ok") + 1
    assert _count(text, "chat", "invalid") == _count(before, "chat", "invalid") + 1
    for name in (
        "dsflash:requests_total{",
        "dsflash:queue_depth",
        "dsflash:time_to_first_token_seconds_bucket",
        "dsflash:decode_tokens_per_second",
        "dsflash:expert_hits_total",
        "dsflash:expert_misses_total",
        "dsflash:expert_bytes_streamed_total",
    ):
        assert name in text


def test_metrics_parse_with_prometheus_clients_parser(server, client, model):
    """Every family parses; the prefix cache's series exist with the kinds the service declares and count a
    request's lookup and its snapshot; the process's own metrics are there; every dsflash series names the model."""

    def families() -> dict:
        r = httpx.get(server.base + "/metrics")
        assert r.headers["content-type"].startswith("text/plain")
        return {f.name: f for f in text_string_to_metric_families(r.text)}

    def prefix(fam: dict) -> dict[str, float]:
        out = {}
        for name, (kind, _) in PREFIX_METRICS.items():
            f = fam["dsflash:" + name.removesuffix("_total") if kind == "counter" else "dsflash:" + name]
            assert f.type == kind and len(f.samples) == 1 and f.samples[0].value >= 0, name
            out[name] = f.samples[0].value
        return out

    before = prefix(families())
    client.completions.create(model=model, prompt="metrics of the prefix cache", max_tokens=2)
    after = prefix(fam := families())
    assert after["prefix_cache_lookups_total"] == before["prefix_cache_lookups_total"] + 1
    assert after["prefix_cache_memory_bytes"] > 0  # the prompt's snapshot at least
    assert fam["dsflash:time_to_first_token_seconds"].type == "histogram"
    assert fam["dsflash:requests"].type == "counter" and fam["dsflash:ready"].samples[0].value == 1
    assert {"process_resident_memory_bytes", "process_cpu_seconds"} <= set(fam)
    ours = [s for name, f in fam.items() if name.startswith("dsflash:") for s in f.samples]
    assert ours and all(s.labels.get("model_name") == "dsflash-tiny-v4.1" for s in ours)
    assert not any(s.name.endswith("_created") for s in ours)


def test_request_log_line(server, client, model):
    r = client.completions.create(model=model, prompt="x", max_tokens=3, extra_body={"not_a_field": 1})
    for _ in range(50):  # the line is written just after the response has gone out
        lines = [line for line in server.output().splitlines() if f"req={r.id} " in line]
        if lines:
            break
        time.sleep(0.1)
    line = lines[0]
    for part in ("prompt=2 ", "out=3 ", "ttft=", "tok/s=", "hit=", "streamed=", "finish=length", "outcome=ok"):
        assert part in line
    assert line.endswith("ignored=not_a_field")


def test_a_request_logs_at_most_sixteen_ignored_names():
    from dsflash.server.app import log_line
    from dsflash.service.api import RequestStats

    line = log_line(RequestStats("req-1"), "ok", [f"f{i}" for i in range(20)])
    assert line.endswith(" ignored=" + ",".join(f"f{i}" for i in range(16)) + ",+4 more")


def test_a_field_name_cannot_forge_or_colour_a_log_line(server, client, model):
    """A field name with a newline and terminal escapes stays inside its request's one line, escaped and capped."""
    evil = "x\n\x1b[31mreq=forged outcome=ok" + "y" * 200
    r = client.completions.create(model=model, prompt="x", max_tokens=1, extra_body={evil: 1})
    for _ in range(50):
        lines = [line for line in server.output().splitlines() if f"req={r.id} " in line]
        if lines:
            break
        time.sleep(0.1)
    out = server.output()
    assert len(lines) == 1 and "\x1b" not in out and "req=forged" not in out.replace("\\x1b[31mreq=forged", "")
    assert lines[0].endswith("ignored=x\\n\\x1b[31mreq=forged\\x20outcome=ok" + "y" * 26 + "...")


# ---- vLLM's extras, the prefix-reuse seams, /version, /tokenizer_info -------------------------------------------
def test_usage_reports_cached_prompt_tokens_everywhere(client, model):
    """usage.prompt_tokens_details.cached_tokens, as OpenAI reports it (0 until the prefix cache restores any)."""
    r = client.chat.completions.create(model=model, messages=Q, max_tokens=2, extra_body={"cache_salt": "a"})
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    r = client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"cache_salt": "b"})
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.chat.completions.create(
        model=model, messages=Q, max_tokens=2, stream=True, stream_options={"include_usage": True},
        extra_body={"cache_salt": "c"},
    )  # fmt: skip
    last = list(stream)[-1]
    assert last.choices == [] and last.usage.prompt_tokens_details.cached_tokens == 0
    # the same request again (a regenerate): its prompt is held whole, with its last logits
    again = client.chat.completions.create(model=model, messages=Q, max_tokens=2, extra_body={"cache_salt": "a"})
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens > 0
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=Q, max_tokens=2, extra_body={"cache_salt": 7})
    assert e.value.param == "cache_salt"


def test_min_tokens_prompt_logprobs_and_logprobs_true(server, client, model):
    r = client.completions.create(
        model=model, prompt="Hello there", max_tokens=6, logprobs=True, extra_body={"min_tokens": 6, **THINK_OFF}
    )
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    assert all(len(top) <= 2 for top in r.choices[0].logprobs.top_logprobs)  # 1 alternative (+ the sampled token)
    body = raw(server, "/v1/completions", {"prompt": "Hello there", "max_tokens": 1, "prompt_logprobs": 2}).json()
    positions = body["choices"][0]["prompt_logprobs"]
    n = body["usage"]["prompt_tokens"]
    assert len(positions) == n and positions[0] is None and all(2 <= len(p) <= 3 for p in positions[1:])
    chat = raw(server, "/v1/chat/completions", {"messages": Q, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    err = raw(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}).json()["error"]
    assert err["param"] == "min_tokens"


def test_version_and_tokenizer_info(server):
    v = httpx.get(server.base + "/version").json()  # open, like /health
    assert v["model"] == "dsflash-tiny-v4.1" and v["version"] and "revision" in v
    assert httpx.get(server.base + "/tokenizer_info").status_code == 401  # the API key, like /tokenize
    info = httpx.get(server.base + "/tokenizer_info", headers=server.headers).json()
    assert info["model_max_length"] == 1024 and info["vocab_size"] > 1000 and info["add_bos_token"] is True
    ids = raw(server, "/tokenize", {"prompt": "Hi"}).json()["tokens"]
    assert raw(server, "/detokenize", {"tokens": ids[:1]}).json()["prompt"] == info["bos_token"]
    assert ids[0] == info["bos_token_id"] and info["eos_token_id"] == 1
