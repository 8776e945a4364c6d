"""`vllm bench serve`'s aggregates over the request outputs (its calculate_metrics), in milliseconds."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dsflash.bench.client import RequestOutput

METRICS = ("ttft", "tpot", "itl", "e2el")


def output_lengths(outputs: list[RequestOutput], count: Callable[[str], int] | None) -> list[int]:
    """Tokens per request: usage.completion_tokens, else the tokenizer's count of the text (else 1); 0 if failed."""
    lens = []
    for o in outputs:
        if not o.success:
            lens.append(0)
        elif o.output_tokens:
            lens.append(o.output_tokens)
        else:
            lens.append(count(o.generated_text) if count else 1)
    return lens


def by_turn(outputs: list[RequestOutput], turn_of: list[int]) -> dict:
    """Multi-turn runs: each request's turn index and the mean TTFT of every turn index (ms; None where no
    request of that turn succeeded)."""
    turns = max(turn_of) + 1 if turn_of else 0
    means = []
    for t in range(turns):
        ttfts = [o.ttft for o, k in zip(outputs, turn_of) if k == t and o.success]
        means.append(sum(ttfts) / len(ttfts) * 1000 if ttfts else None)
    return {"turn_indices": list(turn_of), "mean_ttft_ms_by_turn": means}


def calculate(outputs: list[RequestOutput], duration: float, percentiles: list[float], count=None) -> dict:
    """The result dict with vLLM's key names; per-metric stats for every metric in METRICS."""
    lens = output_lengths(outputs, count)
    ok = [(o, n) for o, n in zip(outputs, lens) if o.success]
    ttfts = [o.ttft for o, _ in ok]
    e2els = [o.latency for o, _ in ok]
    itls = [x for o, _ in ok for x in o.itl]
    tpots = [(o.latency - o.ttft) / (n - 1) for o, n in ok if n > 1]
    total_input = sum(o.prompt_len for o, _ in ok)
    total_output = sum(lens)
    completed = len(ok)
    result = {
        "duration": duration,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "request_goodput": None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        # what one stream sees beside the others (decode tokens after the first per second, mean over requests);
        # output_throughput is the aggregate of all streams
        "per_stream_output_throughput": float(np.mean([1 / t for t in tpots if t > 0])) if tpots else 0.0,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "queue_times": [o.client_queue_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        **peaks([o for o, _ in ok]),
        "rtfx": 0.0,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(stats(name, values, percentiles))
    return result


def stats(name: str, values: list[float], percentiles: list[float]) -> dict:
    """mean/median/std and percentiles in ms under vLLM's keys (an empty list gives zeros, as vLLM's `or 0`)."""
    v = np.asarray(values or [0.0], dtype=np.float64) * 1000
    out = {f"mean_{name}_ms": float(np.mean(v)), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(np.std(v))}  # fmt: skip
    for p in percentiles:
        out[f"p{percentile_word(p)}_{name}_ms"] = float(np.percentile(v, p))
    return out


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def peaks(ok: list[RequestOutput]) -> dict:
    """max_output_tokens_per_s over 1-second buckets of chunk arrival times, and the exact peak concurrency."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(o.start_time for o in ok)
    t1 = max(o.start_time + o.latency for o in ok)
    buckets = np.zeros(int(np.ceil(t1 - t0)) + 1)
    for o in ok:
        times = o.start_time + o.ttft + np.concatenate([[0.0], np.cumsum(o.itl)])
        idx = (times - t0).astype(int)
        idx = idx[(idx >= 0) & (idx < len(buckets))]
        np.add.at(buckets, idx, 1)
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return {"max_output_tokens_per_s": float(buckets.max()), "max_concurrent_requests": peak}


def decode_tok_s(result: dict) -> float:
    """Per-user decode rate, the reference box's 'decode tok/s': 1000 / mean TPOT (ms)."""
    tpot = result.get("mean_tpot_ms") or 0.0
    return 1000.0 / tpot if tpot > 0 else 0.0
