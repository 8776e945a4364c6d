"""/metrics through prometheus_client: requests by outcome, latency histograms, tokens, expert counters, the live
gauges (queue, running, ready), the prefix cache's counters and the process's own metrics.

One registry per App (not the global one): two Apps in one process (tests) never share or double-register series.
"""

from __future__ import annotations

from collections.abc import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from dsflash.counters import PROMETHEUS
from dsflash.service.api import PREFIX_METRICS, STEP_HISTOGRAMS, RequestStats

OUTCOMES = ("ok", "cancelled", "rejected", "invalid", "error")
ENDPOINTS = ("chat", "completion")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # sequences or tokens per step
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
P = "dsflash:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # generate_latest's format

# a <name>_created sample per series doubles the page and no dashboard of ours reads it (vLLM turns it off too)
prometheus_client.disable_created_metrics()


class _Live:
    """Values read when scraped (the engine's gauges, the prefix cache's stats), not kept here."""

    def __init__(self, model: str, gauges: Callable[[], dict[str, float]], prefix: Callable[[], dict[str, float]],
                 steps: Callable[[], dict[str, dict[int, int]]] = dict):  # fmt: skip
        self.model, self.gauges, self.prefix, self.steps = model, gauges, prefix, steps

    def collect(self):
        for name, value in sorted(self.gauges().items()):
            g = GaugeMetricFamily(P + name, name.replace("_", " ") + ".", labels=["model_name"])
            g.add_metric([self.model], value)
            yield g
        stats = self.prefix()
        for name, (kind, text) in PREFIX_METRICS.items():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            # CounterMetricFamily appends _total itself
            m = family(P + (name.removesuffix("_total") if kind == "counter" else name), text, labels=["model_name"])
            m.add_metric([self.model], stats.get(name, 0))
            yield m
        steps = self.steps()
        for name, text in STEP_HISTOGRAMS.items():
            h = HistogramMetricFamily(P + name, text, labels=["model_name"])
            counts = steps.get(name, {})
            cumulative = [(str(b), sum(n for v, n in counts.items() if v <= b)) for b in STEP_BUCKETS]
            cumulative.append(("+Inf", sum(counts.values())))
            h.add_metric([self.model], cumulative, sum(v * n for v, n in counts.items()))
            yield h


class Metrics:
    """Updated from HTTP worker threads and the event loop (prometheus_client locks its own values)."""

    def __init__(
        self,
        model: str,
        gauges: Callable[[], dict[str, float]] = dict,
        prefix: Callable[[], dict[str, float]] = dict,
        steps: Callable[[], dict[str, dict[int, int]]] = dict,
    ):
        self.model = model
        self.registry = r = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)
        label = ["model_name"]
        self.requests = Counter(
            P + "requests",
            "Generation requests by endpoint and outcome.",
            ["model_name", "endpoint", "outcome"],
            registry=r,
        )
        for e in ENDPOINTS:  # every series exists from the start, so rate() sees the first request
            for o in OUTCOMES:
                self.requests.labels(model, e, o)
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Prompt tokens of requests that produced output.", label, registry=r
        ).labels(model)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens.", label, registry=r).labels(model)
        self.experts = {
            key: Counter(P + name.removesuffix("_total"), text, label, registry=r).labels(model)
            for key, (name, text) in PROMETHEUS.items()
        }

        def histogram(name: str, text: str, buckets: tuple[float, ...]):
            return Histogram(P + name, text, label, buckets=buckets, registry=r).labels(model)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Receipt to first token (queue wait + prefill).", TTFT_BUCKETS
        )
        self.tpot = histogram(
            "time_per_output_token_seconds", "Mean decode time per token after the first, per request.", TPOT_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Receipt to last byte of completed requests.", E2E_BUCKETS)
        self.decode_speed = Gauge(
            P + "decode_tokens_per_second",
            "Decode speed of the last request that produced 2+ tokens.",
            label,
            registry=r,
        ).labels(model)
        r.register(_Live(model, gauges, prefix, steps))

    def record(self, endpoint: str, outcome: str, stats: RequestStats | None, e2e_s: float | None) -> None:
        self.requests.labels(self.model, endpoint, outcome).inc()
        if e2e_s is not None and outcome == "ok":
            self.e2e.observe(e2e_s)
        if stats is None:
            return
        if stats.completion_tokens:
            self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.completion_tokens)
        if stats.ttft_s is not None:
            self.ttft.observe(stats.ttft_s)
        if stats.tokens_per_s:
            self.tpot.observe(1.0 / stats.tokens_per_s)
            self.decode_speed.set(stats.tokens_per_s)
        if stats.experts is not None:
            for key, counter in self.experts.items():
                counter.inc(getattr(stats.experts, key))

    def render(self) -> bytes:
        return generate_latest(self.registry)
