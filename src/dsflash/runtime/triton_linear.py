"""y = x W^T on CUDA with W kept in its device format: bf16 rows, or bfp8_b / bfp4_b tiles decoded in the kernel.

One Triton kernel serves decode (a few rows) and prefill (many): each program owns BM rows of x and BN outputs and
walks K. The weight block is decoded to bf16 in registers (exact for every format here); x is split into two bf16
terms (hi + lo, ~16 significant bits) and both products accumulate in fp32, so the result is fp32-grade like the
CPU engine's bf16x2 mode: tensor-core products without rounding the activations to bf16. (Unlike the CPU kernels,
a token's sums may be ordered differently in a decode-sized and a prefill-sized call: equal to fp32 rounding, not
bit for bit.)

Tile layout (docs/bfp_format.md): tiles row-major over the [rows/32, cols/32] grid; a tile is 64 exponent bytes
(one per face row, index 16 * face + row) then the face rows' codes, faces 0..3 = (top-left, top-right,
bottom-left, bottom-right). A code is sign << m | magnitude; bfp4_b packs two per byte, even column low nibble.
Decoding follows formats/bfp.py bit for bit: zero code -> signed zero, exponent field below zero -> 0.

Under TRITON_INTERPRET=1 the same kernel runs on CPU tensors (the tests use that to check the byte layout).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.formats import bfp


@triton.jit
def _decode_tile_block(w_ptr, n0, k0, N, tiles_per_row, BN: tl.constexpr, BK: tl.constexpr, M: tl.constexpr):
    """The [BN, BK] block of W at (n0, k0) from bfp tiles with M magnitude bits per code, as bf16 (exact: at most 8
    significant bits); zeros outside the matrix."""
    RB: tl.constexpr = 2 * (M + 1)  # code bytes per face row
    TB: tl.constexpr = 64 + 16 * 4 * RB  # a tile: 64 exponent bytes, then 64 face rows (bfp.tile_bytes)
    n = n0 + tl.arange(0, BN)[:, None]
    k = k0 + tl.arange(0, BK)[None, :]
    tile = (n // 32).to(tl.int64) * tiles_per_row + k // 32
    rn, ck = n % 32, k % 32
    face = (rn // 16) * 2 + ck // 16
    frow = face * 16 + rn % 16
    inside = (n < N) & (k < tiles_per_row * 32)
    base = w_ptr + tile * TB
    e = tl.load(base + frow, mask=inside, other=0).to(tl.int32)
    if M == 7:
        code = tl.load(base + 64 + frow * RB + ck % 16, mask=inside, other=0).to(tl.int32)
    else:
        byte = tl.load(base + 64 + frow * RB + (ck % 16) // 2, mask=inside, other=0).to(tl.int32)
        code = (byte >> ((ck % 2) * 4)) & 0xF
    sign = (code >> M) & 1
    mag = code & ((1 << M) - 1)
    u = mag.to(tl.float32).to(tl.int32, bitcast=True)
    field = (u >> 23) + e - (M - 1) - 127
    bits = (sign << 31) | (field << 23) | (u & 0x7FFFFF)
    bits = tl.where(field < 0, 0, bits)
    bits = tl.where(mag == 0, sign << 31, bits)
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


# M (rows of x) and the tile grid's width vary per call; specializing on them would compile a variant per value
@triton.jit(do_not_specialize=["M", "tiles_per_row"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    tiles_per_row,
    MBITS: tl.constexpr,  # 0: W is bf16 rows; 7 / 3: bfp8_b / bfp4_b tiles
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        hi = x.to(tl.bfloat16)
        lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
        if MBITS == 0:
            w = tl.load(
                w_ptr + rn[:, None].to(tl.int64) * stride_wn + kk[None, :],
                mask=(rn[:, None] < N) & (kk[None, :] < K),
                other=0.0,
            )
        else:
            w = _decode_tile_block(w_ptr, pid_n * BN, k0, N, tiles_per_row, BN, BK, MBITS)
        wt = tl.trans(w)
        acc = tl.dot(hi, wt, acc)
        acc = tl.dot(lo, wt, acc)
    out = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def _blocks(m: int) -> tuple[int, int, int]:
    """(BM, BN, BK): decode keeps BM at the 16 rows a tensor-core product needs and narrows BN so a matrix spreads
    over enough programs to stream at full bandwidth; prefill widens BM so each decoded weight block serves more
    rows. bfp blocks cover whole 32x32 tiles."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    return bm, 32, 64


def warm_up(device: torch.device, fmts: tuple[str, ...]) -> None:
    """Compile the kernel for each format and row-block size before the first request needs it (a compile takes
    about a second; a prefill would otherwise pay it inside its TTFT). Shapes here have the same divisibility as
    the model's, so they hit the same compiled variants."""
    for fmt in fmts:
        if fmt == "bf16":
            w = torch.zeros(64, 64, dtype=torch.bfloat16, device=device)
        else:
            w = torch.zeros(bfp.packed_size((64, 64), fmt), dtype=torch.uint8, device=device)
        for m in (1, 32, 64):
            linear(torch.zeros(m, 64, device=device), w, fmt, (64, 64))


def linear(x: torch.Tensor, w: torch.Tensor, fmt: str, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype) @ W^T -> fp32 [M, N].

    fmt "bf16": w is bf16 [N, K] (rows may be strided, columns contiguous). fmt "bfp8_b"/"bfp4_b": w is the uint8
    tile bytes of a [N, K] matrix whose sides are multiples of 32 (`shape`); x's K may be narrower than the padded
    columns (the missing columns count as zeros)."""
    mbits = 0 if fmt == "bf16" else bfp.MANTISSA_BITS.get(fmt)
    if mbits is None:
        raise ValueError(f"unknown weight format {fmt!r}")
    x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if mbits == 0:
        if w.dtype != torch.bfloat16 or w.stride(-1) != 1:
            raise ValueError("bf16 linear needs a bf16 weight with contiguous rows")
        n, kw = w.shape
        stride_wn, tiles_per_row = w.stride(0), 0
    else:
        n, kw = shape
        if n % 32 or kw % 32:
            raise ValueError(f"bfp tiles cover multiples of 32, got {shape}")
        if w.dtype != torch.uint8 or w.numel() != bfp.packed_size((n, kw), fmt):
            raise ValueError(f"{w.numel()} bytes of {w.dtype} do not hold {fmt} {list(shape)}")
        stride_wn, tiles_per_row = 0, kw // 32
    if k > kw:
        raise ValueError(f"x has {k} columns, the weight {kw}")
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y
    bm, bn, bk = _blocks(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _linear_kernel[grid](
        x,
        w,
        y,
        m,
        n,
        k,
        x.stride(0),
        stride_wn,
        y.stride(0),
        tiles_per_row,
        MBITS=mbits,
        BM=bm,
        BN=bn,
        BK=bk,
    )
    return y
