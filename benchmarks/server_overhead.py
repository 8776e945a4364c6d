"""What the HTTP server adds to a request: TTFT beyond model time, and time per streamed token beyond the model's
step, with a runner that only sleeps (so every other microsecond is overhead).

The same script runs against any checkout that has server.app.App + server.http (PYTHONPATH=<checkout>/src), so
"before" and "after" a change to the server are measured alike. Three clocks per request:
  model     the runner's own time in forward() (prefill, then each decode step)
  service   the in-process Generator: submit -> first Delta, and between Deltas (engine thread, sampler, text)
  http      a streaming client in its own process (as a real client: it shares no GIL with the server) over
            loopback: request sent -> first content chunk, and between chunks
so overhead(http) - overhead(service) is the server's own share (routing, parsing, rendering, SSE, the event loop).

    PYTHONPATH=src python benchmarks/server_overhead.py --requests 40 --tokens 64 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import torch

from dsflash.runtime.scheduler.engine import Engine
from dsflash.server import http
from dsflash.server.app import App
from dsflash.service.api import ChatRequest, GenerationOptions
from dsflash.service.generator import Generator
from dsflash.text.chat import ChatOptions
from dsflash.text.tokenizer import Tokenizer


class SleepRunner:
    """forward() sleeps a fixed model time and names one token (never EOS): a model of exactly known cost."""

    def __init__(self, vocab: int, token: int, prefill_s: float, step_s: float, max_len: int = 4096):
        self.vocab_size, self.max_len, self.prefill_s, self.step_s = vocab, max_len, prefill_s, step_s
        self.logits = torch.zeros(1, vocab)
        self.logits[0, token] = 10.0
        self.model_s: list[float] = []  # per forward call, measured
        self.per_request: list[list[float]] = []  # the same, one list per request (a prefill starts one)

    def reset(self) -> None:
        pass

    def forward(self, tokens, start_pos, all_logits):
        t = time.perf_counter()
        time.sleep(self.prefill_s if start_pos == 0 else self.step_s)
        out = self.logits.expand(len(tokens), -1) if all_logits else self.logits
        took = time.perf_counter() - t
        self.model_s.append(took)
        if start_pos == 0:
            self.per_request.append([])
        self.per_request[-1].append(took)
        return out

    def counters(self):
        from dsflash.counters import ExpertCounters

        return ExpertCounters()


def _bind() -> socket.socket:
    """Our own listening socket, Nagle off, so that trees whose http.bind left it on (before issue 22: every response
    waited ~40 ms for a delayed ACK) are compared on their request path, not on that; --tree-bind measures theirs."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def _serve(app: App, tree_bind: bool):
    sock = http.bind("127.0.0.1", 28900) if tree_bind else _bind()
    server = http.make_server(app, lambda: None, grace=1.0)
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for _ in range(200):
        try:
            if httpx.get(base + "/health").status_code == 200:
                return server, base
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError("the server did not come up")


def _service_run(gen: Generator, runner: SleepRunner, tokens: int) -> tuple[float, list[float], float, float]:
    """(ttft, gaps between content deltas, model prefill, model mean step) of one in-process request."""
    opts = GenerationOptions(temperature=0, max_tokens=tokens, ignore_eos=True)
    runner.model_s.clear()
    t0 = time.perf_counter()
    stamps = []
    req = ChatRequest([{"role": "user", "content": "Hi"}], opts, chat=ChatOptions(thinking=False))  # as over HTTP
    for d in gen.stream(req):
        if d.kind == "content" and d.text:
            stamps.append(time.perf_counter())
    model = list(runner.model_s)
    return stamps[0] - t0, _gaps(stamps), model[0], statistics.fmean(model[1:])


# the client process: httpx only, one streaming request after another; prints [[ttft, [gaps...]], ...]
CLIENT = """
import json, sys, time, httpx
base, n, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "chat_template_kwargs": {"thinking": False}}
out, health = [], []
with httpx.Client(timeout=60) as client:
    for _ in range(20):  # the floor: one bare request and response, this client, this loopback
        t0 = time.perf_counter()
        client.get(base + "/health")
        health.append(time.perf_counter() - t0)
    for _ in range(n):
        stamps = []
        t0 = time.perf_counter()
        with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                    stamps.append(time.perf_counter())
        out.append([stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])]])
print(json.dumps({"runs": out, "health": sorted(health)[len(health) // 2]}))
"""


def _http_runs(base: str, runner: SleepRunner, n: int, tokens: int, warm: int = 3) -> list:
    runner.per_request.clear()
    cmd = [sys.executable, "-c", CLIENT, base, str(n + warm), str(tokens)]
    res = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout)
    got = res["runs"]
    model = runner.per_request[-len(got) :]
    return [(ttft, gaps, m[0], statistics.fmean(m[1:])) for (ttft, gaps), m in zip(got, model)][warm:], res["health"]


def _gaps(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _summary(runs) -> dict:
    ttft_over = [ttft - prefill for ttft, _, prefill, _ in runs]
    tok_over = [statistics.fmean(gaps) - step for _, gaps, _, step in runs]
    return {
        "ttft_overhead_ms": {"median": 1e3 * statistics.median(ttft_over), "p90": 1e3 * _p90(ttft_over)},
        "per_token_overhead_ms": {"median": 1e3 * statistics.median(tok_over), "p90": 1e3 * _p90(tok_over)},
    }


def _p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=40, help="timed requests per path (default: 40)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request (default: 64)")
    p.add_argument("--prefill-ms", type=float, default=20.0, help="the model's prefill time (default: 20)")
    p.add_argument("--step-ms", type=float, default=5.0, help="the model's decode step (default: 5)")
    p.add_argument("--tree-bind", action="store_true", help="listen on the tree's own http.bind socket")
    p.add_argument("--json", default=None, help="also write the results here (default: stdout only)")
    args = p.parse_args(argv)

    tok = Tokenizer.bundled("v41")
    token = tok.encode(" hello")[0]
    runner = SleepRunner(tok.vocab_size, token, args.prefill_ms / 1e3, args.step_ms / 1e3)
    engine = Engine(runner, tok.eos_ids, max_queue=4).start()
    gen = Generator(engine, tok, 4096)
    app = App("bench-model")
    app.attach(gen)
    server, base = _serve(app, args.tree_bind)
    try:
        for _ in range(3):  # warm: first-call costs (imports, allocations) are not per-request overhead
            _service_run(gen, runner, args.tokens)
        service = [_service_run(gen, runner, args.tokens) for _ in range(args.requests)]
        over_http, health_s = _http_runs(base, runner, args.requests, args.tokens)
    finally:
        server.should_exit = True
        engine.close()
    out = {
        "model": {"prefill_ms": args.prefill_ms, "step_ms": args.step_ms, "tokens": args.tokens},
        "socket": "the tree's http.bind" if args.tree_bind else "the benchmark's (TCP_NODELAY)",
        "service": _summary(service),
        "http": _summary(over_http),
        "http_floor_ms": 1e3 * health_s,  # GET /health's round trip from the same client: no server work to speak of
        "load_average": os.getloadavg()[0],  # a shared machine: what else ran
    }
    s, h = out["service"], out["http"]
    out["server_only"] = {
        "ttft_ms": h["ttft_overhead_ms"]["median"] - s["ttft_overhead_ms"]["median"],
        "per_token_ms": h["per_token_overhead_ms"]["median"] - s["per_token_overhead_ms"]["median"],
    }
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
