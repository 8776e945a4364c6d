"""The engine's CPU kernels at V4.1-Flash's widths, per x86 build, against torch on the same shapes in the same run.

Every kernel build this CPU can run (native = -march=native, avx2 = csrc/simd.h's AVX2 loops forced, generic = the
portable loops) times the decode GEMVs (one vector: a routed expert's w1 [2304, 5120] in bfp4_b and bfp8_b, an FP8
dense matrix of the same shape, the bf16 head's rows) and the prefill products (a 512-token chunk): the whole
weight expanded, then multiplied by torch's fp32 BLAS ("expand + BLAS"), and the fused product that expands panels
where it multiplies them (native.packed_linear, "fused"; where the build has it). Baselines: torch's fp32 and bf16
products on the same shapes (the reference's decode is the fp32 GEMV; the compute roof of a prefill is the faster
of torch's two matmuls here).

    .venv/bin/python benchmarks/cpu_kernels.py [--rows 512] [--repeat 20]
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from dsflash.formats import bfp
from dsflash.runtime.cpu import native
from dsflash.runtime.cpu.dense import Bf16Weight, Fp8Weight

O, I = 2304, 5120  # moe_intermediate_size x hidden_size


def best_ms(f, repeat: int) -> float:
    """The fastest of `repeat` calls after two warm-ups, in ms (the least disturbed by the machine's other work)."""
    f(), f()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def cpu_class() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    isa = "AMX" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else (
        "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE")  # fmt: skip
    return f"{name} ({platform.machine()}, {isa}), {torch.get_num_threads()} threads"


def builds() -> dict[str, object]:
    out = {"native": native.build()}
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if all(f in info.split() for f in ("avx2", "fma", "f16c")):
        out["avx2"] = native.build(native.AVX2_FLAGS)
    out["generic"] = native.build(native.GENERIC_FLAGS)
    return {k: v for k, v in out.items() if v is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512, help="prefill chunk rows")
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    torch.manual_seed(0)
    w = torch.randn(O, I) * 0.02
    x1, xs = torch.randn(1, I), torch.randn(a.rows, I)
    flop = 2 * a.rows * O * I
    wb, fp8w = w.bfloat16(), Fp8Weight.quantized(w, 32)
    bf16w = Bf16Weight(wb)
    tiles = {fmt: bfp.pack(w.numpy(), fmt) for fmt in ("bfp4_b", "bfp8_b")}
    print(cpu_class())
    base = {
        "fp32 gemv": best_ms(lambda: x1 @ w.T, a.repeat),
        "bf16 gemv": best_ms(lambda: x1.bfloat16() @ wb.T, a.repeat),
        "fp32 matmul": best_ms(lambda: xs @ w.T, max(3, a.repeat // 5)),
        "bf16 matmul": best_ms(lambda: xs.bfloat16() @ wb.T, max(3, a.repeat // 5)),
    }
    print(f"torch [{O}, {I}]: fp32 GEMV {base['fp32 gemv']:.3f} ms ({O * I * 4 / base['fp32 gemv'] / 1e6:.1f} GB/s), "
          f"bf16 GEMV {base['bf16 gemv']:.3f} ms; {a.rows}-row matmul fp32 {flop / base['fp32 matmul'] / 1e6:.0f} "
          f"GFLOP/s, bf16 {flop / base['bf16 matmul'] / 1e6:.0f} GFLOP/s")  # fmt: skip
    roof = min(base["fp32 matmul"], base["bf16 matmul"])
    print("| build | kernel | decode ms | GB/s | vs torch fp32 GEMV | prefill GFLOP/s (expand + BLAS / fused) "
          "| of the roof (expand + BLAS / fused) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    few = max(3, a.repeat // 5)
    q, s256 = fp8w.q, fp8w.scale256
    for name, lib in builds().items():
        native._lib = lib
        fused = native.f32_packed_ready()
        rows = []
        for fmt, t in tiles.items():
            dec = best_ms(lambda t=t, fmt=fmt: native.gemv(t, (O, I), fmt, x1), a.repeat)
            pre = best_ms(lambda t=t, fmt=fmt: xs @ native.dequant_f32(t, (O, I), fmt).T, few)
            fu = best_ms(lambda t=t, fmt=fmt: native.packed_linear(xs, t, fmt, (O, I)), few) if fused else None
            rows.append((fmt, dec, t.nbytes, pre, fu))
        dec = best_ms(lambda: fp8w.linear(x1), a.repeat)
        pre = best_ms(lambda: xs @ native.fp8_dequant(q, s256, 32).T, few) if lib else None
        fu = best_ms(lambda: native.packed_linear(xs, q, "fp8", (O, I), s256, 32), few) if fused else None
        rows.append(("fp8 dense", dec, O * I, pre, fu))
        rows.append(("bf16 rows", best_ms(lambda: bf16w.linear(x1), a.repeat), O * I * 2, None, None))
        for kernel, dec, nbytes, pre, fu in rows:
            cells = [(f"{flop / t / 1e6:.0f}", f"{roof / t:.2f}") if t else ("-", "-") for t in (pre, fu)]
            pre_s = f"{cells[0][0]} / {cells[1][0]} | {cells[0][1]} / {cells[1][1]}"
            gbs, vs = nbytes / dec / 1e6, base["fp32 gemv"] / dec
            print(f"| {name} | {kernel} | {dec:.3f} | {gbs:.1f} | {vs:.2f}x | {pre_s} |")
    native._lib = None


if __name__ == "__main__":
    main()
