"""Single-thread throughput of the bfp tile codec, against baselines measured in the same process.

    .venv/bin/python benchmarks/bfp_pack.py [--reps 7]

1. pack() of a 4096x4096 float32 N(0,1) matrix to bfp4_b and bfp8_b, vs the clear NumPy model
   (bfp.pack_reference) and vs tt-metal 0.81.1's own scalar packer (bfp_format.md §10, a constant).
2. fp4_to_bfp4() of a real-size expert matrix (V4.1 w1: FP4 [2304, 5120] = I8 [2304, 2560] + E8M0 [2304, 160]),
   vs the obvious route pack(fp4.dequant(...)).

MB = 1e6 bytes. Wall time is the median of --reps runs after a warm-up; the thread's CPU time is printed too,
because a shared machine inflates wall time but not CPU time.
"""

import os

for _var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy/numba/torch start their pools

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dsflash.formats import bfp, fp4  # noqa: E402

# tt-metal 0.81.1 pack_as_bfp_tiles alone, 4096x4096 fp32, one thread (bfp_format.md §10, median of 7)
TT_METAL_PACK_MS = {"bfp8_b": 123.0, "bfp4_b": 171.0}
TARGET_PACK_MS = {"bfp4_b": 80.0}  # half of tt-metal's time (about 800 MB/s in)
TARGET_FP4_OUT_MB_S = 500.0


def timed(fn, reps: int) -> tuple[float, float]:
    """Median wall and CPU seconds of fn() over reps runs, after one warm-up."""
    fn()
    walls, cpus = [], []
    for _ in range(reps):
        w, c = time.perf_counter(), time.thread_time()
        fn()
        cpus.append(time.thread_time() - c)
        walls.append(time.perf_counter() - w)
    return statistics.median(walls), statistics.median(cpus)


def line(label: str, wall: float, cpu: float, in_bytes: int, out_bytes: int) -> None:
    print(
        f"  {label:<34} {wall * 1e3:9.2f} ms  (cpu {cpu * 1e3:8.2f} ms)  "
        f"in {in_bytes / wall / 1e6:8.1f} MB/s  out {out_bytes / wall / 1e6:8.1f} MB/s"
    )


def bench_pack(reps: int, ref_reps: int) -> None:
    x = np.random.default_rng(0).standard_normal((4096, 4096), dtype=np.float32)
    for fmt in ("bfp4_b", "bfp8_b"):
        out = bfp.packed_size(x.shape, fmt)
        print(f"pack 4096x4096 float32 -> {fmt} ({x.nbytes / 1e6:.1f} MB in, {out / 1e6:.1f} MB out)")
        wall, cpu = timed(lambda f=fmt: bfp.pack(x, f), reps)
        ref_wall, ref_cpu = timed(lambda f=fmt: bfp.pack_reference(x, f), ref_reps)
        tt = TT_METAL_PACK_MS[fmt] / 1e3
        line("dsflash bfp.pack (numba)", wall, cpu, x.nbytes, out)
        line("NumPy reference (same process)", ref_wall, ref_cpu, x.nbytes, out)
        line("tt-metal 0.81.1 anchor (constant)", tt, tt, x.nbytes, out)
        print(f"  speed-up: {ref_wall / wall:.1f}x over NumPy reference, {tt / wall:.1f}x over tt-metal")
        if fmt in TARGET_PACK_MS:
            ok = wall * 1e3 <= TARGET_PACK_MS[fmt]
            print(f"  target <= {TARGET_PACK_MS[fmt]:.0f} ms: {'met' if ok else 'NOT MET'}")


def bench_fp4(reps: int) -> None:
    w = torch.randn(2304, 5120, generator=torch.Generator().manual_seed(0)) * 0.02
    packed, scale = fp4.quant(w)  # real-looking codes and scales
    in_bytes = packed.numel() + scale.numel()
    out = bfp.packed_size((2304, 5120), "bfp4_b")
    print(f"checkpoint FP4 [2304, 5120] -> bfp4_b ({in_bytes / 1e6:.2f} MB in, {out / 1e6:.2f} MB out)")
    for search in (False, True):  # ttnn's bytes, and the store's lower-error exponents
        wall, cpu = timed(lambda s=search: bfp.fp4_to_bfp4(packed, scale, s), reps)
        base_wall, base_cpu = timed(
            lambda s=search: bfp.pack(fp4.dequant(packed, scale), "bfp4_b", s), max(3, reps // 2)
        )
        what = ", search" if search else ""
        line(f"dsflash bfp.fp4_to_bfp4{what}", wall, cpu, in_bytes, out)
        line(f"pack(fp4.dequant(...){what}) (same process)", base_wall, base_cpu, in_bytes, out)
        print(f"  speed-up: {base_wall / wall:.1f}x over dequantize-then-pack")
        ok = out / wall / 1e6 >= TARGET_FP4_OUT_MB_S
        print(f"  target >= {TARGET_FP4_OUT_MB_S:.0f} MB/s out per core: {'met' if ok else 'NOT MET'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed runs per measurement (default: %(default)s)")
    parser.add_argument(
        "--ref-reps", type=int, default=3, help="runs of the slow NumPy reference (default: %(default)s)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"one thread; numba {os.environ['NUMBA_NUM_THREADS']} thread, torch {torch.get_num_threads()} thread")
    bench_pack(args.reps, args.ref_reps)
    bench_fp4(args.reps)


if __name__ == "__main__":
    main()
