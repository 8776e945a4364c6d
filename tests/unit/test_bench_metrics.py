"""vLLM's aggregates, console block and JSON keys, on hand-made request outputs; the PNG."""

import json

import numpy as np
import pytest

from dsflash.bench import metrics, report
from dsflash.bench.client import RequestOutput


def out(start, ttft, itl, tokens, prompt=10, ok=True):
    return RequestOutput(success=ok, start_time=start, ttft=ttft, itl=list(itl), latency=ttft + sum(itl),
                         output_tokens=tokens, prompt_len=prompt)  # fmt: skip


@pytest.fixture
def outputs():
    return [
        out(0.0, 0.5, [0.1, 0.1, 0.1], 4),
        out(0.2, 1.0, [0.2, 0.4], 3, prompt=20),
        out(0.3, 0.0, [], 0, ok=False),
        out(0.4, 0.3, [], 1),  # one token: no TPOT
    ]


def test_definitions(outputs):
    r = metrics.calculate(outputs, duration=2.0, percentiles=[50, 99])
    assert r["completed"] == 3 and r["failed"] == 1
    assert r["total_input_tokens"] == 40 and r["total_output_tokens"] == 8
    assert r["request_throughput"] == pytest.approx(1.5)
    assert r["output_throughput"] == pytest.approx(4.0)
    assert r["total_token_throughput"] == pytest.approx(24.0)
    assert r["mean_ttft_ms"] == pytest.approx(600.0)
    tpots = [300 / 3, 600 / 2]  # (latency - ttft) / (tokens - 1), single-token requests excluded
    assert r["mean_tpot_ms"] == pytest.approx(np.mean(tpots))
    assert r["per_stream_output_throughput"] == pytest.approx(np.mean([1000 / t for t in tpots]))  # tok/s a stream
    assert r["p99_tpot_ms"] == pytest.approx(np.percentile(tpots, 99))
    assert r["mean_itl_ms"] == pytest.approx(np.mean([100, 100, 100, 200, 400]))
    assert r["median_e2el_ms"] == pytest.approx(800.0)
    assert r["p50_ttft_ms"] == pytest.approx(500.0)
    assert r["output_lens"] == [4, 3, 0, 1]
    assert metrics.decode_tok_s(r) == pytest.approx(1000 / np.mean(tpots))


def test_token_count_fallback():
    o = out(0, 0.1, [0.1], 0)
    o.generated_text = "a b c"
    assert metrics.output_lengths([o], lambda s: len(s.split())) == [3]
    assert metrics.output_lengths([o], None) == [1]


def test_peaks():
    # 4 chunks of the first request in second 0, the second request's chunks at 1.2 and 1.4 and 1.8
    r = metrics.peaks([out(0.0, 0.5, [0.1, 0.1, 0.1], 4), out(1.0, 0.2, [0.2, 0.4], 3)])
    assert r == {"max_output_tokens_per_s": 4.0, "max_concurrent_requests": 1}  # [0, 0.8) and [1.0, 1.8)
    r = metrics.peaks([out(0.0, 0.5, [0.5], 2), out(0.9, 0.1, [0.1], 2)])
    assert r["max_concurrent_requests"] == 2


def test_empty_stats_are_zero():
    r = metrics.calculate([out(0, 0, [], 0, ok=False)], duration=1.0, percentiles=[99])
    assert r["completed"] == 0 and r["mean_ttft_ms"] == 0.0 and r["max_output_tokens_per_s"] == 0.0


def test_console_block_matches_vllm(outputs):
    r = metrics.calculate(outputs, duration=2.0, percentiles=[99])
    text = report.console(r, max_concurrency=1, request_rate=float("inf"), metrics=["ttft", "tpot"],
                          percentiles=[99])  # fmt: skip
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == "{:<40} {:<10}".format("Successful requests:", 3)
    assert "{:<40} {:<10}".format("Maximum request concurrency:", 1) in lines
    assert not any(line.startswith("Request rate configured") for line in lines)
    assert "{:<40} {:<10.2f}".format("Benchmark duration (s):", 2.0) in lines
    assert "{s:{c}^{n}}".format(s="Time per Output Token (excl. 1st token)", n=50, c="-") in lines
    assert "{:<40} {:<10.2f}".format("P99 TTFT (ms):", r["p99_ttft_ms"]) in lines
    assert not any("ITL" in line for line in lines)
    assert lines[-2] == "=" * 50 and lines[-1].startswith("Decode tok/s (1000 / mean TPOT):")


def test_json_keys(outputs, tmp_path):
    r = metrics.calculate(outputs, duration=2.0, percentiles=[99])
    setup = {
        "date": "x",
        "endpoint_type": "openai",
        "backend": "openai",
        "label": None,
        "model_id": "m",
        "tokenizer_id": "t",
        "num_prompts": 4,
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": 1,
    }
    data = report.result_json(setup, r, ["ttft", "tpot", "itl", "e2el"], [99], detailed=False)
    vllm_keys = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                 "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
                 "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
                 "output_throughput", "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
                 "rtfx", "latencies", "queue_times"}  # fmt: skip
    for m in ("ttft", "tpot", "itl", "e2el"):
        vllm_keys |= {f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms", f"p99_{m}_ms"}
    assert vllm_keys <= set(data)
    assert list(data)[:7] == ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts"]
    assert "ttfts" not in data and "itls" not in data
    detailed = report.result_json(setup, r, ["ttft"], [99], detailed=True)
    assert detailed["itls"][0] == [0.1, 0.1, 0.1] and "mean_e2el_ms" not in detailed
    path = tmp_path / "r.json"
    report.save(path, data)
    assert json.loads(path.read_text())["completed"] == 3


def test_default_filename():
    from datetime import datetime

    name = report.default_filename("openai", float("inf"), 1, "org/model", datetime(2026, 1, 2, 3, 4, 5))
    assert name == "openai-infqps-concurrency1-model-20260102-030405.json"


def test_plot_writes_png(outputs, tmp_path):
    r = metrics.calculate(outputs, duration=2.0, percentiles=[99])
    png = report.plot(tmp_path / "r.png", r, "title")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
