"""mHC's Sinkhorn on the GPU as one kernel (torch runs it as ~120 launches a call, two calls a block): one program
per token's hc x hc matrix, the same operations in the same order as model/mhc.py's sinkhorn."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_iters"])
def _sinkhorn_kernel(c_ptr, out_ptr, n_iters, eps, HC: tl.constexpr):
    r = tl.arange(0, HC)
    offs = tl.program_id(0).to(tl.int64) * HC * HC + r[:, None] * HC + r[None, :]
    m = tl.load(c_ptr + offs)
    m = tl.exp(m - tl.max(m, axis=1)[:, None])
    m = m / tl.sum(m, axis=1)[:, None] + eps
    m = m / (tl.sum(m, axis=0)[None, :] + eps)
    for _ in range(1, n_iters):
        m = m / (tl.sum(m, axis=1)[:, None] + eps)
        m = m / (tl.sum(m, axis=0)[None, :] + eps)
    tl.store(out_ptr + offs, m)


def sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor | None:
    """c [..., hc, hc] -> fp32 doubly-stochastic-ish mixes; None when hc is not a power of two (the kernel's
    blocks need one: the caller then runs the torch version)."""
    hc = c.shape[-1]
    if hc & (hc - 1):
        return None
    src = c.float().contiguous()
    out = torch.empty_like(src)
    n = src.numel() // (hc * hc)
    if n:
        _sinkhorn_kernel[(n,)](src, out, iters, eps, HC=hc)
    return out
