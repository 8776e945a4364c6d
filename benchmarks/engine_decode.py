"""Engine decode and TTFT against the reference model on the same checkpoint, plus memcpy bandwidth.

(a) the tiny fixture, (b) a generated checkpoint with the real V4.1 widths, 4 layers and 32 experts per layer,
served with fewer slots than experts. Prints one table per model and the ratios the targets are about:
decode >= 3x the reference at TP 1, weight bytes read per decoded token at >= 50 % of memcpy bandwidth.

    .venv/bin/python benchmarks/engine_decode.py [--decode N] [--prefill T] [--slots S] [--only tiny|real]
        [--device cpu|cuda] [--no-bracket]

With --device cuda both sides run on the GPU: the reference as torch ops with every expert resident, the engine
with its Triton kernels; memcpy is then a copy within GPU memory, and the host-to-GPU copy rate (what a slot miss
streams at) is printed beside it. The engine runs twice there: with its decode step replayed as CUDA graphs (the
default) and eagerly (--enforce-eager's path); graph_speedup is the ratio of the two.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import CACHE, TINY, generated, memcpy_gbps, real_width_config  # noqa: E402
from dsflash.checkpoint.index import Checkpoint  # noqa: E402
from dsflash.runtime.cpu.dense import decode_bytes  # noqa: E402
from dsflash.runtime.reference.loader import load_reference  # noqa: E402
from dsflash.runtime.spec import EngineSpec  # noqa: E402
from dsflash.runtime.tp.launch import start_engine  # noqa: E402
from dsflash.runtime.tp.rank import to_device  # noqa: E402
from dsflash.service.files import open_dir  # noqa: E402
from dsflash.store.build import build_store  # noqa: E402


def time_forward(reset, step, prompt: list[int], steps: int) -> tuple[float, float]:
    """(TTFT seconds of a prompt prefill, seconds per decode step) with greedy feeding, after a short warm-up.
    step(tokens, start_pos) -> the last position's logits [V] (generation needs no other). Reading the argmax
    waits for a GPU, so the times are complete."""
    reset()
    step(prompt[:8], 0)  # first calls pay for allocator growth and kernel loading (and compiling, on a GPU)
    step([1], 8)
    reset()
    t = time.perf_counter()
    token, pos = int(step(prompt, 0).argmax()), len(prompt)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(steps):
        token, pos = int(step([token], pos).argmax()), pos + 1
    return ttft, (time.perf_counter() - t) / steps


def dense_bytes(model) -> int:
    """Bytes of the dense weights a decode step reads: every parameter but the embeddings (one row is gathered)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.endswith("embed.weight"))


def open_model(model_dir: Path, threads: int):
    """(checkpoint, Engram token map or None) in this process, with torch's thread count set"""
    torch.set_num_threads(threads)
    files = open_dir(model_dir, verify=False)
    return files.ckpt, files.token_map


def time_reference(model_dir: Path, threads: int, max_len: int, prompt: list[int], steps: int, device: str) -> dict:
    """Load the reference and time it: {ttft, step, bytes, memcpy} (the copy rate just before timing)."""
    ckpt, token_map = open_model(model_dir, threads)
    wide = ckpt.config.hidden_size >= 1024
    ref = load_reference(
        ckpt, token_map, qat=False, dspark=False, expert_dtype=torch.bfloat16 if wide else torch.float32
    )
    if device != "cpu":
        to_device(ref.model, torch.device(device))
        ref.experts.weights = {k: tuple(w.to(device) for w in ws) for k, ws in ref.experts.weights.items()}
    state = ref.model.new_state(max_len, device=device)

    def step(ids: list[int], pos: int) -> torch.Tensor:
        return ref.model(torch.tensor([ids], device=device), pos, state, ref.experts, last_only=True)[0, -1]

    gbps = memcpy_gbps(device=device)
    ttft, per_step = time_forward(state.reset, step, prompt, steps)
    return {"ttft": ttft, "step": per_step, "bytes": dense_bytes(ref.model), "memcpy": gbps}


def isolated(fn, *args):
    """fn(*args) in a fresh process: each side starts from a clean heap and gives all its memory back when done
    (at V4.1 widths the reference alone peaks at ~20 GB of this machine's 23; what an earlier side left in the
    allocator's heap is enough to get the next one killed)"""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def time_engine(model_dir: Path, max_len: int, spec: EngineSpec, prompt: list[int], steps: int, device: str) -> dict:
    """Start the engine (TP 1), time it, stop it: times, counters over the timed part, and the bytes a step reads."""
    ckpt, token_map = open_model(model_dir, spec.threads)
    runner = start_engine(ckpt, token_map, max_len, spec)
    try:
        runner.reset()
        runner.forward(prompt[:8], 0, False)  # warm-up, left out of the counters below
        before = runner.counters()
        gbps = memcpy_gbps(device=device)

        def step(ids: list[int], pos: int) -> torch.Tensor:
            return runner.forward(ids, pos, False)[-1]

        ttft, per_step = time_forward(runner.reset, step, prompt, steps)
        after = runner.counters()
        return {
            "ttft": ttft,
            "step": per_step,
            "memcpy": gbps,
            "counts": (after - before).to_json(),
            "shard": runner.rank0.experts.layout.nbytes,
            "dense": dense_bytes(runner.rank0.model) + decode_bytes(runner.rank0.model),
        }
    finally:
        runner.close()


def bench(
    name: str, model_dir: Path, prompt_len: int, steps: int, slots: int, threads: int, device: str, bracket: bool = True
) -> dict:
    ckpt = Checkpoint.open(model_dir)
    cfg = ckpt.config
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, min(cfg.vocab_size, 100000), prompt_len)]
    max_len = prompt_len + steps + 1

    # this VM's bandwidth drifts within a run, and the two sides cannot be resident together at V4.1 widths: the
    # reference is timed before and after the engine and its mean taken, each side in a process of its own, and
    # each side's copy rate is measured just before it is timed
    ref_args = (model_dir, threads, max_len, prompt, steps, device)
    before_ref = isolated(time_reference, *ref_args)
    cache = str(CACHE / "stores")
    t = time.perf_counter()
    build_store(ckpt, cache, tp=1, fmt="bfp4_b", progress=False, rebuild=True)
    store_s = time.perf_counter() - t
    ckpt.close()
    spec = EngineSpec(
        expert_slots=slots, expert_format="bfp4_b", qat=False, cache_dir=cache, threads=threads, device=device
    )
    eng = isolated(time_engine, model_dir, max_len, spec, prompt, steps, device)
    eager = None
    if device != "cpu":  # the captured step against the same engine launching every kernel itself
        eager = isolated(time_engine, model_dir, max_len, dataclasses.replace(spec, cuda_graph=False), prompt, steps,
                         device)  # fmt: skip
    after_ref = isolated(time_reference, *ref_args) if bracket else before_ref
    ref_step = (before_ref["step"] + after_ref["step"]) / 2
    ref_ttft = (before_ref["ttft"] + after_ref["ttft"]) / 2
    ref_bytes = before_ref["bytes"]

    n = eng["counts"]
    lookups, copied, misses = n["hits"] + n["misses"], n["bytes_streamed"], n["misses"]
    eng_step, eng_ttft, gbps = eng["step"], eng["ttft"], eng["memcpy"]
    routed = sum(s.n_active for s in cfg.layers() if not s.is_dspark)
    # per decoded token: every dense byte, the routed experts' slot bytes, and the bytes copied into slots
    per_token = eng["dense"] + routed * eng["shard"] + copied / max(1, steps + 1)
    return {
        "model": name,
        "device": torch.cuda.get_device_name() if device != "cpu" else "cpu",
        "threads": threads,
        "slots": slots,
        "experts": sum(s.n_experts for s in cfg.layers() if not s.is_dspark),
        "ref_ttft_s": ref_ttft,
        "ref_tok_s": 1 / ref_step,
        "engine_ttft_s": eng_ttft,
        "engine_tok_s": 1 / eng_step,
        "decode_speedup": ref_step / eng_step,
        "ttft_speedup": ref_ttft / eng_ttft,
        "hit_rate": (lookups - misses) / lookups if lookups else 0.0,
        "streamed_mb_per_token": copied / max(1, steps + 1) / 1e6,
        "weight_mb_per_token": per_token / 1e6,
        "ref_weight_mb_per_token": ref_bytes / 1e6,
        "weight_gb_s": per_token / eng_step / 1e9,
        "ref_tok_s_before_after": [1 / before_ref["step"], 1 / after_ref["step"]],
        "ref_memcpy_gb_s": [before_ref["memcpy"], after_ref["memcpy"]],
        "memcpy_gb_s": gbps,
        "weight_bw_vs_memcpy": per_token / eng_step / 1e9 / gbps,
        "store_build_s": store_s,
        **({"host_to_gpu_gb_s": memcpy_gbps(device=device, pinned_src=True)} if device != "cpu" else {}),
        **({"engine_eager_tok_s": 1 / eager["step"], "graph_speedup": eager["step"] / eng_step} if eager else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--slots", type=int, default=96, help="slots for the real-width model (it has 128 experts)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--only", choices=["tiny", "real"])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--no-bracket", action="store_true", help="time the reference once, before the engine (faster)")
    args = ap.parse_args()
    rows = []
    if args.only != "real":
        rows.append(
            bench(
                "tiny_a fixture",
                TINY,
                args.prefill,
                max(args.decode, 64),
                12,
                args.threads,
                args.device,
                not args.no_bracket,
            )
        )
    if args.only != "tiny":
        real = generated("real4x32", real_width_config(4, 32))
        rows.append(
            bench(
                "V4.1 widths, 4 layers x 32 experts",
                real,
                args.prefill,
                args.decode,
                args.slots,
                args.threads,
                args.device,
                not args.no_bracket,
            )
        )
    for r in rows:
        print(json.dumps({k: _rounded(v) for k, v in r.items()}))


def _rounded(v):
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return round(v, 4) if isinstance(v, float) else v


if __name__ == "__main__":
    main()
