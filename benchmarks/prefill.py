"""Prefill (time to first token) at V4.1 widths: the engine's TTFT and prompt tokens/s for long prompts, where the
time goes, against this machine's torch matmul rate on the model's own shapes and the reference's TTFT.

On the decode benchmark's checkpoint (4 layers x 32 experts at the real V4.1 widths, bfp4_b experts in `--slots`
slots), for each prompt length: the engine's TTFT (chunks of `--chunk` tokens, the engine's own prefill loop), its
split into routed experts, attention (the sparse attention over window and selected compressed rows), compressor,
indexer (scores, top-k, candidate blocks, keys) and dense (the rest: every projection, mHC, norms, Engram, head),
and the model's multiply-adds per prompt token (every weight a token multiplies: the dense matrices, its routed
experts, the head once per prompt) as a rate against the roof: the faster of torch's fp32 and bf16 matmuls on the
model's own [chunk, in] x [in, out] shapes, weighted by their share of the multiply-adds (attention's own products
are not counted: the rate is a floor). The reference (fp32 dense, bf16 experts, every expert resident) runs where
`--reference-max` allows.

    .venv/bin/python benchmarks/prefill.py [--tokens 128 2048 8192] [--chunk 512] [--slots 96] [--reference-max 128]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import CACHE, generated, real_width_config  # noqa: E402
from cpu_kernels import cpu_class  # noqa: E402
from dsflash.checkpoint.index import Checkpoint  # noqa: E402
from dsflash.runtime.spec import EngineSpec  # noqa: E402
from dsflash.store.build import build_store  # noqa: E402

PARTS = ("experts", "attention", "compressor", "indexer")  # "dense" is the rest


def macs(ckpt: Checkpoint) -> tuple[int, int, dict[tuple[int, int], int]]:
    """(multiply-adds per prompt token, the head's per prompt, multiply-adds per [in, out] weight shape)."""
    cfg, per_shape = ckpt.config, defaultdict(int)
    for name, spec in ckpt.specs.items():
        if not name.startswith("layers.") or ".experts." in name or len(spec.shape) != 2:
            continue
        if name.endswith(".weight") or name.endswith("_fn"):
            o, i = spec.shape
            per_shape[(i, o)] += o * i
    routed = sum(s.n_active for s in cfg.layers() if not s.is_dspark)
    inter, d = cfg.moe_intermediate_size, cfg.hidden_size
    per_shape[(d, inter)] += 2 * routed * inter * d
    per_shape[(inter, d)] += routed * inter * d
    return sum(per_shape.values()), cfg.vocab_size * d, dict(per_shape)


def roof(per_shape: dict[tuple[int, int], int], rows: int, repeat: int = 3) -> dict[str, float]:
    """torch's fp32 and bf16 matmul rates (multiply-adds / s) over the model's shapes at `rows` rows, each shape
    weighted by its share of the model's multiply-adds (the harmonic mean: time adds up, not rates)."""
    out = {}
    total = sum(per_shape.values())
    for dtype in (torch.float32, torch.bfloat16):
        seconds = 0.0
        for (i, o), n in per_shape.items():
            x, w = torch.randn(rows, i).to(dtype), torch.randn(o, i).to(dtype)
            x @ w.T
            best = float("inf")
            for _ in range(repeat):
                t = time.perf_counter()
                x @ w.T
                best = min(best, time.perf_counter() - t)
            seconds += n / total * best / (rows * i * o)  # seconds per multiply-add of this shape, weighted
        out[str(dtype).removeprefix("torch.")] = 1 / seconds
    return out


class Timers:
    """Wall time inside chosen methods (patched on their classes), nested calls counted once per part."""

    def __init__(self):
        self.s, self._depth = defaultdict(float), defaultdict(int)

    def wrap(self, owner, name: str, part: str) -> None:
        """owner.name (a class's method or a module's function) timed as `part`"""
        inner = getattr(owner, name)

        def timed(*a, **k):
            if self._depth[part]:
                return inner(*a, **k)
            self._depth[part] += 1
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.s[part] += time.perf_counter() - t
                self._depth[part] -= 1

        setattr(owner, name, timed)


def engine_ttft(model_dir: str, spec: EngineSpec, lengths: list[int], chunk: int) -> list[dict]:
    from dsflash.model import attention
    from dsflash.model.compressor import Compressor, Indexer
    from dsflash.runtime.experts.cached import CachedExperts
    from dsflash.runtime.tp.launch import start_engine
    from dsflash.service.files import open_dir

    torch.set_num_threads(spec.threads)
    files = open_dir(Path(model_dir), verify=False)
    timers = Timers()
    timers.wrap(CachedExperts, "__call__", "experts")
    timers.wrap(attention, "sparse_attention", "attention")
    timers.wrap(Compressor, "forward", "compressor")
    for m in ("write_keys", "scores", "select", "select_static", "candidates"):
        timers.wrap(Indexer, m, "indexer")
    runner = start_engine(files.ckpt, files.token_map, max(lengths) + 1, spec)
    rng = np.random.default_rng(0)
    rows = []
    try:
        runner.reset()
        runner.forward([5] * 8, 0, False)  # warm-up: allocator growth, kernel loading
        for n in lengths:
            prompt = [int(t) for t in rng.integers(3, 100000, n)]
            runner.reset()
            timers.s.clear()
            before = runner.counters()
            t = time.perf_counter()
            for start in range(0, n, chunk):
                runner.forward(prompt[start : start + chunk], start, False)
            ttft = time.perf_counter() - t
            parts = {p: timers.s.get(p, 0.0) for p in PARTS}
            parts["dense"] = ttft - sum(parts.values())
            streamed = (runner.counters() - before).bytes_streamed
            rows.append({"tokens": n, "ttft_s": ttft, "parts_s": parts, "streamed_gb": streamed / 1e9,
                         "peak_rss_gb": _peak_rss_gb()})  # fmt: skip
    finally:
        runner.close()
    return rows


def reference_ttft(model_dir: str, threads: int, n: int) -> float:
    from dsflash.runtime.reference.loader import load_reference
    from dsflash.service.files import open_dir

    torch.set_num_threads(threads)
    files = open_dir(Path(model_dir), verify=False)
    ref = load_reference(files.ckpt, files.token_map, qat=False, dspark=False, expert_dtype=torch.bfloat16)
    state = ref.model.new_state(n + 1)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 100000, n)]
    ref.model(torch.tensor([prompt[:8]]), 0, state, ref.experts, last_only=True)
    state.reset()
    t = time.perf_counter()
    ref.model(torch.tensor([prompt]), 0, state, ref.experts, last_only=True)
    return time.perf_counter() - t


def _peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def isolated(fn, *args):
    """fn(*args) in a fresh process (the reference and the engine do not fit in memory together at these widths)"""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 2048, 8192])
    ap.add_argument("--chunk", type=int, default=EngineSpec().prefill_chunk)
    ap.add_argument("--slots", type=int, default=96, help="expert slots (the model has 128 experts)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reference-max", type=int, default=128, help="longest prompt the reference runs (memory)")
    a = ap.parse_args()
    model = generated("real4x32", real_width_config(4, 32))
    ckpt = Checkpoint.open(model)
    per_token, head, per_shape = macs(ckpt)
    cache = str(CACHE / "stores")
    build_store(ckpt, cache, tp=1, fmt="bfp4_b", progress=False)
    ckpt.close()
    torch.set_num_threads(a.threads)
    print(cpu_class())
    rates = roof(per_shape, min(a.chunk, 512))
    best = max(rates.values())
    print(f"{per_token / 1e9:.2f} G multiply-adds per prompt token (+{head / 1e9:.2f} G for the head per prompt); "
          f"torch matmul on the model's shapes: fp32 {rates['float32'] / 1e9:.0f}, bf16 {rates['bfloat16'] / 1e9:.0f} "
          "G multiply-adds/s")  # fmt: skip
    spec = EngineSpec(expert_slots=a.slots, expert_format="bfp4_b", qat=False, cache_dir=cache, threads=a.threads,
                      prefill_chunk=a.chunk)  # fmt: skip
    rows = isolated(engine_ttft, str(model), spec, a.tokens, a.chunk)
    for r in rows:
        n = r["tokens"]
        rate = (n * per_token + head) / r["ttft_s"]
        r |= {"prompt_tok_s": n / r["ttft_s"], "macs_per_s": rate, "of_roof": rate / best}
        if n <= a.reference_max:
            r["reference_ttft_s"] = isolated(reference_ttft, str(model), a.threads, n)
            r["engine_vs_reference"] = r["ttft_s"] / r["reference_ttft_s"]
        print(json.dumps({k: _rounded(v) for k, v in r.items()}))


def _rounded(v):
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    return round(v, 4) if isinstance(v, float) else v


if __name__ == "__main__":
    main()
