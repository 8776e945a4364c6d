"""Batched decode at V4.1 widths: aggregate and per-stream decode tokens/s at 1/2/4/8 streams in one run, the
weight bytes a decoded token reads, and the inter-token gaps of a running stream while a long prompt is admitted.

The checkpoint is engine_decode.py's generated one (the released V4.1 widths, 4 layers x 32 experts, cached under
/tmp/dsflash-bench). Every stream count runs on the same engine (one runner with --max-num-seqs 8): B prompts are
prefilled into B sequence slots, then B-token decode steps are timed (B = 1: the one-sequence step). Bytes per
token: the dense weights a step reads plus the routed experts it made resident (each once for all its tokens),
divided by B.

The latency part runs the BatchEngine: one stream decodes while a --long-prompt token prompt is admitted in passes
of at most --max-num-batched-tokens (minus the decoding streams) between decode steps, sized by --factor
(--prefill-step-factor; 0: the token budget alone); the stream's gaps between consecutive tokens over that window
are reported against its median gap before the prompt arrived (the baseline, in the same run).

    .venv/bin/python benchmarks/batched_decode.py [--steps N] [--slots S] [--long-prompt T] [--budget B]
        [--factor F] [--skip-latency | --skip-throughput] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import CACHE, generated, real_width_config  # noqa: E402
from dsflash.runtime.cpu.dense import decode_bytes  # noqa: E402
from dsflash.runtime.scheduler.batch import BatchEngine  # noqa: E402
from dsflash.runtime.scheduler.queue import GenerationRequest  # noqa: E402
from dsflash.runtime.scheduler.sampler import SamplingParams  # noqa: E402
from dsflash.runtime.spec import EngineSpec  # noqa: E402
from dsflash.runtime.tp.launch import start_engine  # noqa: E402
from engine_decode import dense_bytes, open_model  # noqa: E402

STREAMS = (1, 2, 4, 8)


def decode_rate(runner, prompts: list[list[int]], steps: int) -> dict:
    """B = len(prompts) streams: prefill each into its slot, then `steps` batched decode steps (greedy)."""
    tokens, positions, seqs = [], [], []
    for slot, p in enumerate(prompts):
        runner.select(slot)
        runner.reset()
        tokens.append(int(runner.forward(p, 0, False)[-1].argmax()))
        positions.append(len(p))
        seqs.append(slot)

    def step():
        if len(seqs) == 1:
            runner.select(seqs[0])
            return runner.forward(tokens, positions[0], False)[-1:]
        return runner.decode(tokens, positions, seqs)

    step()  # warm-up: the first batched call of a shape
    positions[:] = [p + 1 for p in positions]
    before = runner.counters()
    t = time.perf_counter()
    for _ in range(steps):
        logits = step()
        tokens[:] = [int(x) for x in logits.argmax(dim=-1)]
        positions[:] = [p + 1 for p in positions]
    dt = time.perf_counter() - t
    n = (runner.counters() - before).to_json()
    return {"seconds": dt, "lookups_per_step": (n["hits"] + n["misses"]) / steps, "misses": n["misses"]}


def admission_gaps(runner, chunk: int, budget: int, factor: float, prompt: list[int], long_prompt: list[int]) -> dict:
    """One stream decoding while long_prompt is admitted: its inter-token gaps over the admission window."""
    engine = BatchEngine(runner, set(), prefill_chunk=chunk, max_num_batched_tokens=budget,
                         prefill_step_factor=factor or None).start()  # fmt: skip
    try:
        # as many tokens as its slot holds: the stream outlasts the admission, then it is cancelled
        most = runner.max_len - len(prompt)
        stream = engine.submit(GenerationRequest(tuple(prompt), SamplingParams(temperature=0, max_tokens=most,
                                                                               ignore_eos=True)))  # fmt: skip
        times: list[float] = []
        window: dict[str, float] = {}

        def consume():
            for e in stream:
                if e.token is not None:
                    times.append(time.perf_counter())

        reader = threading.Thread(target=consume)
        reader.start()
        while len(times) < 8:  # the stream is running at its own pace first
            time.sleep(0.01)
        window["start"] = time.perf_counter()
        admitted = engine.submit(GenerationRequest(tuple(long_prompt), SamplingParams(temperature=0, max_tokens=1)))
        first = next(iter(admitted))
        window["end"] = time.perf_counter()
        ttft = first.stats.ttft_s
        list(admitted)
        time.sleep(0.5)
        stream.cancel()
        reader.join()
    finally:
        engine.close()
    steady = np.diff([t for t in times if t < window["start"]])
    inside = np.diff([t for t in times if window["start"] <= t <= window["end"] + 1e-3])
    med = float(statistics.median(steady)) if len(steady) else float("nan")
    worst = float(inside.max()) if len(inside) else float("nan")
    return {
        "long_prompt_tokens": len(long_prompt),
        "max_num_batched_tokens": budget,
        "prefill_step_factor": factor,
        "long_prompt_ttft_s": ttft,
        "gap_median_alone_s": med,
        "gap_median_admitting_s": float(np.median(inside)) if len(inside) else float("nan"),
        "gap_worst_admitting_s": worst,
        "worst_vs_median": worst / med,
        "tokens_while_admitting": int(len(inside)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per stream count")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens of each stream")
    ap.add_argument("--slots", type=int, default=128, help="expert slots (the model has 128 routed experts)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--long-prompt", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=40, help="--max-num-batched-tokens of the latency part")
    ap.add_argument("--factor", type=float, default=EngineSpec.prefill_step_factor,
                    help="--prefill-step-factor of the latency part (0: the token budget alone)")  # fmt: skip
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true", help="only the latency part")
    args = ap.parse_args()
    model_dir = generated("real4x32", real_width_config(4, 32))
    max_len = args.long_prompt + 2 * args.prompt + args.steps + 64
    spec = EngineSpec(expert_slots=args.slots, expert_format="bfp4_b", cache_dir=str(CACHE / "stores"),
                      threads=args.threads, max_num_seqs=max(STREAMS), prefix_cache=False)  # fmt: skip
    ckpt, token_map = open_model(model_dir, args.threads)
    cfg = ckpt.config
    rng = np.random.default_rng(0)

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, min(cfg.vocab_size, 100000), n)]

    runner = start_engine(ckpt, token_map, max_len, spec)
    try:
        # every expert in its slot and its pages touched before anything is timed: otherwise the first rows (one
        # stream) pay the slots' first reads and the batched rows, which come later, look better than they are
        decode_rate(runner, [prompt(args.prompt) for _ in range(max(STREAMS))], 4)
        rank = runner.rank0
        dense = dense_bytes(rank.model) + decode_bytes(rank.model)
        shard = rank.experts.layout.nbytes
        rows, one = {}, None
        for b in () if args.skip_throughput else STREAMS:
            r = decode_rate(runner, [prompt(args.prompt) for _ in range(b)], args.steps)
            agg = b * args.steps / r["seconds"]
            rows[b] = {
                "streams": b,
                "aggregate_tok_s": agg,
                "per_stream_tok_s": agg / b,
                "experts_per_step": r["lookups_per_step"],
                "weight_mb_per_token": (dense + r["lookups_per_step"] * shard) / b / 1e6,
                "misses": r["misses"],
            }
            row = rows[b]
            one = one or row["aggregate_tok_s"]
            row["aggregate_vs_one"] = row["aggregate_tok_s"] / one
            row["per_stream_vs_alone"] = row["per_stream_tok_s"] / one
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if not args.skip_latency:
            gaps = admission_gaps(
                runner, spec.prefill_chunk, args.budget, args.factor, prompt(args.prompt), prompt(args.long_prompt)
            )
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in gaps.items()}), flush=True)
    finally:
        runner.close()


if __name__ == "__main__":
    main()
