"""The CPU reference model: prefill (T = 128) and per-token decode time, the baseline the engine is measured
against. (a) the tiny fixture, (b) a generated checkpoint with the real V4.1 widths, 2 layers and 8 experts.

Ratios against baselines run in the same process: decode reads every weight once per token, so its bytes per
second are set against a memcpy; prefill's FLOP rate against a plain fp32 matrix product of the same width.

    .venv/bin/python benchmarks/reference_forward.py [--prefill 128] [--decode 8] [--only tiny|real]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import TINY, generated, memcpy_gbps, real_width_config  # noqa: E402
from dsflash.checkpoint.index import Checkpoint  # noqa: E402
from dsflash.gates.reference import reference_forward  # noqa: E402
from dsflash.runtime.reference.loader import load_reference  # noqa: E402
from dsflash.text.token_map import compressed_token_map  # noqa: E402
from dsflash.text.tokenizer import Tokenizer  # noqa: E402


def gemm_gflops(m: int, k: int, n: int) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    t = time.perf_counter()
    a @ b
    return 2 * m * k * n / (time.perf_counter() - t) / 1e9


def bench(name: str, model_dir: Path, prompt_len: int, steps: int) -> dict:
    ckpt = Checkpoint.open(model_dir)
    cfg = ckpt.config
    tok = Tokenizer.from_dir(model_dir, cfg.model_type)
    token_map = compressed_token_map(tok.backend) if cfg.engram_layer_ids else None
    ref = load_reference(ckpt, token_map, dspark=False)
    forward = reference_forward(ref, prompt_len + steps + 1)
    prompt = torch.tensor([list(np.random.default_rng(0).integers(3, min(cfg.vocab_size, 100000), prompt_len))])
    forward(prompt, 0, True)  # warm-up (allocator, kernels)
    t = time.perf_counter()
    logits = forward(prompt, 0, True)[0]
    prefill_s = time.perf_counter() - t
    token, pos = int(logits[-1].argmax()), prompt_len
    t = time.perf_counter()
    for _ in range(steps):
        token = int(forward(torch.tensor([[token]]), pos, False)[0, -1].argmax())
        pos += 1
    step_s = (time.perf_counter() - t) / steps
    # what one token touches: every dense matrix but the embedding (one row is gathered), and the routed share
    dense = [p for n, p in ref.model.named_parameters() if not n.endswith("embed.weight")]
    routed = cfg.num_experts_per_tok / cfg.n_routed_experts
    expert_w = [w for ws in ref.experts.weights.values() for w in ws]
    weights = sum(p.numel() * p.element_size() for p in dense) + routed * sum(w.numel() * 4 for w in expert_w)
    params = sum(p.numel() for p in dense) + routed * sum(w.numel() for w in expert_w)
    return {
        "model": name,
        "threads": torch.get_num_threads(),
        "prefill_tokens": prompt_len,
        "prefill_s": prefill_s,
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_ms_per_token": step_s * 1e3,
        "decode_tok_s": 1 / step_s,
        "decode_weight_gb_s": weights / step_s / 1e9,
        "memcpy_gb_s": memcpy_gbps(),
        "prefill_gflops": 2 * params * prompt_len / prefill_s / 1e9,
        "gemm_gflops": gemm_gflops(prompt_len, cfg.hidden_size, 4 * cfg.hidden_size),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--only", choices=["tiny", "real"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    if args.only != "real":
        rows.append(bench("tiny_a fixture", TINY, args.prefill, max(args.decode, 32)))
    if args.only != "tiny":
        real = generated("real2x8", real_width_config(2, 8))
        rows.append(bench("V4.1 widths, 2 layers x 8 experts", real, args.prefill, args.decode))
    for r in rows:
        r["decode_bw_vs_memcpy"] = r["decode_weight_gb_s"] / r["memcpy_gb_s"]
        r["prefill_vs_gemm"] = r["prefill_gflops"] / r["gemm_gflops"]
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))


if __name__ == "__main__":
    main()
