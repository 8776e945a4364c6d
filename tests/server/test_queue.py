"""One sequence at a time: arrival order, a full queue answers 429, and a client that goes away frees the engine.

The shared server runs with --max-queue 1: one request running, one waiting, the third is refused.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest

Q = [{"role": "user", "content": "Tell me a long story."}]
LONG = 600  # tokens: ~20 s of decode, far longer than any wait below


def body(max_tokens: int, stream: bool = False) -> dict:
    return {
        "messages": Q,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
        "chat_template_kwargs": {"thinking": False},
    }


def metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.base + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")] = float(value)
    return out


def cancelled(server, endpoint="chat") -> float:
    return metrics(server)[f'dsflash:requests_total{{endpoint="{endpoint}",outcome="cancelled"}}']


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def idle(server) -> bool:
    m = metrics(server)
    return m["dsflash:requests_running"] == 0 and m["dsflash:queue_depth"] == 0


class StreamClient:
    """A streaming request on its own thread; close() drops the connection like a client that went away."""

    def __init__(self, server, max_tokens: int):
        self.first = threading.Event()
        self.done = threading.Event()
        self.status = None
        self.chunks = 0
        self.closing = False
        self._client = httpx.Client(headers=server.headers, timeout=120)
        self._thread = threading.Thread(target=self._run, args=(server, max_tokens), daemon=True)
        self._thread.start()

    def _run(self, server, max_tokens):
        try:
            with self._client.stream("POST", server.base + "/v1/chat/completions", json=body(max_tokens, True)) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.chunks += 1
                        self.first.set()
                    if self.closing:
                        break
        except httpx.HTTPError:
            pass
        finally:
            self.first.set()
            self.done.set()

    def close(self):
        self.closing = True
        self._client.close()
        self.done.wait(10)


def raw_request(server, payload: dict) -> socket.socket:
    """A request sent on a bare socket and never read: close() is a client that vanishes, at any moment."""
    data = json.dumps(payload).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {server.api_key}\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(head.encode() + data)
    return sock


@pytest.fixture(autouse=True)
def quiet(server):
    wait_for(lambda: idle(server), 30, "an idle server before the test")
    yield


def test_two_clients_are_served_in_arrival_order(server):
    ids = {}

    def call(name, tokens):
        r = httpx.post(server.base + "/v1/chat/completions", json=body(tokens), headers=server.headers, timeout=120)
        assert r.status_code == 200, r.text
        ids[name] = r.json()["id"]

    first = threading.Thread(target=call, args=("first", 40))
    first.start()
    wait_for(lambda: metrics(server)["dsflash:requests_running"] == 1, what="the first request to start")
    second = threading.Thread(target=call, args=("second", 2))
    second.start()
    first.join(60)
    second.join(60)
    # the server's own record of the order the requests ended in: the two client threads' clocks race each other
    # (their responses can come back within a fraction of a millisecond), the server's log lines do not
    out = server.wait_output(f"req={ids['second']} ")
    ended = [line for line in out.splitlines() if f"req={ids['first']} " in line or f"req={ids['second']} " in line]
    assert len(ended) == 2, ended
    # the second (short) request waited for the first (long) one although it needed far less work
    assert f"req={ids['first']} " in ended[0] and "out=40 " in ended[0] and "out=2 " in ended[1]


def test_full_queue_answers_429_with_retry_after(server):
    a = StreamClient(server, LONG)
    assert a.first.wait(30) and a.status == 200
    b = raw_request(server, body(LONG, stream=True))  # waits in the queue
    wait_for(lambda: metrics(server)["dsflash:queue_depth"] == 1, what="the second request to queue")
    r = httpx.post(server.base + "/v1/chat/completions", json=body(4), headers=server.headers)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    before = cancelled(server)
    b.close()  # a queued client goes away: it leaves the queue at once, although the engine is still busy
    wait_for(lambda: cancelled(server) == before + 1, 5, "the queued request to be cancelled")
    m = metrics(server)
    assert m["dsflash:queue_depth"] == 0 and m["dsflash:requests_running"] == 1
    c = raw_request(server, body(LONG, stream=True))  # so its place is free for the next client
    wait_for(lambda: metrics(server)["dsflash:queue_depth"] == 1, what="the next request to queue")
    c.close()
    a.close()
    wait_for(lambda: idle(server), 10, "the engine to be free after two disconnects")
    assert cancelled(server) >= before + 3
    assert metrics(server)['dsflash:requests_total{endpoint="chat",outcome="rejected"}'] >= 1


def test_disconnect_mid_stream_is_cancelled_and_the_next_request_starts_at_once(server):
    before = cancelled(server)
    a = StreamClient(server, LONG)
    wait_for(lambda: a.chunks >= 3, 30, "a few chunks")
    a.close()
    freed = wait_for(lambda: metrics(server)["dsflash:requests_running"] == 0, 5, "the engine to be freed")
    assert freed < 2
    wait_for(lambda: cancelled(server) == before + 1, 5, "the cancelled count")
    t0 = time.monotonic()
    r = httpx.post(server.base + "/v1/chat/completions", json=body(2), headers=server.headers, timeout=30)
    assert r.status_code == 200 and time.monotonic() - t0 < 5  # not behind the ~20 s the dropped request needed


def test_non_streaming_client_timeout_cancels_decode(server):
    before = cancelled(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/chat/completions", json=body(LONG), headers=server.headers, timeout=1.5)
    wait_for(lambda: idle(server), 5, "the engine to be freed")
    wait_for(lambda: cancelled(server) == before + 1, 5, "the cancelled count")


def test_disconnect_before_the_first_token_is_cancelled(server):
    """A client that gives up while its request waits or prefills: cancelled, and the engine is free at once."""
    before = cancelled(server, "completion")
    a = StreamClient(server, LONG)  # keeps the engine busy so the next one has to wait
    assert a.first.wait(30)
    body = {"prompt": [5] * 900, "max_tokens": 100, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json=body, headers=server.headers, timeout=0.5)
    a.close()
    wait_for(lambda: idle(server), 5, "the engine to be freed")
    wait_for(lambda: cancelled(server, "completion") == before + 1, 5, "the cancelled count")
