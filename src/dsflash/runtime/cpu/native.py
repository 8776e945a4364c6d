"""The engine's CPU kernels (csrc/*.c: block-float experts, FP8 / bf16 dense GEMV, AMX prefill products, mHC's
Sinkhorn): compiled at first use with the system C compiler, cached, and called through ctypes (which releases the
GIL); the kernels split their rows over torch's OpenMP threads themselves. Without a compiler the same operations
fall back to torch (correct, slower)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from dsflash.paths import kernel_dir

log = logging.getLogger(__name__)

MBITS = {"bfp4_b": 3, "bfp8_b": 7}
BF16X2 = "bf16x2"  # prefill products on AMX with x as two bf16 terms (amx_cpu.c): a matmul mode next to the dtypes
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11", "-fopenmp")
GENERIC_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c11", "-fopenmp")  # no AVX-512: the portable loops
# the AVX2 + FMA + F16C loops (csrc/simd.h), which a CPU with AVX-512 would otherwise never build: tests force them
AVX2_FLAGS = ("-O3", "-march=haswell", "-mtune=generic", "-shared", "-fPIC", "-std=c11", "-fopenmp")
SOURCES = ("bfp_cpu.c", "dense_cpu.c", "amx_cpu.c", "mhc_cpu.c", "packed_cpu.c", "attn_cpu.c")
HEADERS = ("simd.h",)
_lock = threading.Lock()
_lib: ctypes.CDLL | None | bool = None  # False: tried and unavailable


def _cpu_signature() -> bytes:
    """What -march=native compiled for: a library built on another CPU must not be loaded here."""
    try:
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
        return (flags[0] if flags else "").encode()
    except OSError:
        return os.uname().machine.encode()


@functools.cache
def _cpu_flags() -> bytes:
    return _cpu_signature()


def build(flags: tuple[str, ...] = _FLAGS) -> ctypes.CDLL | None:
    """Compile csrc/*.c with `flags` (cached by source, compiler, flags and CPU) and load it; None if that fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: the engine's CPU kernels fall back to torch (slower)")
        return None
    csrc = resources.files("dsflash.runtime.cpu") / "csrc"
    src = b"".join((csrc / n).read_bytes() for n in SOURCES + HEADERS)
    key = hashlib.sha256(src + " ".join([cc, *flags]).encode() + _cpu_signature()).hexdigest()[:16]
    out = kernel_dir() / f"dsflash_cpu-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            for n in SOURCES + HEADERS:
                (Path(tmp) / n).write_bytes((csrc / n).read_bytes())
            files = [str(Path(tmp) / n) for n in SOURCES]
            so = Path(tmp) / out.name
            res = subprocess.run([cc, *flags, "-o", str(so), *files, "-lm"], capture_output=True, text=True)
            if res.returncode != 0:
                log.warning("compiling the CPU kernels failed, using torch instead: %s", res.stderr[-500:])
                return None
            os.replace(so, out)  # atomic: concurrent ranks may compile at once
    import torch  # noqa: F401 - torch's libgomp first: the kernels then join its OpenMP thread team

    lib = ctypes.CDLL(str(out))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.bfp_gemv.argtypes = [p, i, i, i, p, i, p, i, i]
    lib.bfp_expand.argtypes = [p, i, i, i, p, i, i, i]
    lib.swiglu_rows.argtypes = [p, p, p, ctypes.c_int64, i, ctypes.c_float, p]
    i64 = ctypes.c_int64
    lib.bfp_moe_decode.argtypes = [p, i, i, i64, i64, i64, i, i, i, p, p, ctypes.c_float, p, p]
    lib.bfp_moe_decode_batch.argtypes = [p, i, i, i64, i64, i64, i, i, i, p, i, i, p, p, ctypes.c_float, p, p]
    lib.fp8_gemv.argtypes = [p, p, i, i, i, p, i, p, i, i]
    lib.fp8_gemv_grouped.argtypes = [p, p, i, i, i, p, i, p]
    lib.fp8_ffn_decode.argtypes, lib.fp8_ffn_decode.restype = [p, p, p, p, p, p, i, i, i, p, ctypes.c_float, p, p], i
    lib.fp8_expand.argtypes = [p, p, i, i, i, p, i, i, i]
    lib.bf16_gemv.argtypes = [p, i, i, p, i, p, i, i]
    lib.bf16_gemv_rows.argtypes = [p, i, p, i, p, p]
    lib.top_indices.argtypes = [p, ctypes.c_int64, i, p]
    lib.amx_ready.argtypes, lib.amx_ready.restype = [], i
    lib.amx_linear.argtypes = [p, i, i, p, i, i, i, p]
    lib.amx_linear_packed.argtypes, lib.amx_linear_packed.restype = [i, p, p, i, i, i, p, i, i, p], i
    lib.split_vnni.argtypes = [p, i, i, p, i, i]
    lib.f32_packed_ready.argtypes, lib.f32_packed_ready.restype = [], i
    lib.f32_packed_lanes.argtypes, lib.f32_packed_lanes.restype = [], i
    lib.fp8_gemv_max_rows.argtypes, lib.fp8_gemv_max_rows.restype = [], i
    lib.fp8_rows = lib.fp8_gemv_max_rows()  # asked once: every dense product consults it
    lib.f32_linear_packed.argtypes, lib.f32_linear_packed.restype = [i, p, p, i, i, i, p, i, p, p], i
    lib.sinkhorn.argtypes = [p, ctypes.c_int64, i, i, ctypes.c_float]
    f = ctypes.c_float
    lib.mhc_mixes.argtypes = [p, ctypes.c_int64, i, i, p, p, p, i, f, f, p]
    lib.hc_collapse_norm.argtypes = [p, ctypes.c_int64, i, i, p, p, f, p]
    lib.hc_expand.argtypes = [p, p, p, p, ctypes.c_int64, i, i, p]
    lib.rms_norm.argtypes = [p, ctypes.c_int64, i, p, f, p]
    lib.moe_route.argtypes = [p, ctypes.c_int64, i, p, p, i, f, i, i, i, f, p, p]
    lib.rope_rotate.argtypes = [p, ctypes.c_int64, i, i, p, ctypes.c_int64, ctypes.c_int64, i, p]
    lib.engram_gate.argtypes = [p, p, ctypes.c_int64, i, i, p, p, f, f, p]
    lib.sparse_attn.argtypes = [p, i, i, i, p, p, i, p, f, p, p]
    lib.index_scores.argtypes = [p, i, i, i, p, ctypes.c_int64, p, p]
    return lib


def lib() -> ctypes.CDLL | None:
    global _lib
    with _lock:
        if _lib is None:
            _lib = (build() or False) if os.environ.get("DSFLASH_NO_NATIVE") != "1" else False
    return _lib or None


_scratch = threading.local()


def scratch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A reusable buffer for an expansion that is consumed at once: a fresh tensor of this size would be fresh
    pages, and faulting them in costs as much as filling them."""
    cache = _scratch.__dict__.setdefault("buffers", {})
    key = (shape, dtype)
    if key not in cache:
        if len(cache) > 16:  # shapes are few (one per kind of matrix); bound it anyway
            cache.clear()
        cache[key] = torch.empty(shape, dtype=dtype)
    return cache[key]


def _ptr(a: np.ndarray | torch.Tensor) -> int:
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr()


def gemv(tiles: np.ndarray | torch.Tensor, shape: tuple[int, int], fmt: str, x: torch.Tensor) -> torch.Tensor:
    """x [n, cols] fp32 @ W^T with W [rows, cols] (both multiples of 32) packed in tiles -> fp32 [n, rows]."""
    rows, cols = shape
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], rows, dtype=torch.float32)
    k = lib()
    if k is None:
        return x @ dequant_bf16(tiles, shape, fmt).float().T
    tr, tc, m = rows // 32, cols // 32, MBITS[fmt]
    k.bfp_gemv(_ptr(tiles), tr, tc, m, x.data_ptr(), x.shape[0], y.data_ptr(), 0, tr)
    return y


def moe_decode(
    slots: np.ndarray, ids: list[int], layout, x: torch.Tensor, weights: torch.Tensor, limit: float
) -> torch.Tensor | None:
    """One token through several routed experts held in slots (uint8 [n_slots, stride]; layout: device.ShardLayout):
    x [1, cols] fp32, weights [n] -> fp32 [1, w2 rows], the sum over ids in order of expert(ids[i]) * weights[i], as
    one native call (bfp_moe_decode). None without kernels."""
    k = lib()
    if k is None or not ids:
        return None
    w1, w3, w2 = layout.w1, layout.w3, layout.w2
    xs = x.reshape(-1).float()
    if xs.numel() != w1.cols:  # the tiles cover whole 32-column blocks
        xs = torch.nn.functional.pad(xs, (0, w1.cols - xs.numel()))
    xs = xs.contiguous()
    wts = weights.reshape(-1).float().contiguous()
    n, tr13, tc13 = len(ids), w1.rows // 32, w1.cols // 32
    base, stride = slots.ctypes.data, slots.strides[0]
    ptrs = (ctypes.c_void_p * n)(*(base + s * stride for s in ids))
    work = scratch(((tc13 + n * tr13) * 128,), torch.float32)
    y = torch.empty(1, w2.rows, dtype=torch.float32)
    k.bfp_moe_decode(ptrs, n, MBITS[layout.fmt], w1.offset, w3.offset, w2.offset, tr13, tc13, w2.rows // 32,
                     xs.data_ptr(), wts.data_ptr(), limit, work.data_ptr(), y.data_ptr())  # fmt: skip
    return y


def moe_decode_batch(
    slots: np.ndarray,
    ids: list[int],
    layout,
    x: torch.Tensor,
    route: torch.Tensor,
    weights: torch.Tensor,
    limit: float,
) -> torch.Tensor | None:
    """A few tokens, each through its own routed experts, as one native call (bfp_moe_decode_batch): x [t, cols]
    fp32, route [t, k] (indices into ids, the slots of the experts any of them uses), weights [t, k] -> fp32
    [t, w2 rows], token i's row the sum over j in order of expert(ids[route[i, j]]) * weights[i, j], with the bits
    moe_decode gives token i alone with those experts in that order. None without kernels."""
    k = lib()
    if k is None or not ids:
        return None
    w1, w3, w2 = layout.w1, layout.w3, layout.w2
    xs = x.float()
    if xs.shape[1] != w1.cols:  # the tiles cover whole 32-column blocks
        xs = torch.nn.functional.pad(xs, (0, w1.cols - xs.shape[1]))
    xs = xs.contiguous()
    r = route.to(torch.int32).contiguous()
    wts = weights.float().contiguous()
    t, kk = r.shape
    tr13, tc13 = w1.rows // 32, w1.cols // 32
    base, stride = slots.ctypes.data, slots.strides[0]
    ptrs = (ctypes.c_void_p * len(ids))(*(base + s * stride for s in ids))
    work = scratch(((t * tc13 + t * kk * tr13) * 128,), torch.float32)
    y = torch.empty(t, w2.rows, dtype=torch.float32)
    k.bfp_moe_decode_batch(ptrs, len(ids), MBITS[layout.fmt], w1.offset, w3.offset, w2.offset, tr13, tc13,
                           w2.rows // 32, xs.data_ptr(), t, kk, r.data_ptr(), wts.data_ptr(), limit,
                           work.data_ptr(), y.data_ptr())  # fmt: skip
    return y


SWIGLU_MAX_ROWS = 16  # rows up to which swiglu() is worth its scalar loop: a decode batch's, not a prefill's


def swiglu(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor, limit: float) -> torch.Tensor | None:
    """model.experts.swiglu(gate, up, limit) * weights ([t, n] fp32, weights [t, 1]) with moe_decode's operations,
    so an expert product outside that call has its bits. None without kernels."""
    k = lib()
    if k is None or gate.dtype != torch.float32 or gate.device.type != "cpu" or gate.shape[0] > SWIGLU_MAX_ROWS:
        return None
    g, u = gate.contiguous(), up.float().contiguous()
    w = weights.reshape(-1).float().contiguous()
    h = torch.empty_like(g)
    k.swiglu_rows(g.data_ptr(), u.data_ptr(), w.data_ptr(), g.shape[0], g.shape[1], limit, h.data_ptr())
    return h


def dequant_f32(tiles: np.ndarray | torch.Tensor, shape: tuple[int, int], fmt: str) -> torch.Tensor:
    """Packed W [rows, cols] -> fp32 [rows, cols] (exact), in a scratch buffer valid until the next expansion."""
    rows, cols = shape
    k = lib()
    if k is None:
        return dequant_bf16(tiles, shape, fmt).float()
    out = scratch((rows, cols), torch.float32)
    tr, tc, m = rows // 32, cols // 32, MBITS[fmt]
    k.bfp_expand(_ptr(tiles), tr, tc, m, out.data_ptr(), 0, 0, tr)
    return out


def dequant_bf16(tiles: np.ndarray | torch.Tensor, shape: tuple[int, int], fmt: str) -> torch.Tensor:
    """Packed W [rows, cols] -> bfloat16 [rows, cols] (exact), in a scratch buffer valid until the next expansion."""
    rows, cols = shape
    k = lib()
    if k is None:
        from dsflash.formats import bfp

        buf = tiles.numpy() if isinstance(tiles, torch.Tensor) else tiles
        return torch.from_numpy(bfp.unpack(np.ascontiguousarray(buf), fmt, shape)).bfloat16()
    out = scratch((rows, cols), torch.bfloat16)
    tr, tc, m = rows // 32, cols // 32, MBITS[fmt]
    k.bfp_expand(_ptr(tiles), tr, tc, m, out.data_ptr(), 1, 0, tr)
    return out


def fp8_gemv(w: torch.Tensor, scale256: torch.Tensor, block: int, x: torch.Tensor) -> torch.Tensor | None:
    """x [n, I] fp32 @ W^T with W FP8 [O, I] (uint8 view) and fp32 block scales x 256 -> fp32 [n, O]; None if
    the kernels are unavailable."""
    k = lib()
    if k is None:
        return None
    (O, I), x = w.shape, x.float().contiguous()
    y = torch.empty(x.shape[0], O, dtype=torch.float32)
    k.fp8_gemv(w.data_ptr(), scale256.data_ptr(), O, I, block, x.data_ptr(), x.shape[0], y.data_ptr(), 0, O)
    return y


def fp8_gemv_max_rows(default: int) -> int:
    """The most rows fp8_gemv is the faster product for in the loaded build (default: without kernels)."""
    k = lib()
    return default if k is None else k.fp8_rows


def fp8_gemv_grouped(w: torch.Tensor, scale256: torch.Tensor, block: int, x: torch.Tensor) -> torch.Tensor | None:
    """Block-diagonal decode: x [G, I] fp32, W FP8 [O, I] as G groups of O / G rows -> fp32 [G, O / G], group g's
    rows against x[g]; each group equals fp8_gemv on its rows bit for bit. None if the kernels are unavailable."""
    k = lib()
    if k is None:
        return None
    (O, I), x = w.shape, x.float().contiguous()
    y = torch.empty(x.shape[0], O // x.shape[0], dtype=torch.float32)
    k.fp8_gemv_grouped(w.data_ptr(), scale256.data_ptr(), O, I, block, x.data_ptr(), O // x.shape[0], y.data_ptr())
    return y


def fp8_ffn_decode(w1, s1, w3, s3, w2, s2, block: int, x: torch.Tensor, limit: float) -> torch.Tensor | None:
    """W2 swiglu(W1 x, W3 x) for one row x [1, D] fp32 with FP8 W1, W3 [F, D] and W2 [D, F] (uint8 views, scales x
    256), as one call: each product fp8_gemv's bits, the activation model.experts.swiglu's math. -> fp32 [1, D];
    None without kernels or where the shapes do not suit the vector loops."""
    k = lib()
    if k is None:
        return None
    (F_, D), x = w1.shape, x.float().contiguous()
    h = scratch((F_,), torch.float32)
    y = torch.empty(1, D, dtype=torch.float32)
    ptrs = [t.data_ptr() for t in (w1, s1, w3, s3, w2, s2)]
    if not k.fp8_ffn_decode(*ptrs, F_, D, block, x.data_ptr(), limit, h.data_ptr(), y.data_ptr()):
        return None
    return y


def bf16_gemv(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """x [n, I] fp32 @ W^T with W bfloat16 [O, I] -> fp32 [n, O] (exact products); None without kernels."""
    k = lib()
    if k is None:
        return None
    (O, I), x = w.shape, x.float().contiguous()
    y = torch.empty(x.shape[0], O, dtype=torch.float32)
    k.bf16_gemv(w.data_ptr(), O, I, x.data_ptr(), x.shape[0], y.data_ptr(), 0, O)
    return y


def bf16_gemv_rows(w: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """W bfloat16 [O, I], row indices [n], x [I] -> fp32 [n]: bf16_gemv's value of each listed row, read in place
    (no gathered copy); None without kernels."""
    k = lib()
    if k is None:
        return None
    idx, x = rows.to(torch.int64).contiguous(), x.reshape(-1).float().contiguous()
    y = torch.empty(idx.numel(), dtype=torch.float32)
    k.bf16_gemv_rows(w.data_ptr(), w.shape[1], idx.data_ptr(), idx.numel(), x.data_ptr(), y.data_ptr())
    return y


# queries a sparse_attn call takes: its scratch holds their logits (a chunk's heads x selected rows each)
ATTN_CHUNK = 64


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float):
    """model.attention.sparse_attention with each query computed on its own over its selected rows in selection
    order (attn_cpu.c): a query's bits then do not depend on how many queries run beside it, so a decode step, a
    verify's position and a prefill's agree. q [b, s, h, d], kv [b, n, d], idx [b, s, k] -> [b, s, h, d] in q's
    dtype. None off the CPU or without kernels."""
    kern = lib()
    b, s, h, d = q.shape
    if kern is None or q.device.type != "cpu":
        return None
    out = torch.empty(b, s, h, d, dtype=torch.float32)
    k = idx.shape[-1]
    work = scratch((min(s, ATTN_CHUNK) * h * max(1, k),), torch.float32)
    sk = sink.float().contiguous()
    for i in range(b):
        qi, kvi = q[i].float().contiguous(), kv[i].float().contiguous()
        ix = idx[i].to(torch.int64).contiguous()
        for j in range(0, s, ATTN_CHUNK):
            n = min(ATTN_CHUNK, s - j)
            kern.sparse_attn(qi[j].data_ptr(), n, h, d, kvi.data_ptr(), ix[j].data_ptr(), k, sk.data_ptr(), scale,
                             out[i, j].data_ptr(), work.data_ptr())  # fmt: skip
    return out.to(q.dtype)


def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """The indexer's scores sum_h w_h relu(q_h . k_t), each query on its own (attn_cpu.c): q [b, s, h, d], keys
    [b, t, d], w [b, s, h] -> fp32 [b, s, t]. None off the CPU or without kernels."""
    kern = lib()
    b, s, h, d = q.shape
    if kern is None or q.device.type != "cpu":
        return None
    t = keys.shape[1]
    out = torch.empty(b, s, t, dtype=torch.float32)
    for i in range(b):
        qi, ki, wi = q[i].float().contiguous(), keys[i].float().contiguous(), w[i].float().contiguous()
        kern.index_scores(qi.data_ptr(), s, h, d, ki.data_ptr(), t, wi.data_ptr(), out[i].data_ptr())
    return out


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """The indices of each row's k largest values, x [n, V] fp32 -> int64 [n, k] (each row's in no particular
    order; ties keep the earlier index); None without kernels."""
    kern = lib()
    if kern is None or x.device.type != "cpu":
        return None
    x = x.float().contiguous()
    k = min(k, x.shape[1])
    out = torch.empty(x.shape[0], k, dtype=torch.int64)
    for r in range(x.shape[0]):
        kern.top_indices(x[r].data_ptr(), x.shape[1], k, out[r].data_ptr())
    return out


def fp8_dequant(
    w: torch.Tensor, scale256: torch.Tensor, block: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """FP8 W [O, I] (uint8 view) with fp32 block scales x 256 -> fp32 or bf16 [O, I] (exact, in a scratch buffer
    valid until the next expansion); None without kernels."""
    k = lib()
    if k is None:
        return None
    O, I = w.shape
    out = scratch((O, I), dtype)
    bf16 = int(dtype == torch.bfloat16)
    k.fp8_expand(w.data_ptr(), scale256.data_ptr(), O, I, block, out.data_ptr(), bf16, 0, O)
    return out


def sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor | None:
    """model.mhc.sinkhorn fused: c [..., hc, hc] -> fp32, the same operations in the same order (sums of hc terms
    may round differently by an ulp); None without kernels or off the CPU."""
    k = lib()
    if k is None or c.device.type != "cpu":
        return None
    hc = c.shape[-1]
    out = c.float().contiguous().clone()
    k.sinkhorn(out.data_ptr(), out.numel() // (hc * hc), hc, iters, eps)
    return out


def mhc_mixes(
    x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, eps: float, hc_eps: float
):
    """model.mhc.mixes with its Sinkhorn, fused: x [..., hc, d] -> (pre, post, comb) fp32, equal to fp32 rounding;
    None without kernels or off the CPU."""
    k = lib()
    if k is None or x.device.type != "cpu":
        return None
    hc, d = x.shape[-2:]
    lead = x.shape[:-2]
    xf = x.float().contiguous()
    fn, scale, base = fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    out = torch.empty(*lead, (2 + hc) * hc, dtype=torch.float32)
    k.mhc_mixes(xf.data_ptr(), xf.numel() // (hc * d), hc, d, fn.data_ptr(), scale.data_ptr(), base.data_ptr(),
                iters, eps, hc_eps, out.data_ptr())  # fmt: skip
    return out[..., :hc], out[..., hc : 2 * hc], out[..., 2 * hc :].unflatten(-1, (hc, hc))


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


def _streams(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, torch.Tensor]:
    """hc residual streams x [..., hc, d] as the kernels read them: (x contiguous, tokens, hc, d, an fp32 output of
    x's shape)."""
    hc, d = x.shape[-2:]
    xf = x.contiguous()
    return xf, xf.numel() // (hc * d), hc, d, torch.empty(x.shape, dtype=torch.float32)


def _host_lib(*fp32: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels where every tensor given is an fp32 host tensor (a fused operation's activations), else None."""
    k = lib()
    if k is None or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in fp32):
        return None
    return k


def hc_collapse_norm(x: torch.Tensor, weights: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm(gamma, eps) of model.mhc.collapse(x, weights), fused: x [..., hc, d] fp32, weights [..., hc] -> fp32
    [..., d], equal to fp32 rounding; None without kernels, off the CPU or for another dtype."""
    k = _host_lib(x)
    if k is None:
        return None
    hc, d = x.shape[-2:]
    xf, w, g = x.contiguous(), _f32(weights), _f32(gamma)  # named: a temporary's pointer would dangle in the call
    out = torch.empty(*x.shape[:-2], d, dtype=torch.float32)
    k.hc_collapse_norm(xf.data_ptr(), xf.numel() // (hc * d), hc, d, w.data_ptr(), g.data_ptr(), eps, out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor | None:
    """model.layers.RMSNorm fused: x [..., d] fp32 -> fp32, equal to fp32 rounding; None without kernels, off the
    CPU or for another dtype."""
    k = _host_lib(x)
    if k is None:
        return None
    xf, g = x.contiguous(), _f32(gamma)  # named: see hc_collapse_norm
    out = torch.empty(x.shape, dtype=torch.float32)
    k.rms_norm(xf.data_ptr(), xf.numel() // x.shape[-1], x.shape[-1], g.data_ptr(), eps, out.data_ptr())
    return out


ROUTE_FUNCS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


def moe_route(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, temp: float, func: str, k: int, norm: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """model.moe.Gate's routing fused: x [t, d] fp32, W [E, d] and bias [E] fp32 -> (weights fp32 [t, k], ids int64
    [t, k]), the ids in descending order of score + bias; equal to fp32 rounding. None without kernels, off the
    CPU or for a scoring function it does not know."""
    kern = lib()
    if kern is None or x.device.type != "cpu" or func not in ROUTE_FUNCS or x.dim() != 2:
        return None
    xf, wf, bf = _f32(x), _f32(w), _f32(bias)  # named: see hc_collapse_norm
    t, (e, d) = xf.shape[0], wf.shape
    weights, ids = torch.empty(t, k, dtype=torch.float32), torch.empty(t, k, dtype=torch.int64)
    kern.moe_route(xf.data_ptr(), t, d, wf.data_ptr(), bf.data_ptr(), e, temp, ROUTE_FUNCS[func], k, int(norm), scale,
                   weights.data_ptr(), ids.data_ptr())  # fmt: skip
    return weights, ids


def rope_rotate(x: torch.Tensor, cis: torch.Tensor, dim: int, inverse: bool) -> torch.Tensor | None:
    """model.layers.Rope.rotate fused: x [b, s, (h,) width] fp32, cis complex64 [s, dim / 2] -> a new fp32 tensor,
    equal to fp32 rounding; None without kernels, off the CPU or for another dtype."""
    k = _host_lib(x)
    if k is None or cis.dtype != torch.complex64:
        return None
    if x.dim() < 3 or cis.shape[0] != x.shape[1] or cis.shape[-1] * 2 != dim:
        return None
    xf, c = x.contiguous(), torch.view_as_real(cis.contiguous())  # named: see hc_collapse_norm
    out = torch.empty(x.shape, dtype=torch.float32)
    per = xf[0, 0].numel() // x.shape[-1]  # rows (heads) sharing one position
    k.rope_rotate(xf.data_ptr(), xf.numel() // x.shape[-1], x.shape[-1], dim, c.data_ptr(), per, x.shape[1],
                  int(inverse), out.data_ptr())  # fmt: skip
    return out


def engram_gate(x: torch.Tensor, kv: torch.Tensor, qw: torch.Tensor, kw: torch.Tensor, eps: float):
    """model.engram.Engram's gated write after its wkv product, fused: x [..., hc, d] fp32, kv [..., (hc + 1) d]
    (the keys, then the value) -> fp32 [..., hc, d], equal to fp32 rounding; None without kernels, off the CPU or for
    another dtype."""
    k = _host_lib(x, kv)
    if k is None:
        return None
    (xf, t, hc, d, out), kf, q, w = _streams(x), kv.contiguous(), _f32(qw), _f32(kw)  # named: see hc_collapse_norm
    k.engram_gate(xf.data_ptr(), kf.data_ptr(), t, hc, d, q.data_ptr(), w.data_ptr(), eps, d**-0.5, out.data_ptr())
    return out


def hc_expand(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor | None:
    """model.mhc.expand fused: f [..., d], x [..., hc, d] fp32 -> fp32 [..., hc, d], the same sums in the same order;
    None without kernels, off the CPU or for another dtype."""
    k = _host_lib(x, f)
    if k is None:
        return None
    (xf, t, hc, d, out), ff, p, c = _streams(x), f.contiguous(), _f32(post), _f32(comb)  # named: see hc_collapse_norm
    k.hc_expand(ff.data_ptr(), xf.data_ptr(), p.data_ptr(), c.data_ptr(), t, hc, d, out.data_ptr())
    return out


# ------------------------------------------------------------------------------------------ AMX (prefill)


def amx_ready() -> bool:
    """The CPU has AMX-BF16, the kernels were built for it, and the kernel lets this process use the tiles."""
    if b"amx_bf16" not in _cpu_flags():  # nothing to ask the kernels (and no build just to learn that)
        return False
    k = lib()
    return bool(k is not None and k.amx_ready())


def _up32(n: int) -> int:
    return -(-n // 32) * 32


def _vnni(x: torch.Tensor, kp: int) -> tuple[torch.Tensor, int]:
    """x fp32 [m, k] -> its two bf16 terms in AMX's tile layout (split_vnni), padded to Mp tokens and kp columns."""
    m, k = x.shape
    mp = _up32(m)
    xv = scratch((2 * mp, kp), torch.int16)
    lib().split_vnni(x.data_ptr(), m, k, xv.data_ptr(), mp, kp)
    return xv, mp


def amx_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [m, k] fp32 @ W^T for W bf16 [n, k] (an expansion, or a bf16 weight) -> fp32 [m, n]: x enters as two bf16
    terms, W exactly, and products sum in fp32 in an order fixed per output element (see amx_cpu.c)."""
    x = x.float().contiguous()
    (m, k), (n, kw) = x.shape, w.shape
    if k != kw:
        raise ValueError(f"x has {k} columns, W {kw}")
    Kp, Np = _up32(k), _up32(n)
    if (Np, Kp) != (n, k) or not w.is_contiguous():  # tiles read whole 32-row, 32-column blocks
        padded = scratch((Np, Kp), torch.bfloat16)
        padded.zero_()
        padded[:n, :k] = w
        w = padded
    xv, mp = _vnni(x, Kp)
    y = torch.empty(m, n, dtype=torch.float32)
    lib().amx_linear(w.data_ptr(), Np, Kp, xv.data_ptr(), mp, m, n, y.data_ptr())
    return y


def amx_packed(x: torch.Tensor, w, fmt: str, shape: tuple[int, int], scale256=None, block: int = 0):
    """amx_linear(x, expansion of W) without the expansion going through memory: each thread expands one 32-row
    panel of W into a buffer that stays in its L2 and multiplies it at once. Same products, same order, same bits.
    fmt "fp8" (w: uint8 [N, K] with scales x 256 of block x block), "bfp4_b" / "bfp8_b" (w: the tiles of [N, K]);
    N and K as the expansion's. None where it cannot run (no AMX, K not a multiple of 32): expand instead."""
    n, k = shape
    code = 0 if fmt == "fp8" else MBITS[fmt]
    kern = lib()
    x = x.float().contiguous()
    if kern is None or k % 32 or x.shape[1] != k or (code and n % 32) or not amx_ready():
        return None
    xv, mp = _vnni(x, k)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    sp = scale256.data_ptr() if scale256 is not None else None
    if not kern.amx_linear_packed(code, _ptr(w), sp, block, n, k, xv.data_ptr(), mp, x.shape[0], y.data_ptr()):
        return None
    return y


# ------------------------------------------------------------------------------------- fp32 (prefill without AMX)

PACKED_FMTS = {"fp8": 0, "bf16": 1, "bfp4_b": 3, "bfp8_b": 7}


def f32_packed_ready() -> bool:
    """This build has the fused fp32 product on packed weights (AVX2 + FMA or AVX-512 F: packed_cpu.c)."""
    k = lib()
    return bool(k is not None and k.f32_packed_ready())


def packed_linear(x: torch.Tensor, w, fmt: str, shape: tuple[int, int], scale256=None, block: int = 0):
    """x [m, k] fp32 @ W^T for packed W [n, k] -> fp32 [m, n], each thread expanding 32-row panels of W a k-block at
    a time into a buffer that stays in its caches (packed_cpu.c): exact weights, each output one fp32 chain of fused
    multiply-adds in k order, the same bits whatever rows, tokens or threads run. fmt "fp8" (w: uint8 [n, k] with
    scales x 256 of block x block), "bf16" (w: bfloat16 [n, k]), "bfp4_b" / "bfp8_b" (w: the tiles of [n, k]).
    None where it cannot run (no vector build, shapes the tiles do not cover): expand and multiply instead."""
    n, k = shape
    kern = lib()
    if kern is None or not kern.f32_packed_ready() or x.shape[-1] != k:
        return None
    if fmt in MBITS and (n % 32 or k % 32):
        return None
    x = x.float().contiguous()
    m, lanes = x.shape[0], kern.f32_packed_lanes()
    xp = scratch((-(-m // lanes) * lanes * k,), torch.float32)
    y = torch.empty(m, n, dtype=torch.float32)
    sp = scale256.data_ptr() if scale256 is not None else None
    if not kern.f32_linear_packed(PACKED_FMTS[fmt], _ptr(w), sp, block, n, k, x.data_ptr(), m, xp.data_ptr(),
                                  y.data_ptr()):  # fmt: skip
        return None
    return y
