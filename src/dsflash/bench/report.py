"""The console block and the result JSON of `vllm bench serve`, and a PNG of per-token latency across the run."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from dsflash.bench.metrics import decode_tok_s, percentile_word

HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
DETAILED = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def console(result: dict, max_concurrency: int | None, request_rate: float, metrics: list[str],
            percentiles: list[float]) -> str:  # fmt: skip
    """vLLM's block, line for line ('{:<40} {:<10}'), then our decode tok/s line."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label, value, fmt="{:<10}"):
        lines.append(("{:<40} " + fmt).format(label, value))

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, "{:<10.2f}")
    row("Benchmark duration (s):", result["duration"], "{:<10.2f}")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", result["output_throughput"], "{:<10.2f}")
    row("Per-stream decode throughput (tok/s):", result["per_stream_output_throughput"], "{:<10.2f}")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], "{:<10.2f}")
    row("Peak concurrent requests:", result["max_concurrent_requests"], "{:<10.2f}")
    row("Total token throughput (tok/s):", result["total_token_throughput"], "{:<10.2f}")
    for m in metrics:
        short, header = HEADERS[m]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{m}_ms"], "{:<10.2f}")
        row(f"Median {short} (ms):", result[f"median_{m}_ms"], "{:<10.2f}")
        for p in percentiles:
            w = percentile_word(p)
            row(f"P{w} {short} (ms):", result[f"p{w}_{m}_ms"], "{:<10.2f}")
    lines.append("=" * 50)
    lines.append("{:<40} {:<10.2f}".format("Decode tok/s (1000 / mean TPOT):", decode_tok_s(result)))
    return "\n".join(lines)


def result_json(setup: dict, result: dict, metrics: list[str], percentiles: list[float], detailed: bool) -> dict:
    """setup keys first (date, endpoint_type, backend, label, model_id, tokenizer_id, num_prompts, metadata...,
    request_rate, burstiness, max_concurrency), then the benchmark's; stats only for the selected metrics."""
    out = {**setup}
    stat_keys = {f"{s}_{m}_ms" for m in HEADERS for s in ("mean", "median", "std")}
    stat_keys |= {f"p{percentile_word(p)}_{m}_ms" for m in HEADERS for p in percentiles}
    chosen = {f"{s}_{m}_ms" for m in metrics for s in ("mean", "median", "std")}
    chosen |= {f"p{percentile_word(p)}_{m}_ms" for m in metrics for p in percentiles}
    for k, v in result.items():
        if k in stat_keys and k not in chosen:
            continue
        if k in DETAILED and not detailed:
            continue
        out[k] = v
    out["decode_tok_s"] = decode_tok_s(result)
    return out


def default_filename(label: str, request_rate: float, max_concurrency: int | None, model_id: str, now: datetime):
    """vLLM's {label}-{rate}qps[-concurrency{N}]-{model}-{YYYYmmdd-HHMMSS}.json"""
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    return f"{label}-{request_rate}qps{conc}-{model_id.split('/')[-1]}-{now.strftime('%Y%m%d-%H%M%S')}.json"


def save(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def plot(path: Path, result: dict, title: str) -> Path:
    """Per-token latency across the run: each token's arrival time against its latency (TTFT for a request's first,
    ITL for the rest), one colour per request; a second panel shows the ITL distribution."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt
    import numpy as np

    by_turn = result.get("mean_ttft_ms_by_turn")
    panels = 3 if by_turn else 2
    fig, axes = plt.subplots(
        1, panels, figsize=(4 * panels + 4, 4.5), gridspec_kw={"width_ratios": [3] + [1] * (panels - 1)}
    )
    ax, hist = axes[0], axes[1]
    if by_turn:
        _plot_turns(axes[2], result)
    starts = result.get("start_times") or []
    t0 = min(starts) if starts else 0.0
    all_itl = []
    for i, (st, ttft, itl) in enumerate(zip(starts, result["ttfts"], result["itls"])):
        if not ttft:
            continue
        times = st - t0 + ttft + np.concatenate([[0.0], np.cumsum(itl)])
        colour = f"C{i % 10}"
        ax.scatter(times[:1], [ttft * 1000], marker="^", s=40, color=colour, zorder=3)
        ax.plot(times[1:], np.asarray(itl) * 1000, ".", ms=2.5, color=colour)
        all_itl += list(itl)
    ax.set_yscale("log")
    ax.set_xlabel("time since the first request (s)")
    ax.set_ylabel("latency of each token (ms): ▲ TTFT, · inter-token")
    mean_tpot = result.get("mean_tpot_ms") or 0.0
    if mean_tpot:
        ax.axhline(mean_tpot, color="k", lw=0.8, ls="--", label=f"mean TPOT {mean_tpot:.1f} ms")
        ax.legend(loc="upper right")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    itl_ms = np.asarray(all_itl) * 1000
    itl_ms = itl_ms[itl_ms > 0]
    if len(itl_ms):
        lo, hi = itl_ms.min(), itl_ms.max()
        bins = np.geomspace(lo, hi * 1.0001, 41) if hi > lo else 10
        hist.hist(itl_ms, bins=bins, orientation="horizontal", color="C0")
        hist.set_yscale("log")
        hist.set_ylim(ax.get_ylim())
    hist.set_xlabel("chunks")
    hist.set_title("ITL distribution (ms)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_turns(ax, result: dict) -> None:
    """Multi-turn runs: every request's TTFT by its turn index, and each turn's mean."""
    turns = result["turn_indices"]
    ax.scatter(turns, [t * 1000 for t in result["ttfts"][: len(turns)]], s=14, color="C1", label="a request")
    means = result["mean_ttft_ms_by_turn"]
    ax.plot(
        [i for i, m in enumerate(means) if m is not None],
        [m for m in means if m is not None],
        "k-o",
        ms=4,
        label="mean",
    )
    ax.set_xlabel("turn index")
    ax.set_ylabel("TTFT (ms)")
    ax.set_xticks(range(len(means)))
    ax.set_yscale("log")
    ax.set_title("TTFT by turn", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper right")
