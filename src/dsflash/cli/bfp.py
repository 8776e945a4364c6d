"""`dsflash bfp`: pack .npy matrices into Tenstorrent BFLOAT4_B/8_B tiles, unpack them, and time the packer."""

from __future__ import annotations

import argparse

FORMATS = ("bfp4_b", "bfp8_b")


def _shape(text: str) -> tuple[int, ...]:
    """'H,W' or 'B,...,H,W' -> tuple of non-negative ints."""
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape must be comma-separated integers like 4096,4096, got {text!r}"
        ) from None
    if len(dims) < 2 or min(dims) < 0:
        raise argparse.ArgumentTypeError(f"shape needs at least H,W and no negative sizes, got {text!r}")
    return dims


def _format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=FORMATS, default="bfp4_b", help="tile format (default: %(default)s)")


def add_parser(sub) -> None:
    p = sub.add_parser("bfp", help="pack/unpack bfp4_b/bfp8_b tiles byte-exact with ttnn, or time the packer")
    p.set_defaults(run=run)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    pk = actions.add_parser("pack", help="float32/bfloat16 .npy [..., H, W] -> packed tiles (raw bytes)")
    _format(pk)
    pk.add_argument("input", metavar="IN.npy", help="matrix to pack; each [H, W] slice is zero-padded to 32x32 tiles")
    pk.add_argument("output", metavar="OUT.bin", help="where to write the tiles")

    up = actions.add_parser("unpack", help="packed tiles -> float32 .npy, decoded as ttnn.to_torch does")
    _format(up)
    up.add_argument("--shape", type=_shape, required=True, help="logical shape H,W (or B,...,H,W); required")
    up.add_argument("input", metavar="IN.bin", help="packed tiles")
    up.add_argument("output", metavar="OUT.npy", help="where to write the float32 matrix")

    bn = actions.add_parser("bench", help="time pack() on a float32 N(0,1) matrix here; prints one JSON line")
    _format(bn)
    bn.add_argument("--shape", type=_shape, default=(4096, 4096), help="matrix shape H,W (default: 4096,4096)")
    bn.add_argument(
        "--reps",
        type=int,
        default=7,
        help="timed runs after one warm-up; the median is reported (default: %(default)s)",
    )


def run(args) -> int:
    return {"pack": _pack, "unpack": _unpack, "bench": _bench}[args.action](args)


def _pack(args) -> int:
    import numpy as np

    from dsflash.formats import bfp

    try:
        x = np.load(args.input, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise bfp.BfpError(f"cannot read {args.input} as .npy: {e}") from None
    buf = bfp.pack(x, args.format)
    _write(args.output, buf.tobytes(), bfp)
    print(f"{args.output}: {list(x.shape)} {x.dtype} -> {buf.size} bytes {args.format}")
    return 0


def _unpack(args) -> int:
    import io

    import numpy as np

    from dsflash.formats import bfp

    try:
        with open(args.input, "rb") as f:
            data = f.read()
    except OSError as e:
        raise bfp.BfpError(f"cannot read {args.input}: {e.strerror}") from None
    x = bfp.unpack(data, args.format, args.shape)
    npy = io.BytesIO()
    np.save(npy, x)  # into memory first: np.save on a path would append .npy to a name without it
    _write(args.output, npy.getvalue(), bfp)
    print(f"{args.output}: {len(data)} bytes {args.format} -> {list(x.shape)} float32")
    return 0


def _write(path: str, data: bytes, bfp) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        raise bfp.BfpError(f"cannot write {path}: {e.strerror}") from None


def _bench(args) -> int:
    import json
    import statistics
    import time

    import numpy as np

    from dsflash.formats import bfp

    if args.reps < 1:
        raise bfp.BfpError(f"--reps must be at least 1, got {args.reps}")
    x = np.random.default_rng(0).standard_normal(args.shape, dtype=np.float32)
    out = bfp.pack(x, args.format)  # warm-up: loads or compiles the kernel
    times = []
    for _ in range(args.reps):
        t = time.perf_counter()
        bfp.pack(x, args.format)
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    row = {
        "format": args.format,
        "shape": list(args.shape),
        "median_ms": round(med * 1e3, 3),
        # significant digits, not decimals: a tiny shape on a busy machine runs at a few MB/s
        "in_mb_per_s": float(f"{x.nbytes / med / 1e6:.4g}"),
        "out_mb_per_s": float(f"{out.size / med / 1e6:.4g}"),
    }
    print(json.dumps(row))
    return 0
