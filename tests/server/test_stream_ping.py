"""The server in process, on a real socket: a quiet stream (long prefill) gets comment pings, requests one after
another reuse the worker threads (none is started per request), no response waits for a delayed ACK, a model id
with a slash is a path, Retry-After is the queue's expected wait."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest

from dsflash.runtime.scheduler.engine import Engine
from dsflash.server import app as app_module
from dsflash.server import http
from dsflash.server.app import App
from dsflash.service.generator import Generator
from dsflash.text.tokenizer import Tokenizer
from tests.server.scripted import ScriptedRunner


class SlowPrefill(ScriptedRunner):
    def forward(self, tokens, start_pos, all_logits):
        if start_pos == 0:
            time.sleep(0.6)
        return super().forward(tokens, start_pos, all_logits)


@pytest.fixture()
def served(monkeypatch):
    monkeypatch.setattr(app_module, "PING_INTERVAL", 0.1)
    tok = Tokenizer.bundled("v41")
    runner = SlowPrefill(tok.encode(" a b c"), tok.vocab_size, eos=tok.eos_id)
    engine = Engine(runner, tok.eos_ids, max_queue=1).start()
    app = App("m", aliases=("org/name",))  # a repo id as an alias: it holds a slash
    app.attach(Generator(engine, tok, 4096))
    sock = http.bind("127.0.0.1", 28950)
    server = http.make_server(app, lambda: None, grace=1.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for _ in range(100):
        try:
            httpx.get(base + "/health")
            break
        except httpx.HTTPError:
            time.sleep(0.05)
    yield base
    server.should_exit = True
    thread.join(10)
    engine.close()


def test_a_quiet_stream_gets_pings_and_workers_are_reused(served):
    body = {"prompt": "x", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", served + "/v1/completions", json=body, timeout=30) as r:
        events = [e for e in r.read().decode().split("\n\n") if e]
    first_data = next(i for i, e in enumerate(events) if e.startswith("data: {"))
    assert first_data >= 3 and all(e == ": ping" for e in events[:first_data])  # 0.6 s of prefill, a ping each 0.1 s
    assert events[-1] == "data: [DONE]"
    before = {t.ident for t in threading.enumerate() if t.name == "dsflash-req"}
    for _ in range(3):
        assert httpx.post(served + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    assert {t.ident for t in threading.enumerate() if t.name == "dsflash-req"} == before


def test_nagle_is_off_so_a_response_does_not_wait_for_a_delayed_ack(served):
    """asyncio disables Nagle only on sockets whose proto is TCP; ours once said 0, and each response's second write
    waited ~40 ms for the client's delayed ACK."""
    sock = http.bind("127.0.0.1", 28990)
    with sock, socket.create_connection(sock.getsockname()):
        conn, _ = sock.accept()
        with conn:
            assert conn.proto == socket.IPPROTO_TCP and conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    with httpx.Client() as client:
        took = []
        for _ in range(15):
            t0 = time.perf_counter()
            assert client.get(served + "/health").status_code == 200
            took.append(time.perf_counter() - t0)
    assert sorted(took)[len(took) // 2] < 0.02  # 40 ms and more with Nagle on


def test_a_model_is_found_under_an_alias_with_a_slash(served):
    client = openai.OpenAI(base_url=served + "/v1", api_key="x", max_retries=0)
    assert client.models.retrieve("org/name").id == "m"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/other")


def _gauge(base: str, name: str) -> float:
    line = next(x for x in httpx.get(base + "/metrics").text.splitlines() if x.startswith(f"dsflash:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def _wait(cond, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < 10, what
        time.sleep(0.02)


def test_retry_after_is_the_queues_expected_wait_over_http(served):
    """A request takes ~0.6 s here (its prefill); with one running and one waiting, the next is told to come back
    after about two of them, not after a fixed second."""
    assert httpx.post(served + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    body = {"prompt": "x", "max_tokens": 3, "stream": True}
    streams = [threading.Thread(target=lambda: httpx.post(served + "/v1/completions", json=body, timeout=30))]
    streams[0].start()
    _wait(lambda: _gauge(served, "requests_running") == 1, "the first request to run")
    streams.append(threading.Thread(target=lambda: httpx.post(served + "/v1/completions", json=body, timeout=30)))
    streams[1].start()
    _wait(lambda: _gauge(served, "queue_depth") == 1, "the second request to wait")
    r = httpx.post(served + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert 2 <= int(r.headers["retry-after"]) <= 5, r.headers["retry-after"]
    for t in streams:
        t.join(30)
