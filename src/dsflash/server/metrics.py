"""Prometheus text exposition of the server's counters: requests by outcome, queue, latency, tokens, experts."""

from __future__ import annotations

import threading
from collections.abc import Callable

from dsflash.counters import PROMETHEUS
from dsflash.service.api import RequestStats

OUTCOMES = ("ok", "cancelled", "rejected", "invalid", "error")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
P = "dsflash:"


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.n = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.n += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f'{name}_bucket{{{labels}le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels}le="+Inf"}} {self.n}')
        return out + [
            f"{name}_sum{{{labels.rstrip(',')}}} {self.sum:.6f}",
            f"{name}_count{{{labels.rstrip(',')}}} {self.n}",
        ]


class Metrics:
    """Updated from HTTP worker threads and the event loop; rendered on GET /metrics."""

    def __init__(self, model: str, gauges: Callable[[], dict[str, float]] = dict):
        self.model, self.gauges = model, gauges
        self._lock = threading.Lock()
        self.requests = {(e, o): 0 for e in ("chat", "completion") for o in OUTCOMES}
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.tpot = _Histogram(TPOT_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0, "hits": 0, "misses": 0, "bytes_streamed": 0}
        self.last_tokens_per_s = 0.0

    def record(self, endpoint: str, outcome: str, stats: RequestStats | None, e2e_s: float | None) -> None:
        with self._lock:
            self.requests[(endpoint, outcome)] = self.requests.get((endpoint, outcome), 0) + 1
            if e2e_s is not None and outcome == "ok":
                self.e2e.observe(e2e_s)
            if stats is None:
                return
            self.totals["prompt_tokens"] += stats.prompt_tokens if stats.completion_tokens else 0
            self.totals["generation_tokens"] += stats.completion_tokens
            if stats.ttft_s is not None:
                self.ttft.observe(stats.ttft_s)
            if stats.tokens_per_s:
                self.tpot.observe(1.0 / stats.tokens_per_s)
                self.last_tokens_per_s = stats.tokens_per_s
            if stats.experts is not None:
                for key in PROMETHEUS:
                    self.totals[key] += getattr(stats.experts, key)

    def render(self) -> str:
        m = f'model_name="{_escape(self.model)}"'
        lines = []

        def head(name, kind, text):
            lines.extend([f"# HELP {P}{name} {text}", f"# TYPE {P}{name} {kind}"])

        with self._lock:
            head("requests_total", "counter", "Generation requests by endpoint and outcome.")
            for (endpoint, outcome), n in sorted(self.requests.items()):
                lines.append(f'{P}requests_total{{{m},endpoint="{endpoint}",outcome="{outcome}"}} {n}')
            for name, key, text in (
                ("prompt_tokens_total", "prompt_tokens", "Prompt tokens of requests that produced output."),
                ("generation_tokens_total", "generation_tokens", "Generated tokens."),
                *((name, key, text) for key, (name, text) in PROMETHEUS.items()),
            ):
                head(name, "counter", text)
                lines.append(f"{P}{name}{{{m}}} {self.totals[key]}")
            for name, hist, text in (
                ("time_to_first_token_seconds", self.ttft, "Receipt to first token (queue wait + prefill)."),
                (
                    "time_per_output_token_seconds",
                    self.tpot,
                    "Mean decode time per token after the first, per request.",
                ),
                ("e2e_request_latency_seconds", self.e2e, "Receipt to last byte of completed requests."),
            ):
                head(name, "histogram", text)
                lines.extend(f"{P}{line}" for line in hist.lines(name, m + ","))
            head("decode_tokens_per_second", "gauge", "Decode speed of the last request that produced 2+ tokens.")
            lines.append(f"{P}decode_tokens_per_second{{{m}}} {self.last_tokens_per_s:.3f}")
        for name, value in sorted(self.gauges().items()):
            head(name, "gauge", name.replace("_", " ") + ".")
            lines.append(f"{P}{name}{{{m}}} {value:g}")
        return "\n".join(lines) + "\n"


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
