"""The client's timing and parsing against a scripted SSE server on loopback, the request bodies, the dispatcher."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dsflash.bench import client
from dsflash.bench.client import BenchError, Endpoint

GAP = 0.05


def chunk(obj):
    return f"data: {json.dumps(obj)}\n\n".encode()


SCRIPTS = {
    # (delay before, bytes): a ping before the first token, a finish chunk, usage, [DONE]
    "/v1/completions": [
        (0.0, b": ping\n\n"),
        (2 * GAP, chunk({"choices": [{"text": "a"}]})),
        (GAP, chunk({"choices": [{"text": "b"}]})),
        (GAP, chunk({"choices": [{"text": "c", "finish_reason": "length"}]})),
        (GAP, chunk({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})),
        (GAP, b"data: [DONE]\n\n"),
    ],
    "/v1/chat/completions": [
        (GAP, chunk({"choices": [{"delta": {"role": "assistant", "content": ""}}]})),
        (GAP, chunk({"choices": [{"delta": {"reasoning_content": "hm"}}]})),
        (GAP, chunk({"choices": [{"delta": {"content": "hi"}}]})),
        (0.0, b"data: [DONE]\n\n"),
    ],
    "/empty/completions": [
        (0.0, chunk({"choices": [], "usage": {"completion_tokens": 0}})),
        (0.0, b"data: [DONE]\n\n"),
    ],
}


class Handler(BaseHTTPRequestHandler):
    bodies: list = []
    in_flight = 0
    peak = 0
    lock = threading.Lock()

    def log_message(self, *a):
        pass

    def do_GET(self):
        data = json.dumps({"data": [{"id": "m1", "root": "/models/m1", "max_model_len": 64}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.bodies.append((self.path, body, dict(self.headers)))
        if self.path == "/slow/completions":
            with Handler.lock:
                Handler.in_flight += 1
                Handler.peak = max(Handler.peak, Handler.in_flight)
            time.sleep(GAP)
            with Handler.lock:
                Handler.in_flight -= 1
            script = SCRIPTS["/v1/completions"][1:2]
        elif self.path not in SCRIPTS:
            self.send_response(429, "Too Many Requests")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        else:
            script = SCRIPTS[self.path]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for delay, data in script:
            time.sleep(delay)
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture(scope="module")
def base():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_completions_timing(base):
    ep = Endpoint(base, "/v1/completions", "m1", {})
    o = client.send(ep, client.payload(ep, "x", 3, True, None), prompt_len=6, request_id="bench-1-0")
    assert o.success and o.generated_text == "abc"
    assert o.output_tokens == 3 and o.prompt_len == 7  # from usage
    assert o.ttft == pytest.approx(2 * GAP, abs=0.03)  # the ping does not count
    assert len(o.itl) == 2 and all(x == pytest.approx(GAP, abs=0.03) for x in o.itl)
    assert o.latency == pytest.approx(o.ttft + sum(o.itl))  # the usage chunk and [DONE] do not extend it
    path, body, headers = Handler.bodies[-1]
    assert body == {"model": "m1", "prompt": "x", "repetition_penalty": 1.0, "max_tokens": 3, "logprobs": None,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    assert headers["x-request-id"] == "bench-1-0"


def test_chat_counts_role_chunk_and_only_content(base):
    ep = Endpoint(base, "/v1/chat/completions", "m1", {"Authorization": "Bearer k"})
    o = client.send(ep, client.payload(ep, "x", 5, True, {"temperature": 0}), prompt_len=4)
    assert o.success and o.generated_text == "hi" and o.output_tokens == 0 and o.prompt_len == 4
    assert o.ttft == pytest.approx(GAP, abs=0.03) and len(o.itl) == 2
    _, body, headers = Handler.bodies[-1]
    assert body["messages"] == [{"role": "user", "content": [{"type": "text", "text": "x"}]}]
    assert body["max_completion_tokens"] == 5 and body["temperature"] == 0
    assert headers["Authorization"] == "Bearer k"


def test_failures(base):
    ep = Endpoint(base, "/empty/completions", "m1", {})
    o = client.send(ep, {"stream": True}, 1)
    assert not o.success and "Never received" in o.error
    o = client.send(Endpoint(base, "/nope/completions", "m1", {}), {}, 1)
    assert not o.success and o.status == 429 and o.error == "Too Many Requests"
    o = client.send(Endpoint("http://127.0.0.1:9", "/v1/completions", "m1", {}), {}, 1)
    assert not o.success and o.status == 0 and o.error


def test_first_model(base):
    assert client.first_model(base, {}) == ("m1", "/models/m1", 64)
    with pytest.raises(BenchError, match="cannot reach"):
        client.first_model("http://127.0.0.1:9", {})


def test_dispatcher_limits_concurrency(base):
    ep = Endpoint(base, "/slow/completions", "m1", {})
    Handler.peak = 0
    jobs = [lambda: client.send(ep, {}, 1) for _ in range(6)]
    outs = client.Dispatcher(2).run(jobs, [0.0] * 6)
    assert all(o.success for o in outs) and Handler.peak == 2
    assert max(o.client_queue_time for o in outs) >= GAP * 0.8


def test_arrival_times():
    assert client.arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    t = client.arrival_times(10, 5.0, seed=1)
    assert t == sorted(t) and t[-1] == pytest.approx(2.0) and t[0] > 0
    assert t == client.arrival_times(10, 5.0, seed=1) != client.arrival_times(10, 5.0, seed=2)
