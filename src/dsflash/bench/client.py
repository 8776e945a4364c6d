"""Streaming OpenAI requests, timed on the client exactly as `vllm bench serve` times them (stdlib HTTP only).

TTFT = first SSE message with a non-empty `choices` minus the time just before the POST; ITL = the gaps between
later `choices` messages (per chunk, not per token); latency = the last `choices` message minus the start (the usage
chunk and [DONE] do not extend it). Output tokens = usage.completion_tokens; the prompt length becomes
usage.prompt_tokens when the server reports it.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from dsflash.errors import DsflashError

TIMEOUT_S = 6 * 60 * 60  # vLLM's aiohttp total timeout


class BenchError(DsflashError):
    """The benchmark cannot run (server unreachable, no model, bad arguments)."""


@dataclass
class RequestOutput:
    """vLLM's RequestFuncOutput, the fields the metrics use."""

    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    error: str = ""
    start_time: float = 0.0
    client_queue_time: float = 0.0
    status: int = 0  # HTTP status (0: no response)


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # scheme://host:port[/prefix], no trailing slash
    path: str  # /v1/completions or /v1/chat/completions
    model: str
    headers: dict

    @property
    def chat(self) -> bool:
        return self.path.rstrip("/").endswith("chat/completions")


def api_headers() -> dict:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _connection(base_url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    u = urlsplit(base_url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise BenchError(f"--base-url must be http(s)://host[:port], got {base_url!r}")
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return cls(u.hostname, u.port, timeout=timeout), u.path.rstrip("/")


def get_text(base_url: str, path: str, headers: dict, timeout: float = 30) -> str | None:
    """GET -> the body as text, None where the server has no such route or cannot be reached (an optional probe)."""
    try:
        conn, prefix = _connection(base_url, timeout)
        conn.request("GET", prefix + path, headers=dict(headers))
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
    except OSError:
        return None
    return raw.decode(errors="replace") if resp.status == 200 else None


def get_json(base_url: str, path: str, headers: dict, body: dict | None = None, timeout: float = 30) -> dict:
    """GET (or POST with a JSON body) -> parsed JSON; raises BenchError with the reason."""
    try:
        conn, prefix = _connection(base_url, timeout)
        data = json.dumps(body).encode() if body is not None else None
        hdrs = {**headers, "Content-Type": "application/json"} if data else dict(headers)
        conn.request("POST" if data else "GET", prefix + path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
    except OSError as e:
        raise BenchError(f"cannot reach {base_url}{path}: {e}") from None
    if resp.status != 200:
        raise BenchError(f"{base_url}{path}: HTTP {resp.status} {raw[:200].decode(errors='replace')}")
    try:
        return json.loads(raw)
    except ValueError:
        raise BenchError(f"{base_url}{path}: the answer is not JSON") from None


def first_model(base_url: str, headers: dict) -> tuple[str, str, int | None]:
    """(id, root, max_model_len) of the first model of GET /v1/models, as `vllm bench serve` picks it."""
    data = get_json(base_url, "/v1/models", headers).get("data") or []
    if not data:
        raise BenchError(f"no models found on the server at {base_url}")
    card = data[0]
    return card["id"], card.get("root") or card["id"], card.get("max_model_len")


def payload(ep: Endpoint, prompt: str, output_len: int, ignore_eos: bool, extra_body: dict | None) -> dict:
    """vLLM's request body for the openai (completions) and openai-chat backends."""
    if ep.chat:
        body = {
            "model": ep.model,
            "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
            "max_completion_tokens": output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    else:
        body = {
            "model": ep.model,
            "prompt": prompt,
            "repetition_penalty": 1.0,
            "max_tokens": output_len,
            "logprobs": None,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    if ignore_eos:
        body["ignore_eos"] = True
    if extra_body:
        body.update(extra_body)
    return body


def send(ep: Endpoint, body: dict, prompt_len: int, request_id: str | None = None) -> RequestOutput:
    """One streamed request, timed with time.perf_counter()."""
    out = RequestOutput(prompt_len=prompt_len)
    headers = {**ep.headers, "Content-Type": "application/json"}
    if request_id:
        headers["x-request-id"] = request_id
    data = json.dumps(body).encode()
    text = []
    st = time.perf_counter()
    out.start_time = st
    last = st
    first = False
    try:
        conn, prefix = _connection(ep.base_url, TIMEOUT_S)
        conn.request("POST", prefix + ep.path, body=data, headers=headers)
        resp = conn.getresponse()
        out.status = resp.status
        if resp.status != 200:
            out.error = resp.reason or f"HTTP {resp.status}"
            resp.read()
            conn.close()
            return out
        for message in _sse_messages(resp):
            if message.startswith(":"):  # SSE comment (keep-alive ping)
                continue
            chunk = message.removeprefix("data: ")
            if chunk == "[DONE]":
                continue
            now = time.perf_counter()
            obj = json.loads(chunk)
            if choices := obj.get("choices"):
                if not first:
                    first = True
                    out.ttft = now - st
                else:
                    out.itl.append(now - last)
                last = now
                c = choices[0]
                piece = (c.get("delta") or {}).get("content") if ep.chat else c.get("text")
                text.append(piece or "")
            elif usage := obj.get("usage"):
                out.output_tokens = usage.get("completion_tokens") or 0
                if usage.get("prompt_tokens") is not None:
                    out.prompt_len = usage["prompt_tokens"]
        conn.close()
        out.generated_text = "".join(text)
        out.success = first
        if not first:
            out.error = "Never received a valid chunk to calculate TTFT. This response will be marked as failed!"
        out.latency = last - st
    except Exception:
        out.success = False
        out.error = traceback.format_exc()
    return out


def _sse_messages(resp):
    """Messages of an SSE stream: split on blank lines, stripped (vLLM's StreamedResponseHandler)."""
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in buf:
            message, buf = buf.split(b"\n\n", 1)
            message = message.strip()
            if message:
                yield message.decode()
    if buf.strip():
        yield buf.strip().decode()


def request_ids(n: int) -> list[str]:
    """x-request-id values like vLLM's: bench-<hex>-<i>."""
    tag = uuid.uuid4().hex[:8]
    return [f"bench-{tag}-{i}" for i in range(n)]


class Dispatcher:
    """Starts requests at their arrival times (all at once for rate inf), at most `max_concurrency` in flight;
    one thread per request, since each mostly waits on its socket."""

    def __init__(self, max_concurrency: int | None):
        self._sem = threading.BoundedSemaphore(max_concurrency) if max_concurrency else None

    def run(self, jobs: list, arrivals: list[float]) -> list[RequestOutput]:
        """jobs: callables -> RequestOutput; arrivals: seconds after start at which each is due."""
        results: list[RequestOutput | None] = [None] * len(jobs)
        threads = []
        t0 = time.perf_counter()
        for i, (job, at) in enumerate(zip(jobs, arrivals)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=self._one, args=(job, i, results), daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        return results  # type: ignore[return-value]

    def _one(self, job, i: int, results: list) -> None:
        arrived = time.perf_counter()
        if self._sem is not None:
            self._sem.acquire()
        try:
            out = job()
        finally:
            if self._sem is not None:
                self._sem.release()
        out.client_queue_time = out.start_time - arrived
        results[i] = out


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent: all at 0 for rate inf, else gamma-distributed gaps
    (Poisson for burstiness 1) rescaled so the last one is due at n / rate, as `vllm bench serve` does."""
    import numpy as np

    if rate == float("inf"):
        return [0.0] * n
    gaps = np.random.RandomState(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    t = np.cumsum(gaps)
    return (t * (n / rate) / t[-1]).tolist() if t[-1] > 0 else t.tolist()
