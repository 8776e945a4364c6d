"""The decode products with a few rows (a batched decode step's tokens) at V4.1 widths: the GEMVs on packed weights
(bfp4_b expert [2304, 5120], FP8 dense [25600, 6144], scale blocks of 32) against the fused panel product
(native.packed_linear) in the same run, one thread, min CPU time of --reps; the ratio is against one row.

    .venv/bin/python benchmarks/decode_gemv.py [--rows 1 2 4 8 16 24] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from dsflash.formats import bfp
from dsflash.runtime.cpu import native


def cpu_ms(fn, x: torch.Tensor, reps: int) -> float:
    """Min CPU time of fn(x) over reps calls after one warm-up, in ms (nan where fn cannot run)."""
    if fn(x) is None:
        return float("nan")
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        fn(x)
        best = min(best, time.process_time() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    R, C = 2304, 5120
    tiles = bfp.pack((rng.standard_normal((R, C)) * 0.02).astype(np.float32), "bfp4_b")
    O, I, B = 25600, 6144, 32
    w = (torch.randn(O, I) * 0.02).to(torch.float8_e4m3fn).view(torch.uint8)
    s = torch.rand(O // B, I // B) * 256
    cases = {
        "bfp4_b": (C, lambda x: native.gemv(tiles, (R, C), "bfp4_b", x),
                   lambda x: native.packed_linear(x, tiles, "bfp4_b", (R, C))),
        "fp8": (I, lambda x: native.fp8_gemv(w, s, B, x), lambda x: native.packed_linear(x, w, "fp8", (O, I), s, B)),
    }  # fmt: skip
    for fmt, (cols, gemv, panels) in cases.items():
        one = None
        for n in args.rows:
            x = torch.randn(n, cols)
            g, p = cpu_ms(gemv, x, args.reps), cpu_ms(panels, x, args.reps)
            one = one or g
            row = {"format": fmt, "rows": n, "gemv_ms": round(g, 2), "panels_ms": round(p, 2),
                   "gemv_vs_one_row": round(g / one, 2), "gemv_rows_limit": native.fp8_gemv_max_rows(8)}  # fmt: skip
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
