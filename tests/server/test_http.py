"""Raw HTTP against the real server: malformed bodies, size cap, unknown routes and methods, API key, SSE framing."""

from __future__ import annotations

import json

import httpx
import pytest

Q = [{"role": "user", "content": "hi"}]


def post(server, path, content=None, headers=None, **kw):
    h = {**server.headers, "content-type": "application/json", **(headers or {})}
    return httpx.post(server.base + path, content=content, headers=h, timeout=60, **kw)


def assert_envelope(r, status, code=None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert "param" in err and "code" in err
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"not json",
        b"[1, 2]",
        b'"a string"',
        b"null",
        b"\xff\xfe\x00garbage",
        b'{"messages": "hi"}',
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"messages": [{"role": "user"}]}',
        b'{"messages": [{"role": "user", "content": 5}]}',
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e999}',
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": true}',
        b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
        b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}',
        b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 10}}',
        b'{"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [-1]}',
        b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
        b'{"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"function": {}}]}]}',
        b'{"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "maybe"}}',
        b'{"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"}',
        b"[" * 100000 + b"]" * 100000,
    ],
)
def test_malformed_chat_bodies_are_400(server, body):
    assert_envelope(post(server, "/v1/chat/completions", body), 400)


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": []}',
        b'{"prompt": [[]]}',
        b'{"prompt": [1.5]}',
        b'{"prompt": [99999999]}',
        b'{"prompt": {"a": 1}}',
        b'{"prompt": "x", "logprobs": 21}',
        b'{"prompt": "x", "suffix": "y"}',
        b'{"prompt": "x", "best_of": 3, "stream": true}',
        b'{"prompt": "x", "n": 17}',
        b'{"prompt": "x", "max_tokens": -1}',
        b'{"prompt": "x", "echo": 1}',
        b'{"max_tokens": 3}',
    ],
)
def test_malformed_completion_bodies_are_400(server, body):
    assert_envelope(post(server, "/v1/completions", body), 400)


def test_context_overflow_is_400_with_code(server):
    r = post(server, "/v1/completions", json.dumps({"prompt": [5] * 1000, "max_tokens": 100}).encode())
    err = assert_envelope(r, 400, "context_length_exceeded")
    assert err["param"] == "max_tokens"
    r = post(server, "/v1/completions", json.dumps({"prompt": [5] * 1030}).encode())
    assert_envelope(r, 400, "context_length_exceeded")


def test_body_over_the_cap_is_413(server):
    big = b'{"prompt": "' + b"a" * (17 << 20) + b'"}'
    assert_envelope(post(server, "/v1/completions", big), 413, "request_too_large")

    def chunks():  # no Content-Length: the cap applies while reading
        yield b'{"prompt": "'
        for _ in range(17):
            yield b"a" * (1 << 20)
        yield b'"}'

    assert_envelope(post(server, "/v1/completions", chunks()), 413)


def test_unknown_routes_methods_and_models(server):
    assert_envelope(httpx.get(server.base + "/v2/nothing", headers=server.headers), 404)
    assert_envelope(httpx.get(server.base + "/v1/chat/completions", headers=server.headers), 405)
    r = httpx.delete(server.base + "/v1/models", headers=server.headers)
    assert_envelope(r, 405)
    assert r.headers["allow"] == "GET, HEAD"


def test_head_is_get_without_a_body(server):
    """Load balancers and uptime checks probe with HEAD: the GET routes answer it with GET's status and headers."""
    for path in ("/health", "/v1/models", "/metrics"):
        get, head = (httpx.request(m, server.base + path, headers=server.headers) for m in ("GET", "HEAD"))
        assert head.status_code == get.status_code == 200 and head.content == b"", path
        assert head.headers["content-type"] == get.headers["content-type"], path
    assert httpx.head(server.base + "/v1/chat/completions", headers=server.headers).status_code == 405


def test_unknown_models_and_bad_model_fields(server):
    r = post(server, "/v1/chat/completions", json.dumps({"model": "gpt-4", "messages": Q}).encode())
    assert_envelope(r, 404, "model_not_found")
    r = post(server, "/v1/completions", json.dumps({"model": 5, "prompt": "x"}).encode())
    assert_envelope(r, 400)


def test_api_key(server):
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic " + server.api_key}):
        r = httpx.post(server.base + "/v1/completions", content=body, headers=headers)
        assert_envelope(r, 401, "invalid_api_key")
    assert httpx.get(server.base + "/v1/models").status_code == 401
    assert httpx.post(server.base + "/tokenize", json={"prompt": "x"}).status_code == 401
    # health and metrics stay open for probes and scrapers
    assert httpx.get(server.base + "/health").status_code == 200
    assert httpx.get(server.base + "/metrics").status_code == 200
    assert post(server, "/v1/completions", body).status_code == 200


def test_sse_framing(server):
    body = {"messages": Q, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, headers=server.headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    datas = [e for e in events[:-2] if not e.startswith(":")]
    assert all(e.startswith("data: {") and "\n" not in e for e in datas)
    objs = [json.loads(e[len("data: ") :]) for e in datas]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 3


def test_openapi_document(server):
    doc = httpx.get(server.base + "/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize"} <= set(doc["paths"])


PREFLIGHT = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip


@pytest.fixture(scope="module")
def cors_server(open_server):
    return open_server[0]  # its --allowed-origins: http://ui.example, http://b.example


def test_a_browser_preflight_is_refused_without_allowed_origins(server):
    r = httpx.options(server.base + "/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = post(server, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 1}).encode(),
             headers={"Origin": "http://ui.example"})  # fmt: skip
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_a_browser_preflight_succeeds_with_allowed_origins(cors_server):
    r = httpx.options(cors_server.base + "/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.options(cors_server.base + "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    body = {"messages": Q, "max_tokens": 1}
    r = httpx.post(cors_server.base + "/v1/chat/completions", json=body, headers={"Origin": "http://b.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://b.example"
