"""y = x W^T on CUDA with W kept in its device format: bf16 rows, FP8 E4M3 rows with power-of-two block scales, or
bfp8_b / bfp4_b tiles, decoded in the kernel.

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

FP8 rows decode bit by bit (E4M3FN: bias 7, subnormals below exponent field 1; the NaN code 0x7F is not expected
in weights) and take their block's scale, a power of two, so the bf16 block is exact too.

A bfp matrix may also be named by a slot number the kernel reads from device memory (`linear(..., slot=...)`): the
launch then holds no Python value that changes between experts, so a CUDA graph captured once replays for whichever
slots the table holds at replay time.

Under TRITON_INTERPRET=1 the same kernel runs on CPU tensors (the tests use that to check the byte layout).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.formats import bfp

FP8_BLOCK = 128  # the checkpoint's FP8 scale blocks (config fp8_block)


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


@triton.jit
def _decode_fp8_block(w_ptr, s_ptr, n0, k0, N, K, stride_wn, stride_sn, BN: tl.constexpr, BK: tl.constexpr,
                      SB: tl.constexpr):  # fmt: skip
    """The [BN, BK] block of W at (n0, k0) from E4M3 bytes times its SB x SB scale block's power of two, as bf16
    (exact). Zeros outside the matrix."""
    n = n0 + tl.arange(0, BN)[:, None]
    k = k0 + tl.arange(0, BK)[None, :]
    inside = (n < N) & (k < K)
    b = tl.load(w_ptr + n.to(tl.int64) * stride_wn + k, mask=inside, other=0).to(tl.int32)
    sign, e, mant = (b >> 7) & 1, (b >> 3) & 0xF, b & 7
    normal = ((sign << 31) | ((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    sub = mant.to(tl.float32) * 0.001953125  # mant x 2^-9
    v = tl.where(e == 0, tl.where(sign == 1, -sub, sub), normal)
    if SB % BN == 0 and SB % BK == 0:  # the block lies in one scale block (the checkpoint's 128): one load
        s = tl.load(s_ptr + (n0 // SB).to(tl.int64) * stride_sn + k0 // SB)
    else:
        s = tl.load(s_ptr + (n // SB).to(tl.int64) * stride_sn + k // SB, mask=inside, other=0.0)
    return (v * s).to(tl.bfloat16)


# M (rows of x) and the tile grid's width vary per call; specializing on them would compile a variant per value. The
# slot number's address is a table entry, 4- or 8-byte aligned by its index: its alignment would double the variants
@triton.jit(do_not_specialize=["M", "tiles_per_row"], do_not_specialize_on_alignment=["slot_ptr"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    slot_ptr,
    slot_stride,
    w_offset,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    tiles_per_row,
    MBITS: tl.constexpr,  # 0: W is bf16 rows; -1: FP8 rows with SB x SB scale blocks at s_ptr; 7 / 3: bfp8_b / bfp4_b
    SB: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SLOT: tl.constexpr = False,  # bfp only: W starts w_offset bytes into slot *slot_ptr of a pool at w_ptr
):
    if SLOT:
        # int64: a pool of many slots passes 2^31 bytes
        w_ptr += tl.load(slot_ptr).to(tl.int64) * slot_stride + w_offset
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
        elif MBITS == -1:
            w = _decode_fp8_block(w_ptr, s_ptr, pid_n * BN, k0, N, K, stride_wn, stride_sn, BN, BK, SB)
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


def warm_up(device: torch.device, fmts: tuple[str, ...], fp8_block: int = FP8_BLOCK) -> None:
    """Compile the kernel for each format and row-block size before the first request needs it (a compile takes
    about a second; a prefill would otherwise pay it inside its TTFT). Shapes here have the same divisibility as
    the model's, so they hit the same compiled variants. (The slot-indirect variant a captured decode step
    launches is compiled by GraphDecode, on the rank's own slot pool.)"""
    for fmt in fmts:
        scale = None
        if fmt == "bf16":
            w = torch.zeros(64, 64, dtype=torch.bfloat16, device=device)
        elif fmt == "fp8":
            w = torch.zeros(64, 64, dtype=torch.uint8, device=device)
            scale = torch.ones(-(-64 // fp8_block), -(-64 // fp8_block), device=device)
        else:
            w = torch.zeros(bfp.packed_size((64, 64), fmt), dtype=torch.uint8, device=device)
        for m in (1, 32, 64):
            linear(torch.zeros(m, 64, device=device), w, fmt, (64, 64), scale=scale, block=fp8_block)


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    fmt: str,
    shape: tuple[int, int] | None = None,
    scale: torch.Tensor | None = None,
    block: int = FP8_BLOCK,
    *,
    slot: torch.Tensor | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """x [M, K] (any float dtype) @ W^T -> fp32 [M, N].

    fmt "bf16": w is bf16 [N, K] (rows may be strided, columns contiguous). fmt "fp8": w is the uint8 E4M3 bytes
    [N, K] (columns contiguous) and `scale` the fp32 powers of two of its `block` x `block` blocks
    [ceil(N/block), ceil(K/block)]. fmt "bfp8_b"/"bfp4_b": w is the uint8 tile bytes of a [N, K] matrix whose sides
    are multiples of 32 (`shape`); x's K may be narrower than the padded columns (the missing columns count as
    zeros).

    With `slot` (bfp only), w is a slot pool [n_slots, stride] and the tiles start `offset` bytes into row slot[0],
    which the kernel reads on the device: nothing here waits for the GPU, so the call may be captured in a CUDA graph
    and replayed after the slot tensor is rewritten in place. The slot number is not checked (that would need a
    read back): it must be below n_slots."""
    mbits = {"bf16": 0, "fp8": -1}.get(fmt, bfp.MANTISSA_BITS.get(fmt))
    if mbits is None:
        raise ValueError(f"unknown weight format {fmt!r}")
    if slot is not None and mbits not in (7, 3):
        raise ValueError(f"a slot names bfp tiles, not {fmt}")
    x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    s, stride_sn = x, 0  # a placeholder pointer where no scales are read
    if mbits == 0:
        if w.dtype != torch.bfloat16 or w.stride(-1) != 1:
            raise ValueError("bf16 linear needs a bf16 weight with contiguous rows")
        n, kw = w.shape
        stride_wn, tiles_per_row = w.stride(0), 0
    elif mbits == -1:
        if w.dtype != torch.uint8 or w.dim() != 2 or w.stride(-1) != 1:
            raise ValueError("fp8 linear needs uint8 E4M3 bytes [N, K] with contiguous rows")
        n, kw = w.shape
        grid = (-(-n // block), -(-kw // block))
        if block < 1 or scale is None or tuple(scale.shape) != grid or scale.dtype != torch.float32:
            raise ValueError(f"fp8 linear needs fp32 scales {list(grid)} of its {block}-blocks")
        s, stride_sn = scale.contiguous(), grid[1]
        stride_wn, tiles_per_row = w.stride(0), 0
    else:
        n, kw = shape
        if n % 32 or kw % 32:
            raise ValueError(f"bfp tiles cover multiples of 32, got {shape}")
        if slot is not None:
            _check_slot(w, slot, offset, bfp.packed_size((n, kw), fmt))
        elif w.dtype != torch.uint8 or w.numel() != bfp.packed_size((n, kw), fmt):
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
        s,
        y,
        w if slot is None else slot,
        0 if slot is None else w.stride(0),
        offset if slot is not None else 0,
        m,
        n,
        k,
        x.stride(0),
        stride_wn,
        stride_sn,
        y.stride(0),
        tiles_per_row,
        MBITS=mbits,
        SB=block,
        BM=bm,
        BN=bn,
        BK=bk,
        SLOT=slot is not None,
    )
    return y


_SLOT_DTYPES = (torch.int32, torch.int64)


def _check_slot(w: torch.Tensor, slot: torch.Tensor, offset: int, nbytes: int) -> None:
    """What linear's slot form needs, from shapes and dtypes alone (reading the slot would wait for the GPU)."""
    if w.dtype != torch.uint8 or w.dim() != 2 or w.stride(-1) != 1:
        raise ValueError("a slot pool is uint8 [n_slots, stride] with contiguous rows")
    if offset < 0 or offset + nbytes > w.shape[1]:
        raise ValueError(f"{nbytes} bytes at byte {offset} pass the end of a {w.shape[1]}-byte slot")
    if slot.dtype not in _SLOT_DTYPES or slot.numel() != 1 or slot.device != w.device:
        raise ValueError(
            f"a slot is one int32 or int64 on {w.device}, got {slot.dtype} {list(slot.shape)} on {slot.device}"
        )
